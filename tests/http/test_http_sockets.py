"""The server over real loopback sockets on port 0: workers, queue, TCP options, stop."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import trio
from _http_support import Probe, ResponseReader, make_app, request_bytes

from bmoe.http import limits
from bmoe.http.access import AccessPolicy
from bmoe.http.connection import PeerGone
from bmoe.http.routes import RouteTable
from bmoe.http.server import (
    HttpApp,
    bind_listening_sockets,
    configure_listening_socket,
    serve_http,
    watch_parent,
)
from bmoe.http.types import Request, Response

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


def get(port: int, target: str) -> bytes:
    return request_bytes("GET", target, host=f"127.0.0.1:{port}")


def test_serves_on_port_zero_and_sets_the_policy_port() -> None:
    app = make_app(policy=AccessPolicy("127.0.0.1"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            assert port > 0 and app.policy.port == port
            stream = await connect(port)
            reader = ResponseReader(stream)
            for tag in ("a", "b"):
                await stream.send_all(get(port, f"/api/ping?tag={tag}"))
                response = await reader.read()
                assert response is not None and response.json()["tag"] == tag
            await stream.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_key_over_the_wire() -> None:
    app = make_app(policy=AccessPolicy("127.0.0.1", api_key="k3y"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            for headers, status in (([], 401), ([("Authorization", "Bearer k3y")], 200),
                                    ([("X-Api-Key", "k3y")], 200)):
                stream = await connect(port)
                await stream.send_all(request_bytes("GET", "/api/ping", host=f"localhost:{port}",
                                                    headers=headers))
                response = await ResponseReader(stream).read()
                assert response is not None and response.status == status
                if status == 401:
                    assert response.header("www-authenticate") == "Bearer"
                await stream.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def _gated_app(served: list[str], started: list[str], gates: dict[str, trio.Event]) -> HttpApp:
    async def hold(request: Request) -> Response:
        tag = request.query["tag"]
        started.append(tag)
        await gates[tag].wait()
        served.append(tag)
        return Response.json(tag)

    async def ping(request: Request) -> Response:
        served.append(request.query["tag"])
        return Response.json(request.query["tag"])

    routes = RouteTable()
    routes.add("GET", "/hold", hold)
    routes.add("GET", "/ping", ping)
    return HttpApp(routes, AccessPolicy("127.0.0.1"))


def test_queued_connections_are_served_in_order_and_the_one_past_the_queue_is_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "WORKERS", 2)
    monkeypatch.setattr(limits, "ACCEPT_QUEUE", 2)
    served: list[str] = []
    started: list[str] = []
    gates = {"h0": trio.Event(), "h1": trio.Event()}
    app = _gated_app(served, started, gates)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            holders = [await connect(port) for _ in range(2)]
            for i, stream in enumerate(holders):
                await stream.send_all(get(port, f"/hold?tag=h{i}"))
            with trio.fail_after(5):
                while len(started) < 2:  # noqa: ASYNC110 (observing: both workers busy)
                    await trio.sleep(0.01)
            queued = [await connect(port) for _ in range(2)]
            for i, stream in enumerate(queued):
                await stream.send_all(get(port, f"/ping?tag=q{i}"))
            extra = await connect(port)
            await extra.send_all(get(port, "/ping?tag=x"))
            with trio.fail_after(2):
                assert await ResponseReader(extra).read() is None     # closed at once, unanswered
            await trio.sleep(0.2)
            assert served == []                    # the queued ones wait for a worker
            gates["h0"].set()
            with trio.fail_after(5):
                for stream in (holders[0], *queued):
                    assert (await ResponseReader(stream).read()) is not None
            assert served == ["h0", "q0", "q1"]    # in order, through the one free worker
            gates["h1"].set()
            with trio.fail_after(5):
                assert (await ResponseReader(holders[1]).read()) is not None
            assert "x" not in served
            for stream in (*holders, *queued, extra):
                await stream.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_client_closing_cancels_its_request_within_a_second() -> None:
    probe = Probe()
    app = make_app(probe, policy=AccessPolicy("127.0.0.1"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            stream = await connect(port)
            await stream.send_all(get(port, "/api/wait"))
            with trio.fail_after(5):
                await probe.started.wait()
            await stream.aclose()
            with trio.fail_after(1):
                await probe.cancelled.wait()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_reader_that_stops_reading_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "WRITE_TIMEOUT_S", 0.3)
    probe = Probe()
    app = make_app(probe, policy=AccessPolicy("127.0.0.1"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", port))
            stream = trio.SocketStream(sock)
            await stream.send_all(get(port, "/api/stream?forever=1"))
            received = b""
            while b"filler" not in received:
                received += await stream.receive_some(4096)
            with trio.fail_after(10):               # buffers fill, then one write times out
                while probe.stream_error is None:  # noqa: ASYNC110 (observing)
                    await trio.sleep(0.05)
            assert isinstance(probe.stream_error, (PeerGone, trio.Cancelled))
            await stream.aclose()
            nursery.cancel_scope.cancel()
    trio.run(main)


@linux_only
def test_keepalive_options_are_inherited_by_accepted_sockets() -> None:
    with socket.socket() as listener:
        configure_listening_socket(listener)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as _client:
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000


@linux_only
def test_bound_sockets_carry_the_options_and_share_one_port() -> None:
    async def main() -> None:
        sockets = await bind_listening_sockets("localhost", 0)
        try:
            assert len({s.getsockname()[1] for s in sockets}) == 1
            for sock in sockets:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000
        finally:
            for sock in sockets:
                sock.close()
    trio.run(main)


def test_watch_parent_stops_the_server_when_the_parent_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "PARENT_POLL_S", 0.05)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    app = make_app(policy=AccessPolicy("127.0.0.1"))

    async def main() -> float:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_http, app, "127.0.0.1", 0)
                nursery.start_soon(watch_parent, parent.pid, scope)
                await trio.sleep(0.2)
                assert not scope.cancel_called
                parent.kill()                         # left unreaped: a zombie counts as ended
                start = trio.current_time()
                await trio.sleep_forever()
        return trio.current_time() - start

    try:
        assert trio.run(main) < 1
    finally:
        parent.kill()
        parent.wait()
