"""The security model, end to end: real bmoe-server processes, the real engine, the tiny MoE.

Binding refusals at start, the key, the Host check, the Origin / Sec-Fetch-Site matrix,
415, the response headers, confinement of model paths, the local-only routes from a real
non-loopback peer (a network namespace joined by a veth pair) and ``--parent-pid``.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _app_routes import LOCAL_ONLY, concrete
from _e2e_support import SECURITY_HEADERS, Conn, Reply, call, port_of, request_bytes, wait_for
from _netns import veth_namespace
from conftest import ServerProcess, start_server

from bmoe.http import access
from bmoe.http.parent import process_alive

KEY = "s3cret-k3y-for-tests"
DEV_ORIGIN = "http://localhost:5173"
REPO = Path(__file__).resolve().parents[1]


def server_cmd(data_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data_dir),
            "--threads", "1", "--no-auto", *args]


def key_file(folder: Path, text: str = KEY + "\n", name: str = "key") -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    """A loopback server with a key, one extra allowed origin and the tiny MoE loaded."""
    data = tmp_path_factory.mktemp("keyed")
    srv = start_server(data, "-m", str(tiny_moe), "-c", "512", "--api-key-file", str(key_file(data)),
                       "--allow-origin", DEV_ORIGIN, wait_ready=False)
    srv.key = KEY
    try:
        assert srv.wait_state("ready", "error")["state"] == "ready"
        yield srv
    finally:
        srv.stop()


# --- binding at start ----------------------------------------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_a_host_beyond_loopback_is_refused_without_a_key(tmp_path: Path, host: str) -> None:
    done = subprocess.run(server_cmd(tmp_path, "--host", host), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "listening" not in done.stdout
    assert f"refusing to listen on {host} without a key" in done.stderr
    assert "--api-key-file" in done.stderr


@pytest.mark.parametrize("case", ["empty key file", "blank key file", "both key options",
                                  "missing key file"])
def test_bad_key_options_are_refused(tmp_path: Path, case: str) -> None:
    args = {
        "empty key file": ["--api-key-file", str(key_file(tmp_path, "", "empty"))],
        "blank key file": ["--api-key-file", str(key_file(tmp_path, "\n  \n", "blank"))],
        "both key options": ["--api-key", KEY, "--api-key-file", str(key_file(tmp_path))],
        "missing key file": ["--api-key-file", str(tmp_path / "nope")],
    }[case]
    done = subprocess.run(server_cmd(tmp_path, "--host", "0.0.0.0", *args), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    expected = {"empty key file": "is empty", "blank key file": "is empty",
                "both key options": "not allowed with argument",
                "missing key file": "cannot read the key file"}[case]
    assert expected in done.stderr, done.stderr


def test_a_host_beyond_loopback_is_accepted_with_a_key_file(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--host", "0.0.0.0", "--api-key-file", str(key_file(tmp_path)),
                       wait_ready=False)
    try:
        port = port_of(srv)
        assert call(port, "GET", "/api/info").status == 401
        reply = call(port, "GET", "/api/info", key=KEY)
        assert reply.status == 200 and reply.json()["state"] == "empty"
    finally:
        srv.stop()


def test_no_api_key_opens_the_server_with_a_warning(tmp_path: Path) -> None:
    errors = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(server_cmd(tmp_path, "--host", "0.0.0.0", "--no-api-key"),
                            stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line
        port = int(line.rstrip().rstrip("/").rsplit(":", 1)[1])
        assert call(port, "GET", "/api/info").status == 200
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    errors.seek(0)
    warning = errors.read()
    errors.close()
    assert "warning: listening on 0.0.0.0 with no key" in warning


# --- the key -------------------------------------------------------------------------------

def api_routes() -> list[tuple[str, str]]:
    """Every route the server has, its local-only ones, and unknown ones."""
    now = [("GET", "/api/info"), ("POST", "/api/session/load"), ("POST", "/api/session/unload"),
           ("POST", "/api/cancel"), ("GET", "/api/params"), ("GET", "/api/config"),
           ("PUT", "/api/config"), ("GET", "/api/events"), ("GET", "/v1/models"),
           ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/responses"),
           ("POST", "/api/decide"), ("GET", "/api/ws"), ("POST", "/v1/messages/count_tokens"),
           ("GET", "/api/nope"), ("DELETE", "/v1/nope"), ("GET", "/api"),
           ("GET", "/v1"), ("HEAD", "/api/info")]
    local = [(m, concrete(p)) for m, p in sorted(LOCAL_ONLY)]
    return now + local


def test_every_api_route_needs_the_key(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    refused = []
    for method, path in api_routes():
        reply = call(port, method, path, raw=None if method in ("GET", "HEAD") else b"{}")
        if reply.status != 401 or reply.header("www-authenticate") != "Bearer":
            refused.append((method, path, reply.status))
    assert not refused


@pytest.mark.parametrize("headers", [
    [("Authorization", "Bearer wrong")], [("X-Api-Key", "wrong")], [("Authorization", KEY)],
    [("Authorization", "Basic " + KEY)], [("Authorization", f"Bearer {KEY}x")],
    [("Authorization", f"Bearer {KEY[:-1]}")], [("X-Api-Key", KEY.upper())], [("Cookie", f"key={KEY}")],
])
def test_a_wrong_key_is_refused(keyed: ServerProcess, headers: list[tuple[str, str]]) -> None:
    reply = call(port_of(keyed), "GET", f"/api/info?key={KEY}", headers=headers)
    assert reply.status == 401 and reply.code == "unauthorized"
    assert reply.header("www-authenticate") == "Bearer"


@pytest.mark.parametrize("headers", [
    [("Authorization", f"Bearer {KEY}")], [("Authorization", f"bearer  {KEY} ")], [("X-Api-Key", KEY)],
    [("Authorization", "Bearer wrong"), ("X-Api-Key", KEY)],
])
def test_the_key_is_accepted_in_either_header(keyed: ServerProcess,
                                              headers: list[tuple[str, str]]) -> None:
    reply = call(port_of(keyed), "GET", "/api/info", headers=headers)
    assert reply.status == 200 and reply.json()["state"] == "ready"


def test_ui_files_are_served_without_the_key(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    for path in ("/", "/index.html", "/app.js", "/favicon.ico"):
        assert call(port, "GET", path).status in (200, 404)
    if (REPO / "assets" / "index.html").is_file():
        reply = call(port, "GET", "/")
        assert reply.status == 200
        assert (reply.header("content-type") or "").startswith("text/html")


def test_the_key_is_compared_in_constant_time() -> None:
    """Read, not timed: the comparison is hmac.compare_digest, and the check uses it."""
    assert "hmac.compare_digest(" in inspect.getsource(access.key_matches)
    assert "key_matches(" in inspect.getsource(access._check_key)
    assert "==" not in inspect.getsource(access._check_key)


# --- the Host check (loopback binding) ------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1", "localhost",
                                  "127.0.0.1:{other}", "localhost.evil.example:{port}",
                                  "127.0.0.1.nip.io:{port}", "0.0.0.0:{port}", "[::ffff:7f00:1]x"])
def test_a_foreign_host_name_is_refused(keyed: ServerProcess, host: str) -> None:
    port = port_of(keyed)
    name = host.format(port=port, other=port + 1)
    for method, path in (("GET", "/api/info"), ("GET", "/"), ("POST", "/api/cancel")):
        reply = call(port, method, path, host=name, key=KEY)
        assert (reply.status, reply.code) == (421, "bad_host"), (method, path, reply)
    assert call(port, "GET", "/api/info", host=name).status == 421   # before the key


def test_a_request_without_host_is_refused(keyed: ServerProcess) -> None:
    conn = Conn(port_of(keyed))
    conn.send(f"GET /api/info HTTP/1.0\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    assert conn.read_reply().status == 421
    conn.close()


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}",
                                  "LOCALHOST:{port}", "127.3.2.1:{port}"])
def test_loopback_host_names_are_answered(keyed: ServerProcess, host: str) -> None:
    port = port_of(keyed)
    assert call(port, "GET", "/api/info", host=host.format(port=port), key=KEY).status == 200


# --- Origin and Sec-Fetch-Site -----------------------------------------------------------

ORIGIN_MATRIX = [
    # (Host, headers, admitted)
    ("127.0.0.1:{port}", [], True),                                          # a program
    ("127.0.0.1:{port}", [("Origin", "http://127.0.0.1:{port}")], True),     # the UI's own page
    ("localhost:{port}", [("Origin", "http://localhost:{port}")], True),
    ("localhost:{port}", [("Origin", "http://LOCALHOST:{port}/")], True),
    ("127.0.0.1:{port}", [("Origin", DEV_ORIGIN)], True),                     # --allow-origin
    ("127.0.0.1:{port}", [("Sec-Fetch-Site", "same-origin")], True),
    ("127.0.0.1:{port}", [("Sec-Fetch-Site", "none")], True),                 # typed in the bar
    ("127.0.0.1:{port}", [("Origin", "https://evil.example")], False),
    ("127.0.0.1:{port}", [("Origin", "http://127.0.0.1:{other}")], False),    # another port: same site
    ("127.0.0.1:{port}", [("Origin", "http://localhost:{port}")], False),     # another name
    ("127.0.0.1:{port}", [("Origin", "https://127.0.0.1:{port}")], False),
    ("127.0.0.1:{port}", [("Origin", "null")], False),
    ("127.0.0.1:{port}", [("Origin", "http://localhost:5174")], False),
    ("127.0.0.1:{port}", [("Origin", "http://127.0.0.1:{port}"), ("Origin", "https://evil.example")], False),
    ("127.0.0.1:{port}", [("Sec-Fetch-Site", "same-site")], False),
    ("127.0.0.1:{port}", [("Sec-Fetch-Site", "cross-site")], False),
    ("127.0.0.1:{port}", [("Sec-Fetch-Site", "SAME-SITE")], False),
]


@pytest.mark.parametrize("host, headers, admitted", ORIGIN_MATRIX)
def test_origin_matrix(keyed: ServerProcess, host: str, headers: list[tuple[str, str]],
                       admitted: bool) -> None:
    port = port_of(keyed)
    fill = {"port": port, "other": port + 1}
    hdrs = [(k, v.format(**fill)) for k, v in headers]
    for method, path in (("GET", "/api/info"), ("POST", "/api/cancel"), ("GET", "/v1/models")):
        reply = call(port, method, path, host=host.format(**fill), headers=hdrs, key=KEY)
        if admitted:
            assert reply.status == 200, (method, path, reply)
        else:
            assert (reply.status, reply.code) == (403, "forbidden_origin"), (method, path, reply)
        assert not [k for k, _ in reply.headers if k.startswith("access-control-")]


def test_ui_files_ignore_the_origin(keyed: ServerProcess) -> None:
    reply = call(port_of(keyed), "GET", "/", headers=[("Origin", "https://evil.example"),
                                                      ("Sec-Fetch-Site", "cross-site")])
    assert reply.status in (200, 404)


# --- 415 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type, admitted", [
    (None, False), ("text/plain", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), ("text/json", False), ("application/jsonx", False),
    ("application/json-patch+json", False), ("", False), ("application/json", True),
    ("APPLICATION/JSON", True), ("Application/Json; charset=utf-8", True),
    ("application/json;charset=UTF-8", True), (" application/json ; charset=utf-8", True),
])
def test_a_non_get_must_say_json(keyed: ServerProcess, content_type: str | None,
                                 admitted: bool) -> None:
    port = port_of(keyed)
    hdrs = [] if content_type is None else [("Content-Type", content_type)]
    for method, path in (("POST", "/api/cancel"), ("PUT", "/api/config"), ("DELETE", "/api/nope"),
                         ("POST", "/v1/chat/completions")):
        reply = call(port, method, path, raw=b"", headers=hdrs, json_type=False, key=KEY)
        if admitted:
            assert reply.status != 415, (method, path, reply)
        else:
            assert (reply.status, reply.code) == (415, "unsupported_media_type"), (method, path, reply)


def test_415_comes_before_any_handler(keyed: ServerProcess, tiny_moe: Path, tmp_path: Path) -> None:
    port = port_of(keyed)
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_moe, other)
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        body = json.dumps({"model": str(other)}).encode()
        reply = call(port, "POST", "/api/session/load", raw=body, json_type=False, key=KEY,
                     headers=[("Content-Type", ctype)])
        assert reply.status == 415
    info = call(port, "GET", "/api/info", key=KEY).json()
    assert info["state"] == "ready" and info["model"]["path"] != str(other)


# --- response headers -----------------------------------------------------------------------

def _sse_head(port: int) -> Reply:
    conn = Conn(port)
    try:
        conn.send(request_bytes("GET", "/api/events", host=f"127.0.0.1:{port}",
                                headers=[("Authorization", f"Bearer {KEY}")]))
        status, headers = conn.read_head()
        return Reply(status, headers, b"")
    finally:
        conn.close()


def _declared_too_large(port: int) -> Reply:
    conn = Conn(port)
    try:
        conn.send(request_bytes("POST", "/api/cancel", host=f"127.0.0.1:{port}", headers=[
            ("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
            ("Content-Length", str(9 << 20))]))
        return conn.read_reply()
    finally:
        conn.close()


def test_security_headers_on_every_response(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    replies = {
        "api 200": call(port, "GET", "/api/info", key=KEY),
        "api HEAD": call(port, "HEAD", "/api/info", key=KEY),
        "ui /": call(port, "GET", "/"),
        "static 404": call(port, "GET", "/no-such-file.js"),
        "api 404": call(port, "GET", "/api/nope", key=KEY),
        "405": call(port, "GET", "/api/cancel", key=KEY),
        "400": call(port, "POST", "/api/session/load", raw=b"[", key=KEY),
        "401": call(port, "GET", "/api/info"),
        "403": call(port, "GET", "/api/info", key=KEY, headers=[("Origin", "https://evil.example")]),
        "413": _declared_too_large(port),
        "415": call(port, "POST", "/api/cancel", key=KEY, json_type=False),
        "421": call(port, "GET", "/api/info", host="evil.example", key=KEY),
        "preflight": call(port, "OPTIONS", "/api/info", headers=[
            ("Origin", "https://evil.example"), ("Access-Control-Request-Method", "POST")]),
        "anthropic shape": call(port, "POST", "/v1/messages", raw=b"[", key=KEY),
        "sse": _sse_head(port),
    }
    assert replies["sse"].status == 200
    assert (replies["sse"].header("content-type") or "").startswith("text/event-stream")
    assert replies["413"].status == 413
    for name, reply in replies.items():
        for header, value in SECURITY_HEADERS.items():
            assert reply.header(header) == value, (name, header, reply)
        assert not [k for k, _ in reply.headers if k.startswith("access-control-")], name


# --- confinement, and the local-only routes from a real network peer ------------------------

SUBNET = f"10.213.{os.getpid() % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"

# Runs inside the namespace: each request on its own connection; prints [status, body].
NET_CLIENT = r"""
import http.client, json, sys
host, port, requests = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = []
for method, path, headers, body in requests:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request(method, path, body=None if body is None else body.encode(), headers=dict(headers))
    r = conn.getresponse()
    data = r.read()
    try:
        data = json.loads(data)
    except ValueError:
        data = None
    out.append([r.status, data])
    conn.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    with veth_namespace("e2e", SUBNET) as peer:
        yield peer.ns


