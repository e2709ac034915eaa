"""The UI's files: content types, index, HEAD, and no way out of the folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from _http_support import assert_security_headers, make_app, one, request_bytes


@pytest.fixture
def ui(tmp_path: Path) -> Path:
    root = tmp_path / "assets"
    (root / "sub").mkdir(parents=True)
    (root / "index.html").write_text("<!doctype html><title>bmoe</title>")
    (root / "app.js").write_text("console.log(1)")
    (root / "app.css").write_text("body{}")
    (root / "logo.svg").write_text("<svg/>")
    (root / "logo.png").write_bytes(b"\x89PNG")
    (root / "favicon.ico").write_bytes(b"\0\0")
    (root / "manifest.json").write_text("{}")
    (root / "blob.bin").write_bytes(b"\1")
    (root / "sub" / "page.html").write_text("sub")
    (root / ".hidden").write_text("no")
    (tmp_path / "secret.txt").write_text("outside")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    return root


@pytest.mark.parametrize("path,content_type", [
    ("/", "text/html; charset=utf-8"), ("/index.html", "text/html; charset=utf-8"),
    ("/app.js", "text/javascript; charset=utf-8"), ("/app.css", "text/css; charset=utf-8"),
    ("/logo.svg", "image/svg+xml"), ("/logo.png", "image/png"), ("/favicon.ico", "image/x-icon"),
    ("/manifest.json", "application/json"), ("/blob.bin", "application/octet-stream"),
    ("/sub/page.html", "text/html; charset=utf-8"), ("/sub/page%2Ehtml", "text/html; charset=utf-8"),
])
def test_files_are_served_with_their_type(ui: Path, path: str, content_type: str) -> None:
    response = one(make_app(static_dir=ui), request_bytes("GET", path))
    assert response.status == 200
    assert response.header("content-type") == content_type
    assert_security_headers(response)


def test_index_body_and_head(ui: Path) -> None:
    app = make_app(static_dir=ui)
    assert one(app, request_bytes("GET", "/")).body == b"<!doctype html><title>bmoe</title>"
    head = one(app, request_bytes("HEAD", "/"), head_only=True)
    assert head.status == 200 and head.header("content-length") == "34"


@pytest.mark.parametrize("path", [
    "/../secret.txt", "/%2e%2e/secret.txt", "/sub/..%2f..%2fsecret.txt", "/sub/%2e%2e/%2e%2e/secret.txt",
    "/..%5csecret.txt", "/link.txt", "/.hidden", "/sub", "/sub/", "/nope.html", "//etc/passwd",
    "/%00", "/index.html%00.png", "/sub/./page.html", "/" + "a" * 5000, "/etc/passwd",
])
def test_nothing_outside_the_folder(ui: Path, path: str) -> None:
    response = one(make_app(static_dir=ui), request_bytes("GET", path))
    assert response.status in (400, 404), path
    assert response.header("content-type") == "application/json"
    assert b"outside" not in response.body


def test_no_static_dir_is_404_json() -> None:
    response = one(make_app(), request_bytes("GET", "/"))
    assert response.status == 404 and response.json()["code"] == "not_found"


def test_api_paths_never_fall_back_to_files(ui: Path) -> None:
    (ui / "api").mkdir()
    (ui / "api" / "x").write_text("file")
    assert one(make_app(static_dir=ui), request_bytes("GET", "/api/x")).status == 404


def test_post_to_a_file_is_404(ui: Path) -> None:
    assert one(make_app(static_dir=ui), request_bytes("POST", "/app.js", body=b"")).status == 404
