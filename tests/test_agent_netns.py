"""Every local-only rule of the agent from a real network peer: a network namespace
joined by a veth pair, the server on 0.0.0.0 with a key, so this machine reaches it
over loopback and the namespace over the veth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from _e2e_support import port_of, wait_for
from _netns import veth_namespace
from conftest import start_server

from bmoe.agent import preview

KEY = "agent-netns-key"
SUBNET = f"10.214.{os.getpid() % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"

# Inside the namespace: the requests (one connection each), printed as one JSON line;
# then an event stream read for a few seconds ("open" once its head arrived).
CLIENT = r"""
import http.client, json, socket, sys, time
host, port, key, requests = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
out = []
for method, path, body in requests:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    h = {"Authorization": "Bearer " + key}
    if method != "GET":
        h["Content-Type"] = "application/json"
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=h)
    r = conn.getresponse()
    data = r.read()
    try:
        data = json.loads(data)
    except ValueError:
        data = None
    out.append([r.status, data.get("code") if isinstance(data, dict) else None, data])
    conn.close()
print(json.dumps(out), flush=True)
s = socket.create_connection((host, port), timeout=10)
s.sendall(f"GET /api/events HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
buf = s.recv(65536)
print("open", flush=True)
end = time.monotonic() + float(sys.argv[5])
s.settimeout(0.2)
while time.monotonic() < end:
    try:
        buf += s.recv(65536)
    except TimeoutError:
        pass
print(json.dumps(buf.decode("utf-8", "replace")), flush=True)
"""


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    with veth_namespace("agent", SUBNET) as peer:
        yield peer.ns


def test_the_agent_from_the_network(namespace: str, tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "page.html").write_text("<p>hi</p>")
    srv = start_server(tmp_path / "data", "--host", "0.0.0.0", "--api-key-file",
                       str(tmp_path / "key"), wait_ready=False)
    srv.key = KEY
    srv.url = f"http://127.0.0.1:{port_of(srv)}"
    try:
        _run(srv, namespace, ws)
    finally:
        srv.stop()


def _run(srv: Any, namespace: str, ws: Path) -> None:
    def api(method: str, path: str, body: Any = None) -> Any:
        status, _, data = srv.request(method, path, body)
        assert status < 300, (method, path, status, data)
        return data

    w = api("POST", "/api/workspaces", {"path": str(ws)})["id"]
    api("PUT", "/api/providers/pr", {"kind": "openai", "base_url": "http://127.0.0.1:9/v1",
                                     "model": "m", "api_key": "sk-x"})
    p = api("POST", "/api/conversations", {"title": "private", "workspace": w})["id"]
    r = api("POST", "/api/conversations", {"title": "routed", "route": "pr"})["id"]
    q = api("POST", "/api/conversations", {"title": "public"})["id"]
    # the preview beyond loopback: auto is off
    status, headers, _ = srv.request("GET", f"/api/conversations/{p}/file?path=page.html")
    assert status == 200 and headers["Content-Security-Policy"] == preview.POLICY_OFF

    refused = [
        ("GET", f"/api/conversations/{p}", None), ("GET", f"/api/conversations/{r}", None),
        ("PUT", f"/api/conversations/{p}", {"title": "x"}), ("DELETE", f"/api/conversations/{p}", None),
        ("POST", f"/api/conversations/{p}/messages", {"text": "hi"}),
        ("PUT", f"/api/conversations/{p}/items/i_x", {"text": "hi"}),
        ("POST", f"/api/conversations/{p}/stop", None),
        ("POST", f"/api/conversations/{r}/messages", {"text": "hi"}),
        ("POST", "/api/conversations", {"workspace": w}),
        ("POST", "/api/conversations", {"mode": "full"}),
        ("POST", "/api/conversations", {"route": "pr"}),
        ("PUT", f"/api/conversations/{q}", {"workspace": w}),
        ("PUT", f"/api/conversations/{q}", {"mode": "full"}),
        ("PUT", f"/api/conversations/{q}", {"route": "pr"}),
        ("GET", "/api/workspaces", None), ("POST", "/api/workspaces", {"path": str(ws)}),
        ("DELETE", f"/api/workspaces/{w}", None),
        ("GET", "/api/providers", None), ("PUT", "/api/providers/x", {"kind": "openai"}),
        ("DELETE", "/api/providers/pr", None),
        ("POST", f"/api/conversations/{q}/approval", {"item": "i_x", "decision": "once"}),
        ("GET", f"/api/conversations/{p}/file?path=page.html", None),
        ("GET", f"/api/conversations/{q}/file?path=page.html", None),
    ]
    allowed = [("GET", "/api/conversations", None), ("GET", f"/api/conversations/{q}", None),
               ("GET", "/api/agent", None), ("PUT", f"/api/conversations/{q}", {"mode": "read"}),
               ("POST", f"/api/conversations/{q}/messages", {"text": "hello"}),
               ("POST", "/api/conversations", {"title": "from the network"})]
    proc = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c", CLIENT,
                             HOST_IP, str(port_of(srv)), KEY, json.dumps(refused + allowed), "4"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        answers = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "open"
        api("PUT", f"/api/conversations/{p}", {"title": "secret-rename"})
        api("PUT", f"/api/conversations/{r}", {"title": "routed-rename"})
        api("PUT", f"/api/conversations/{q}", {"title": "public-rename"})
        events = json.loads(proc.stdout.readline())
    finally:
        proc.wait(30)
        proc.stdout.close()
    for (method, path, _), (status, code, body) in zip(refused, answers[:len(refused)], strict=True):
        assert (status, code) == (403, "local_only"), (method, path, body)
    got = answers[len(refused):]
    assert [s for s, _, _ in got] == [200, 200, 200, 200, 202, 201], got
    assert [c["id"] for c in got[0][2]["conversations"]] == [q]
    assert got[2][2]["mcp"] == []
    assert "public-rename" in events and "secret-rename" not in events and "routed-rename" not in events
    # the network's message ran with no tools (and, with no model, ended on a notice)
    conv = wait_for(lambda: (c := srv.request("GET", f"/api/conversations/{q}")[2])["state"]
                    in ("idle", "error") and c, 30, "the network's run to end")
    assert conv["items"][-1]["code"] == "no_model"
    assert srv.request("GET", f"/api/conversations/{p}")[2]["title"] == "secret-rename"