def from_namespace(ns: str, port: int, requests: list[tuple[str, str, list[tuple[str, str]], Any]]) -> list[Any]:
    wire = [[m, p, h, None if b is None else (b if isinstance(b, str) else json.dumps(b))]
            for m, p, h, b in requests]
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", NET_CLIENT, HOST_IP,
                           str(port), json.dumps(wire)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def code_of(body: Any) -> str | None:
    return body.get("code") if isinstance(body, dict) else None


def test_a_network_peer(namespace: str, tmp_path: Path, tiny_moe: Path) -> None:
    data, models, scan = tmp_path / "data", tmp_path / "models", tmp_path / "scan"
    for folder in (data, models, scan):
        folder.mkdir()
    inside, scanned, escape = models / "inside.gguf", scan / "scanned.gguf", tmp_path / "escape.gguf"
    for copy in (inside, scanned, escape):
        shutil.copy(tiny_moe, copy)
    (models / "link.gguf").symlink_to(escape)
    (models / "sub").mkdir()
    (models / "sub" / "up").symlink_to(tmp_path)
    # The launch -m (tiny_moe, outside every models folder) is the operator's: not confined.
    srv = start_server(data, "--host", HOST_IP, "--api-key-file", str(key_file(tmp_path)),
                       "--models-dir", str(models), "--scan-dir", str(scan), "-m", str(tiny_moe),
                       "-c", "512", wait_ready=False)
    srv.key = KEY
    try:
        info = srv.wait_state("ready", "error")
        assert info["state"] == "ready" and info["model"]["path"] == str(tiny_moe)
        port = port_of(srv)
        at = f"{HOST_IP}:{port}"
        k = [("Host", at), ("Authorization", f"Bearer {KEY}")]
        kj = [*k, ("Content-Type", "application/json")]
        outside_paths = [str(escape), str(tiny_moe), "/etc/passwd", str(models / "link.gguf"),
                         f"{models}/../escape.gguf", "../escape.gguf", "sub/up/escape.gguf",
                         str(models), str(models) + "/", "/", "."]
        cases: list[tuple[str, tuple[str, str, list[tuple[str, str]], Any], int, str | None]] = [
            ("no key", ("GET", "/api/info", [("Host", at)], None), 401, "unauthorized"),
            ("wrong key", ("GET", "/api/info", [("Host", at), ("Authorization", "Bearer x")], None),
             401, "unauthorized"),
            ("X-Api-Key", ("GET", "/api/info", [("Host", at), ("X-Api-Key", KEY)], None), 200, None),
            ("Host check lifted", ("GET", "/api/info", [("Host", f"some-name.lan:{port}"),
                                                        ("Authorization", f"Bearer {KEY}")], None), 200, None),
            ("own origin", ("GET", "/api/info", [*k, ("Origin", f"http://{at}")], None), 200, None),
            ("foreign origin", ("GET", "/api/info", [*k, ("Origin", "http://evil.example")], None),
             403, "forbidden_origin"),
            ("local only, no key", ("DELETE", "/api/models/local/x", [("Host", at)], "{}"), 401, "unauthorized"),
            ("delete a model", ("DELETE", "/api/models/local/x", kj, "{}"), 403, "local_only"),
            ("delete, encoded", ("DELETE", "/api/models/local/a%2Fb", kj, "{}"), 403, "local_only"),
            ("add by url", ("POST", "/api/models/url", kj, {"url": "https://example.com/x.gguf"}),
             403, "local_only"),
            ("folders", ("PUT", "/api/models/folders", kj, {"folders": ["/"]}), 403, "local_only"),
            ("ui without key", ("GET", "/", [("Host", at)], None), -1, None),
        ]
        # Every route the server registers local-only, from a real network peer.
        cases += [(f"{m} {p}", (m, concrete(p), k if m == "GET" else kj, None if m == "GET"
                                else "{}"), 403, "local_only") for m, p in sorted(LOCAL_ONLY)]
        for path in outside_paths:
            cases.append((f"load {path}", ("POST", "/api/session/load", kj, {"model": path}),
                          403, "outside_models_dir"))
        cases.append(("config outside", ("PUT", "/api/config", kj, {"values": {"model": str(escape)}}),
                      200, None))
        cases.append(("config via link", ("PUT", "/api/config", kj,
                                          {"values": {"model": str(models / "link.gguf")}}), 200, None))
        # The last three load in turn: inside, by a relative name, and from a --scan-dir.
        cases += [
            ("config inside", ("PUT", "/api/config", kj, {"values": {"model": str(inside)}}), 200, None),
            ("load inside", ("POST", "/api/session/load", kj, {"model": str(inside)}), 202, None),
            ("load relative", ("POST", "/api/session/load", kj, {"model": "inside.gguf"}), 202, None),
            ("load scan dir", ("POST", "/api/session/load", kj, {"model": str(scanned)}), 202, None),
        ]
        answers = from_namespace(namespace, port, [c[1] for c in cases])
        assert len(answers) == len(cases)
        wrong = []
        for (name, _, status, code), (got, body) in zip(cases, answers, strict=False):
            if status == -1:
                ok = got != 401
            else:
                ok = got == status and (code is None or code_of(body) == code)
            if not ok:
                wrong.append((name, got, body))
        assert not wrong
        by_name = {c[0]: a[1] for c, a in zip(cases, answers, strict=False)}
        assert set(by_name["config outside"]["rejected"]) == {"model"}
        assert "not inside a models folder" in by_name["config outside"]["rejected"]["model"]
        assert set(by_name["config via link"]["rejected"]) == {"model"}
        assert by_name["config inside"]["rejected"] == {}
        assert by_name["load relative"]["model"] == str(inside)
        wait_for(lambda: (srv.info()["model"] or {}).get("path") == str(scanned), 60,
                 "the scan-dir model to load")  # one read of the state: a load may be under way
        assert srv.info()["state"] == "ready"
    finally:
        srv.stop()


