"""A real peer that is not loopback: a network namespace joined to this one by a veth
pair, the server bound to the host side with a key, the client inside the namespace."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest
import trio
from _netns import veth_namespace
from _http_support import ATTACK_HEAD_TIMEOUT_S, attack, check_attack, check_streams, streaming_app

from bmoe.http import limits
from bmoe.http.access import AccessPolicy
from bmoe.http.routes import Access, RouteTable
from bmoe.http.server import HttpApp, serve_http
from bmoe.http.types import Request, Response

KEY = "n3tw0rk-key"
SUBNET = f"10.254.{os.getpid() % 200 + 20}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"

# Sends each raw request on its own connection; prints [status, code] per request.
CLIENT = r"""
import json, socket, sys
host, port, requests = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = []
for raw in requests:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(raw.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = int([l.split(b":")[1] for l in lines if l.lower().startswith(b"content-length")][0])
        while len(body) < length:
            body += s.recv(65536)
        out.append([int(head.split()[1]), json.loads(body).get("code")])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    with veth_namespace("http", SUBNET) as peer:
        yield peer.ns


def _app() -> HttpApp:
    async def ok(request: Request) -> Response:
        return Response.json({"ok": True, "code": "ok"})

    routes = RouteTable()
    routes.add("GET", "/api/info", ok)
    routes.add("DELETE", "/api/models/local/{name}", ok, access=Access.LOCAL_ONLY)
    routes.add("POST", "/api/models/url", ok, access=Access.LOCAL_ONLY)
    routes.add("GET", "/api/backends", ok, access=Access.LOCAL_ONLY)
    routes.add("GET", "/api/models", ok)
    routes.add("POST", "/v1/chat/completions", ok)
    return HttpApp(routes, AccessPolicy(HOST_IP, api_key=KEY))


def _raw(method: str, target: str, host: str, key: bool = True, body: bool = False) -> str:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if key:
        lines.append(f"Authorization: Bearer {KEY}")
    if body:
        lines += ["Content-Type: application/json", "Content-Length: 2"]
    return "\r\n".join(lines) + "\r\n\r\n" + ("{}" if body else "")


def test_network_peer(namespace: str) -> None:
    app = _app()

    async def main() -> list[list[object]]:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, HOST_IP, 0)
            at = f"{HOST_IP}:{port}"
            requests = [
                _raw("GET", "/api/info", at, key=False),                       # key required
                _raw("GET", "/api/info", at),                                  # with it: answered
                _raw("GET", "/api/info", f"some-name.lan:{port}"),             # Host check lifted
                _raw("POST", "/v1/chat/completions", at, body=True),
                _raw("DELETE", "/api/models/local/m.gguf", at, body=True),     # local only
                _raw("POST", "/api/models/url", at, body=True),
                _raw("GET", "/api/backends", at),
                _raw("GET", "/api/models", at),                                # not flagged: open
                _raw("GET", "/api/workspaces", at),                            # no such route
            ]
            result = await trio.run_process(
                ["ip", "netns", "exec", namespace, sys.executable, "-c", CLIENT, HOST_IP, str(port),
                 json.dumps(requests)], capture_stdout=True)
            nursery.cancel_scope.cancel()
        return json.loads(result.stdout)

    assert trio.run(main) == [[401, "unauthorized"], [200, "ok"], [200, "ok"], [200, "ok"],
                              [403, "local_only"], [403, "local_only"], [403, "local_only"],
                              [200, "ok"], [404, "not_found"]]


@pytest.mark.parametrize("tricklers", [40, 200])
def test_tricklers_from_a_network_peer_hold_no_worker(namespace: str, tricklers: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The tricklers and the normal client share the namespace's address; the chat and the
    event stream come from the host side."""
    monkeypatch.setattr(limits, "HEAD_TIMEOUT_S", ATTACK_HEAD_TIMEOUT_S)
    app = streaming_app(AccessPolicy(HOST_IP, api_key=KEY))

    async def main() -> tuple[dict[str, object], object, object, float]:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, HOST_IP, 0)
            outcome = await attack(HOST_IP, port, tricklers, key=KEY,
                                   prefix=("ip", "netns", "exec", namespace))
            nursery.cancel_scope.cancel()
        return outcome

    report, chat, events, began = trio.run(main)
    check_attack(report, tricklers=tricklers, head_timeout=ATTACK_HEAD_TIMEOUT_S,
                 peer_arriving=limits.PEER_ARRIVING)
    check_streams(chat, events, began)
