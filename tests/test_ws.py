"""`GET /api/ws`: the HTTP layer's upgrade hook, the handshake, and the event mirror."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from _clients import (EventStream, WebSocketClient, WebSocketRefused, host_port,
                      quick_server)  # noqa: F401 - a fixture
from bmoe.http.access import AccessPolicy
from bmoe.http.connection import serve_connection
from bmoe.http.routes import RouteTable
from bmoe.http.server import HttpApp
from bmoe.http.types import Request, Upgrade
from bmoe.server.ws import accept_headers
from conftest import ServerProcess, start_server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
PORT = 8765
UPGRADE_HEAD = (b"GET /api/up HTTP/1.1\r\nHost: 127.0.0.1:8765\r\nConnection: Upgrade\r\n"
                b"Upgrade: test-proto\r\n\r\n")


# --- the HTTP layer's hook (in process, memory streams) -------------------------------------

def upgrade_app(seen: list[bytes], api_key: str | None = None) -> HttpApp:
    async def up(request: Request) -> Upgrade:
        async def run(stream: trio.abc.Stream, leftover: bytes) -> None:
            seen.append(leftover)
            await stream.send_all(b"hello:" + leftover)
        return Upgrade(protocol="test-proto", run=run, headers=[("X-Test", "1")])

    table = RouteTable()
    table.add("GET", "/api/up", up)
    return HttpApp(table, AccessPolicy("127.0.0.1", port=PORT, api_key=api_key))


async def exchange(app: HttpApp, data: bytes) -> bytes:
    """Send ``data`` on one connection; everything the server wrote until it closed
    (a kept-alive connection closes after its idle time, which the tests' autojump
    clock skips)."""
    client, server = trio.testing.memory_stream_pair()
    received = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_connection, app, server)
        await client.send_all(data)
        while chunk := await client.receive_some(65536):
            received += chunk
    return bytes(received)


async def test_upgrade_answers_101_and_hands_over_the_stream_and_leftover_bytes(autojump_clock: MockClock) -> None:
    seen: list[bytes] = []
    raw = await exchange(upgrade_app(seen), UPGRADE_HEAD + b"early frame")
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0] == "http/1.1 101 "
    assert {"upgrade: test-proto", "connection: upgrade", "x-test: 1"} <= set(lines)
    assert rest == b"hello:early frame" and seen == [b"early frame"]


async def test_upgrade_route_without_an_upgrade_request_is_400(autojump_clock: MockClock) -> None:
    seen: list[bytes] = []
    raw = await exchange(upgrade_app(seen),
                   b"GET /api/up HTTP/1.1\r\nHost: 127.0.0.1:8765\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400 ") and b'"code":"bad_request"' in raw and not seen


async def test_upgrade_passes_the_access_checks_first(autojump_clock: MockClock) -> None:
    seen: list[bytes] = []
    raw = await exchange(upgrade_app(seen, api_key="k"), UPGRADE_HEAD)
    assert raw.startswith(b"HTTP/1.1 401 ") and not seen


# --- the handshake (pure) -------------------------------------------------------------------

def ws_request(**headers: str) -> Request:
    base = {"upgrade": "websocket", "connection": "keep-alive, Upgrade",
            "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}
    base.update({k.replace("_", "-"): v for k, v in headers.items()})
    return Request("GET", "/api/ws", "/api/ws", {}, [(k, v) for k, v in base.items() if v],
                   b"", ("127.0.0.1", 1), ("127.0.0.1", PORT))


def test_handshake_accept_key_is_rfc6455s_example() -> None:
    assert accept_headers(ws_request()) == [("Sec-WebSocket-Accept",
                                             "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")]


@pytest.mark.parametrize("headers,status", [
    ({"upgrade": ""}, 426), ({"connection": "keep-alive"}, 426),
    ({"sec_websocket_version": "8"}, 426), ({"sec_websocket_key": ""}, 400),
    ({"sec_websocket_key": "c2hvcnQ="}, 400), ({"sec_websocket_key": "not base64!"}, 400)])
def test_handshake_refusals(headers: dict[str, str], status: int) -> None:
    from bmoe.http.errors import HTTPError
    with pytest.raises(HTTPError) as e:
        accept_headers(ws_request(**headers))
    assert e.value.status == status


# --- the mirror on a real server ------------------------------------------------------------------

def test_websocket_mirrors_the_event_stream(quick_server: ServerProcess) -> None:
    sse = EventStream(quick_server.url)
    ws = WebSocketClient(quick_server.url)
    try:
        assert sse.next()[0] == "state" and ws.next()[0] == "state"
        status, _, body = quick_server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16,
            **NO_THINK})
        assert status == 200
        by_sse = sse.until("done")
        by_ws = ws.until("done")
    finally:
        sse.close()
        ws.close()
    assert by_ws == by_sse
    assert [n for n, _ in by_ws].count("token") == body["usage"]["completion_tokens"]
    assert by_ws[-1][1] == body["bmoe"]["summary"]


def test_websocket_ping_pong_and_close(quick_server: ServerProcess) -> None:
    ws = WebSocketClient(quick_server.url)
    try:
        assert ws.next()[0] == "state"
        ws.ping(b"are you there")
        assert ws.wait_pong() == b"are you there"
        assert ws.close_handshake().code == 1000
        ws.sock.settimeout(5)
        assert ws.sock.recv(10) == b""          # and the server closed the socket
    finally:
        ws.close()


def test_plain_get_on_the_websocket_route_is_426(quick_server: ServerProcess) -> None:
    status, headers, body = quick_server.request("GET", "/api/ws")
    assert status == 426 and body["code"] == "upgrade_required"
    assert headers.get("Sec-WebSocket-Version") == "13"


def test_websocket_follows_the_key_and_origin_rules(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sekrit\n")
    srv = start_server(tmp_path / "data", "--api-key-file", str(key_file), wait_ready=False)
    try:
        with pytest.raises(WebSocketRefused) as e:
            WebSocketClient(srv.url)
        assert e.value.status == 401 and e.value.body["code"] == "unauthorized"
        host, port = host_port(srv.url)
        with pytest.raises(WebSocketRefused) as e:
            WebSocketClient(srv.url, headers=[("Authorization", "Bearer sekrit"),
                                              ("Origin", "http://evil.example")])
        assert e.value.status == 403 and e.value.body["code"] == "forbidden_origin"
        ws = WebSocketClient(srv.url, headers=[("Authorization", "Bearer sekrit"),
                                               ("Origin", f"http://{host}:{port}")])
        try:
            name, info = ws.next()
            assert name == "state" and info["state"] == "empty"
        finally:
            ws.close()
    finally:
        srv.stop()


def test_a_client_that_leaves_frees_its_place(quick_server: ServerProcess) -> None:
    sockets: list[Any] = []
    try:
        for _ in range(8):
            ws = WebSocketClient(quick_server.url)
            assert ws.next()[0] == "state"
            sockets.append(ws)
        with pytest.raises(WebSocketRefused):
            WebSocketClient(quick_server.url)
        sockets.pop().close()              # gone without a closing handshake
        done = threading.Event()
        for _ in range(50):
            try:
                again = WebSocketClient(quick_server.url)
            except WebSocketRefused:
                done.wait(0.02)
                continue
            sockets.append(again)
            break
        else:
            raise AssertionError("the closed WebSocket kept its place")
    finally:
        for ws in sockets:
            ws.close()