def test_models_only_confines_a_local_client(tmp_path: Path, tiny_moe: Path) -> None:
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    inside, outside = models / "inside.gguf", tmp_path / "outside.gguf"
    shutil.copy(tiny_moe, inside)
    shutil.copy(tiny_moe, outside)
    (models / "link.gguf").symlink_to(outside)
    srv = start_server(tmp_path / "data", "--models-only", "-m", str(tiny_moe), "-c", "512")
    try:
        assert srv.info()["model"]["path"] == str(tiny_moe)      # the launch -m is not confined
        port = port_of(srv)
        for path in (str(outside), str(models / "link.gguf"), "../outside.gguf", "/etc/passwd"):
            reply = call(port, "POST", "/api/session/load", body={"model": path})
            assert (reply.status, reply.code) == (403, "outside_models_dir"), (path, reply)
            reply = call(port, "PUT", "/api/config", body={"values": {"model": path}})
            assert reply.status == 200 and set(reply.json()["rejected"]) == {"model"}, (path, reply)
        reply = call(port, "POST", "/api/session/load", body={"model": str(inside)})
        assert reply.status == 202
        wait_for(lambda: (srv.info()["model"] or {}).get("path") == str(inside), 60, "the load")
    finally:
        srv.stop()


def test_a_local_client_may_open_a_model_anywhere(keyed: ServerProcess, tiny_moe: Path,
                                                  tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.gguf"
    shutil.copy(tiny_moe, elsewhere)
    reply = call(port_of(keyed), "POST", "/api/session/load", body={"model": str(elsewhere)}, key=KEY)
    assert reply.status == 202
    wait_for(lambda: (keyed.info()["model"] or {}).get("path") == str(elsewhere), 60, "the load")


# --- --parent-pid --------------------------------------------------------------------------

# Starts the server with --parent-pid = its own pid, prints the server's pid, and exits.
PARENT = r"""
import os, subprocess, sys
cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", sys.argv[1],
       "--threads", "1", "--parent-pid", str(os.getpid())]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
line = proc.stdout.readline()
print(proc.pid, line.strip(), flush=True)
os._exit(0)
"""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_server_stops_when_its_parent_exits(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PARENT, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    pid_text, _, line = done.stdout.partition(" ")
    pid = int(pid_text)
    try:
        assert "listening on" in line, done.stdout + done.stderr
        assert _gone(pid, 10), "the server outlived its parent"
    finally:
        if process_alive(pid):
            os.kill(pid, 9)


def test_the_server_stops_when_the_named_process_exits(tmp_path: Path) -> None:
    watched = subprocess.Popen(["sleep", "120"])
    srv = start_server(tmp_path, "--parent-pid", str(watched.pid), wait_ready=False)
    try:
        assert srv.info()["state"] == "empty"
        time.sleep(0.3)
        assert srv.proc.poll() is None
        watched.kill()
        watched.wait()
        srv.proc.wait(10)
        assert srv.proc.returncode is not None
    finally:
        watched.kill()
        srv.stop()
