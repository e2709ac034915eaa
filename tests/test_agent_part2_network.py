"""The part-two routes (skills, tasks, clients) from a network peer: the server on
0.0.0.0 with a key, reached through this machine's own non-loopback address, so the
connection's peer is not loopback. Every one is `403 local_only`, whatever the key;
the same requests over loopback are answered."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from conftest import start_server
from _netns import skip_outside_ci

KEY = "part-two-network-key"


def own_address() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))            # no packet is sent: this only picks a route
        ip = str(s.getsockname()[0])
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def request(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else (b"{}" if method != "GET" else None)
    req = urllib.request.Request(base + path, data=data, method=method, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_part_two_routes_refuse_the_network(tmp_path: Path) -> None:
    ip = own_address()
    if ip is None:
        skip_outside_ci("this machine has no non-loopback IPv4 address")
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    home = tmp_path / "home"
    srv = start_server(tmp_path / "data", "--host", "0.0.0.0", "--api-key-file", str(key_file),
                       env={"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude")},
                       wait_ready=False)
    try:
        port = srv.url.rsplit(":", 1)[1]
        net, local = f"http://{ip}:{port}", f"http://127.0.0.1:{port}"
        routes = [("GET", "/api/skills", None),
                  ("POST", "/api/skills", {"name": "x", "description": "d"}),
                  ("PUT", "/api/skills/x", {"body": "b"}), ("DELETE", "/api/skills/x", None),
                  ("GET", "/api/tasks", None), ("POST", "/api/tasks", {"prompt": "p"}),
                  ("GET", "/api/tasks/t_x", None), ("PUT", "/api/tasks/t_x", {}),
                  ("DELETE", "/api/tasks/t_x", None), ("POST", "/api/tasks/t_x/run", None),
                  ("GET", "/api/clients", None), ("POST", "/api/connect/claude-code", None)]
        for method, path, body in routes:
            status, out = request(net, method, path, body)
            assert status == 403 and out["code"] == "local_only", (method, path, status, out)
        status, conv = request(net, "POST", "/api/conversations", {"skills": ["commit-message"]})
        assert status == 403 and conv["code"] == "local_only"
        status, conv = request(net, "POST", "/api/conversations", {})
        assert status == 201
        status, out = request(net, "PUT", f"/api/conversations/{conv['id']}",
                              {"skills": ["commit-message"]})
        assert status == 403 and out["code"] == "local_only"
        # over loopback the same server answers
        assert request(local, "GET", "/api/skills")[0] == 200
        assert request(local, "GET", "/api/tasks")[0] == 200
        assert request(local, "GET", "/api/clients")[0] == 200
        assert not (home / ".claude").exists()
    finally:
        srv.stop()
