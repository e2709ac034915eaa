"""GET /api/models, PUT /api/models/folders and DELETE /api/models/local/ against a real
server: scan folders one level deep, split sets, links, a file reachable twice, hostile
headers with the server alive; the folders kept in settings.json; deleting a set whole."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _gguf_files import hostile_headers, make_model, split_model, write_kind
from _models_support import Events
from conftest import ServerProcess, start_server


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("made")
    dense = make_model(d / "dense.gguf", arch="qwen3")
    return {"moe": make_model(d / "moe.gguf"), "dense": dense, "dir": d}


def local(s: ServerProcess) -> list[dict[str, Any]]:
    status, _, body = s.request("GET", "/api/models")
    assert status == 200, body
    return list(body["local"])


@pytest.fixture
def tree(tmp_path: Path, made: dict[str, Path]) -> dict[str, Path]:
    """A models folder and a scan folder with every case the listing must get right."""
    models, scan, outside = tmp_path / "models", tmp_path / "scan", tmp_path / "outside"
    for d in (models, scan, outside):
        d.mkdir()
    shutil.copy(made["moe"], models / "alpha-moe.gguf")
    (models / "set").mkdir()
    split_model(made["dense"], models / "set", "beta-dense", 3)          # complete, in a folder
    parts = split_model(made["dense"], models, "gamma-dense", 3)
    parts[1].unlink()                                                    # a shard missing
    (models / "deep" / "deeper").mkdir(parents=True)
    shutil.copy(made["moe"], models / "deep" / "deeper" / "too-deep.gguf")  # two levels: no
    shutil.copy(made["moe"], outside / "linked-away.gguf")
    os.symlink(outside, models / "link-to-folder")                       # a folder link: no
    os.symlink(models / "alpha-moe.gguf", scan / "alpha-again.gguf")     # same file twice
    os.symlink(outside / "linked-away.gguf", models / "file-link.gguf")  # a file link: yes
    for i, data in enumerate(hostile_headers().values()):
        (scan / f"hostile-{i:02d}.gguf").write_bytes(data)
    write_kind(scan / "mmproj-x.gguf", arch="clip", kv={"general.type": "mmproj"})
    (models / "notes.txt").write_text("not a model")
    (models / "dl.gguf.part").write_bytes(b"GGUF")
    return {"models": models, "scan": scan, "outside": outside}


def test_listing_reads_one_level_groups_sets_and_survives_hostile_headers(
        tmp_path: Path, tree: dict[str, Path]) -> None:
    s = start_server(tmp_path / "data", "--models-dir", str(tree["models"]), "--scan-dir",
                     str(tree["scan"]), wait_ready=False)
    try:
        rows = local(s)
        names = [(r["folder"], r["name"]) for r in rows]
        assert ("", "alpha-moe.gguf") in names and ("", "file-link.gguf") in names
        assert ("set", "beta-dense-00001-of-00003.gguf") in names
        assert ("", "gamma-dense-00001-of-00003.gguf") in names
        assert not any("too-deep" in n or "linked-away" in n or "alpha-again" in n
                       or n.endswith(".part") for _, n in names), names
        by = {r["name"]: r for r in rows}
        beta, gamma = by["beta-dense-00001-of-00003.gguf"], by["gamma-dense-00001-of-00003.gguf"]
        assert beta["complete"] and beta["shards"] == 3 and len(beta["files"]) == 3
        assert beta["dir"] == str(tree["models"]) and beta["role"] == "model"
        assert not gamma["complete"] and len(gamma["files"]) == 2
        assert by["alpha-moe.gguf"]["streamable"] and by["alpha-moe.gguf"]["arch"] == "qwen3moe"
        assert not beta["streamable"]
        hostile = [r for r in rows if r["name"].startswith("hostile-")]
        assert len(hostile) == len(hostile_headers())
        assert all(r["role"] == "" and r["arch"] == "" and "error" in r for r in hostile)
        assert by["mmproj-x.gguf"]["role"] == "projector"
        # the models folder comes first, then the scan folder
        order = [r["dir"] for r in rows]
        assert order.index(str(tree["scan"])) > order.index(str(tree["models"]))
        assert s.info()["state"] == "empty"                 # alive after every header
    finally:
        s.stop()


def test_folders_are_chosen_kept_and_evented(tmp_path: Path, tree: dict[str, Path]) -> None:
    data = tmp_path / "data"
    s = start_server(data, wait_ready=False)
    ev = Events(s)
    try:
        default = tmp_path / "data" / "models"
        status, _, body = s.request("GET", "/api/models")
        assert body["models_dir"] == str(default) and body["folders"]["models_dir_at_launch"] is False
        for bad in ({"models_dir": "relative/dir"}, {"scan_dirs": [str(tmp_path / "missing")]},
                    {"scan_dirs": ["relative"]}, {"scan_dirs": "nope"}, {"models_dir": 3}):
            status, _, err = s.request("PUT", "/api/models/folders", bad)
            assert status == 400 and err["error"], (bad, err)
        chosen = tmp_path / "chosen-models"
        status, _, body = s.request("PUT", "/api/models/folders",
                                    {"models_dir": str(chosen), "scan_dirs": [str(tree["models"])]})
        assert status == 200, body
        assert body["models_dir"] == str(chosen) and chosen.is_dir()
        assert body["scan_dirs"] == [str(tree["models"])]
        assert any(r["name"] == "alpha-moe.gguf" for r in body["local"])
        assert ev.wait("models_folders", lambda d: d["models_dir"] == str(chosen))
        saved = json.loads((data / "settings.json").read_text())["model_folders"]
        assert saved == {"models_dir": str(chosen), "scan_dirs": [str(tree["models"])]}
        # a field left out is left as it is
        status, _, body = s.request("PUT", "/api/models/folders", {"scan_dirs": []})
        assert body["models_dir"] == str(chosen) and body["scan_dirs"] == []
    finally:
        ev.close()
        s.stop()
    s = start_server(data, wait_ready=False)                # kept between runs
    try:
        body = s.request("GET", "/api/models")[2]
        assert body["models_dir"] == str(chosen)
        assert body["folders"]["chosen_models_dir"] == str(chosen)
    finally:
        s.stop()
    s = start_server(data, "--models-dir", str(tree["models"]), wait_ready=False)
    try:
        status, _, body = s.request("PUT", "/api/models/folders", {"models_dir": str(chosen)})
        assert status == 409, body
        assert s.request("GET", "/api/models")[2]["folders"]["models_dir_at_launch"] is True
    finally:
        s.stop()


def test_delete_local_takes_a_listed_name_and_deletes_the_set_whole(
        tmp_path: Path, tree: dict[str, Path], made: dict[str, Path]) -> None:
    data = tmp_path / "data"
    alpha = tree["models"] / "alpha-moe.gguf"
    s = start_server(data, "--models-dir", str(tree["models"]), "--scan-dir", str(tree["scan"]),
                     wait_ready=False)
    try:
        assert s.request("PUT", "/api/config", {"values": {"model": str(alpha)}})[0] == 200
        for bad in ("..", "a/b/c", "..%2F..%2Fetc%2Fpasswd", "set/..", "C:x.gguf"):
            status, _, body = s.request("DELETE", f"/api/models/local/{bad}")
            assert status in (400, 404), (bad, status, body)
        # a scan folder's model is never deleted here
        status, _, body = s.request("DELETE", "/api/models/local/mmproj-x.gguf")
        assert status == 404 and (tree["scan"] / "mmproj-x.gguf").exists()
        # the set in its folder goes whole, and the folder with it
        status, _, body = s.request("DELETE", "/api/models/local/set/beta-dense-00001-of-00003.gguf")
        assert status == 200 and body["ok"] and body["freed"] > 0, body
        assert not (tree["models"] / "set").exists()
        # a link goes as the link; its target stays
        status, _, body = s.request("DELETE", "/api/models/local/file-link.gguf")
        assert status == 200 and (tree["outside"] / "linked-away.gguf").exists()
        assert not (tree["models"] / "file-link.gguf").exists()
        # its packed experts file is no model of its own, and goes with it
        packed = alpha.with_name(alpha.name + ".bmoe-packed")
        packed.write_bytes(b"packed")
        names = [r["name"] for r in s.request("GET", "/api/models")[2]["local"]]
        assert "alpha-moe.gguf" in names and not [n for n in names if "packed" in n]
        # deleting the saved model forgets the setting
        ev = Events(s)
        status, _, body = s.request("DELETE", "/api/models/local/alpha-moe.gguf")
        assert status == 200 and not alpha.exists() and not packed.exists(), body
        cfg = ev.wait("config", lambda d: True)
        assert not cfg["values"].get("model")
        ev.close()
        assert s.request("DELETE", "/api/models/local/alpha-moe.gguf")[0] == 404
    finally:
        s.stop()


def test_a_loaded_model_is_in_use(tmp_path: Path, made: dict[str, Path]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(made["moe"], models / "m.gguf")
    s = start_server(tmp_path / "data", "--models-dir", str(models), "-m", str(models / "m.gguf"))
    try:
        status, _, body = s.request("DELETE", "/api/models/local/m.gguf")
        assert (status, body["code"]) == (409, "in_use"), body
        assert (models / "m.gguf").exists()
        assert s.request("POST", "/api/session/unload", {})[0] == 200
        assert s.request("DELETE", "/api/models/local/m.gguf")[0] == 200
    finally:
        s.stop()


@pytest.fixture(scope="module")
def local_only_probe() -> Iterator[Any]:
    from _app_routes import app_routes

    from bmoe.http.access import AccessPolicy, check_access
    from bmoe.http.errors import HTTPError
    from bmoe.http.types import Request

    def refused(method: str, target: str, peer: str) -> str | None:
        path = target.split("?", 1)[0]
        from urllib.parse import unquote
        req = Request(method, target, unquote(path), {}, [("host", "127.0.0.1:8765"),
                      ("content-type", "application/json")], b"", (peer, 5000),
                      ("127.0.0.1", 8765))
        try:
            check_access(req, AccessPolicy(bound_host="0.0.0.0", port=8765, api_key=None),
                         app_routes())
        except HTTPError as e:
            return e.code
        return None
    yield refused


@pytest.mark.parametrize("method,target", [
    ("DELETE", "/api/models/local/m.gguf"), ("DELETE", "/api/models/local/folder/m.gguf"),
    ("DELETE", "/api/models/local/folder%2Fm.gguf"), ("POST", "/api/models/url"),
    ("PUT", "/api/models/folders"),
])
def test_local_only_routes_refuse_a_network_peer(local_only_probe: Any, method: str,
                                                 target: str) -> None:
    assert local_only_probe(method, target, "10.1.2.3") == "local_only"
    assert local_only_probe(method, target, "127.0.0.1") is None


@pytest.mark.parametrize("method,target", [
    ("GET", "/api/models"), ("POST", "/api/models/download"), ("POST", "/api/hf/search"),
    ("POST", "/api/hf/inspect"), ("DELETE", "/api/models/partial/x"),
])
def test_other_models_routes_answer_the_network(local_only_probe: Any, method: str,
                                                target: str) -> None:
    assert local_only_probe(method, target, "10.1.2.3") is None


def test_a_split_moe_loads_on_plain_mmap_and_answers(tmp_path: Path, made: dict[str, Path]) -> None:
    """The probe says a split set does not stream; the engine agrees (no streamer)."""
    parts = split_model(made["moe"], tmp_path, "moe-split", 3)
    s = start_server(tmp_path / "data", "-m", str(parts[0]), "--scan-dir", str(tmp_path))
    try:
        info = s.info()
        assert info["state"] == "ready" and info["model"]["streaming"] is False, info
        status, _, body = s.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert status == 200 and body["choices"][0]["message"]["content"], body
        row = next(m for m in local(s) if m["name"] == "moe-split-00001-of-00003.gguf")
        assert row["streamable"] is False and row["complete"]
    finally:
        s.stop()
