"""The limits under load, against a real bmoe-server with the tiny MoE loaded.

8 event streams, 1 running + 16 waiting chat turns, 32 workers and a queue of 64
connections, body and head caps, and the TCP keep-alive accepted sockets inherit.
Every connection here is a raw socket, so a test can hold it, or drop it, at will.
"""

from __future__ import annotations

import json
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _e2e_support import Conn, call, port_of, request_bytes, wait_for
from conftest import ServerProcess, start_server

from bmoe.http import limits

LONG_TURN = {"messages": [{"role": "user", "content": "Tell me a very long story."}],
             "max_tokens": 1_000_000, "stream": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("limits"), "-m", str(tiny_moe), "-c", "16384")
    try:
        assert server.info()["state"] == "ready"
        yield server
    finally:
        server.stop()


def host(port: int) -> str:
    return f"127.0.0.1:{port}"


def open_events(port: int) -> tuple[Conn, int]:
    conn = Conn(port)
    conn.send(request_bytes("GET", "/api/events", host=host(port), close=False))
    status, _ = conn.read_head()
    return conn, status


def open_turn(port: int, body: dict[str, object] = LONG_TURN) -> tuple[Conn, int]:
    conn = Conn(port)
    conn.send(request_bytes("POST", "/v1/chat/completions", host=host(port),
                            headers=[("Content-Type", "application/json")],
                            body=json.dumps(body).encode(), close=False))
    status, _ = conn.read_head()
    return conn, status


def read_refusal(port: int, opener: str) -> tuple[int, str | None, str | None]:
    conn = Conn(port)
    if opener == "events":
        conn.send(request_bytes("GET", "/api/events", host=host(port)))
    else:
        conn.send(request_bytes("POST", "/v1/chat/completions", host=host(port),
                                headers=[("Content-Type", "application/json")],
                                body=json.dumps({**LONG_TURN, "stream": opener == "stream"}).encode()))
    reply = conn.read_reply()
    conn.close()
    return reply.status, reply.code, reply.header("retry-after")


def until_admitted(opener: object, port: int, within: float) -> tuple[Conn, float]:
    """Retry ``opener`` until it is admitted; the connection and how long that took."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        conn, status = opener(port)  # type: ignore[operator]
        if status == 200:
            return conn, time.monotonic() - start
        conn.close()
        time.sleep(0.02)
    raise AssertionError(f"not admitted within {within} s")


def close_all(conns: list[Conn]) -> None:
    for conn in conns:
        conn.close()
    conns.clear()


# --- event streams ------------------------------------------------------------------------

def test_the_ninth_event_stream_is_refused_and_a_closed_one_is_given_back(srv: ServerProcess) -> None:
    port = port_of(srv)
    streams: list[Conn] = []
    try:
        for _ in range(limits.EVENT_STREAMS):
            conn, status = open_events(port)
            streams.append(conn)
            assert status == 200
            conn.read_until(b"event: state")
        status, code, retry = read_refusal(port, "events")
        assert (status, code) == (503, "streams_full") and retry is not None
        assert call(port, "GET", "/api/info").status == 200          # other requests still served
        streams.pop(0).close()
        conn, took = until_admitted(open_events, port, within=3.0)
        streams.append(conn)
        assert took < 1.0, f"the closed stream's place came back after {took:.2f} s"
        assert read_refusal(port, "events")[:2] == (503, "streams_full")
    finally:
        close_all(streams)
    conn, _ = until_admitted(open_events, port, within=2.0)    # every place given back
    conn.close()


# --- the turn line ---------------------------------------------------------------------------

def test_one_running_and_sixteen_waiting_turns_then_busy(srv: ServerProcess) -> None:
    port = port_of(srv)
    held: list[Conn] = []
    streams: list[Conn] = []
    running, status = open_turn(port)
    try:
        assert status == 200
        running.read_until(b'"role":"assistant"')                     # it has the turn
        for _ in range(limits.TURN_WAITING):
            conn, status = open_turn(port)
            held.append(conn)
            assert status == 200
            conn.read_until(b": waiting for a turn")
        assert call(port, "GET", "/api/info").json()["waiting"] == limits.TURN_WAITING
        for opener in ("stream", "plain"):
            status, code, retry = read_refusal(port, opener)
            assert (status, code) == (503, "busy"), opener
            assert retry is not None and int(retry) > 0
        # 8 streams on top: 25 workers held, and the rest still answer everything else.
        for _ in range(limits.EVENT_STREAMS):
            conn, status = open_events(port)
            streams.append(conn)
            assert status == 200
        assert call(port, "GET", "/api/info").json()["generating"] is True
        # A waiter that leaves gives its place back.
        held.pop().close()
        conn, took = until_admitted(open_turn, port, within=3.0)
        held.append(conn)
        assert took < 1.0
        assert read_refusal(port, "plain")[:2] == (503, "busy")
    finally:
        close_all(streams)
        close_all(held)
        wait_for(lambda: call(port, "GET", "/api/info").json()["waiting"] == 0, 10,
                 "the waiters to give their places back")
        reply = call(port, "POST", "/api/cancel")
        tail = running.read_until(b"data: [DONE]")
        running.close()
    assert reply.json() == {"cancelled": True}
    assert b'"finish_reason":"cancelled"' in tail

    def idle() -> bool:
        if call(port, "GET", "/api/info").json()["generating"]:
            call(port, "POST", "/api/cancel")          # a waiter that had not left yet
            return False
        return True

    wait_for(idle, 10, "the engine to be idle")
    short = call(port, "POST", "/v1/chat/completions",
                 body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert short.status == 200, short


# --- workers and the queue -------------------------------------------------------------------

def held_request(port: int) -> Conn:
    """A request whose body is one byte short: it holds a worker until that byte comes."""
    conn = Conn(port)
    conn.send(request_bytes("POST", "/api/cancel", host=host(port),
                            headers=[("Content-Type", "application/json")], body=b"{}")[:-1])
    return conn


def test_queued_connections_are_served_in_order_once_a_worker_frees(srv: ServerProcess) -> None:
    port = port_of(srv)
    held = [held_request(port) for _ in range(limits.WORKERS)]
    queued: list[Conn] = []
    extra: Conn | None = None
    try:
        for i in range(limits.ACCEPT_QUEUE):
            conn = Conn(port)
            conn.send(request_bytes("GET", f"/api/info?n={i}", host=host(port)))
            queued.append(conn)
        assert not queued[0].answers_within(0.5), "a queued connection was served with every worker busy"
        extra = Conn(port)                                   # one past the queue: closed at once
        assert extra.closed_by_server(2.0)

        held[0].send(b"}")                                   # one worker frees ...
        assert held[0].read_reply().status == 200
        held.pop(0).close()
        order = _answer_order(queued, timeout=20)
        assert order == list(range(limits.ACCEPT_QUEUE))     # ... and the queue drains through it, in order
    finally:
        if extra is not None:
            extra.close()
        close_all(queued)
        close_all(held)
    wait_for(lambda: call(port, "GET", "/api/info").status == 200, 5, "the workers to come back")


def _answer_order(conns: list[Conn], timeout: float) -> list[int]:
    """Indexes of ``conns`` in the order their (whole) answers arrived."""
    selector = selectors.DefaultSelector()
    for i, conn in enumerate(conns):
        conn.sock.setblocking(False)
        selector.register(conn.sock, selectors.EVENT_READ, i)
    order: list[int] = []
    data = {i: b"" for i in range(len(conns))}
    deadline = time.monotonic() + timeout
    while len(order) < len(conns) and time.monotonic() < deadline:
        for key, _ in selector.select(0.5):
            i = key.data
            chunk = conns[i].sock.recv(65536)
            data[i] += chunk
            if not chunk:                                  # Connection: close: the answer is whole
                assert data[i].startswith(b"HTTP/1.1 200"), data[i][:200]
                selector.unregister(key.fileobj)
                order.append(i)
    selector.close()
    return order


# --- sizes -----------------------------------------------------------------------------------

def declared(port: int, method: str, path: str, length: int) -> tuple[int, str | None]:
    conn = Conn(port)
    conn.send(request_bytes(method, path, host=host(port), headers=[
        ("Content-Type", "application/json"), ("Content-Length", str(length))]))
    reply = conn.read_reply()
    conn.close()
    return reply.status, reply.code


def test_body_caps(srv: ServerProcess) -> None:
    port = port_of(srv)
    assert declared(port, "POST", "/api/session/load", limits.BODY_LIMIT_BYTES + 1) == (413, "too_large")
    assert declared(port, "PUT", "/api/config", limits.BODY_LIMIT_BYTES + 1) == (413, "too_large")
    assert declared(port, "POST", "/v1/chat/completions",
                    limits.BIG_BODY_LIMIT_BYTES + 1) == (413, "too_large")
    pad = "x" * (9 * limits.MIB)
    # A real 9 MiB body: over the default cap, under the chat route's.
    big = call(port, "PUT", "/api/config", body={"values": {}, "pad": pad})
    assert (big.status, big.code) == (413, "too_large")
    chat = call(port, "POST", "/v1/chat/completions", body={"pad": pad})
    assert (chat.status, chat.code) == (400, "invalid_request")
    at_cap = call(port, "POST", "/api/cancel",
                  raw=b'{"pad": "' + b"x" * (limits.BODY_LIMIT_BYTES - 11) + b'"}')
    assert at_cap.status == 200


def test_an_oversized_head_is_431(srv: ServerProcess) -> None:
    port = port_of(srv)
    reply = call(port, "GET", "/api/info", headers=[("X-Big", "a" * (limits.MAX_HEADER_BYTES + 10))])
    assert (reply.status, reply.code) == (431, "headers_too_large")
    reply = call(port, "GET", "/api/info", headers=[(f"X-{i}", "v" * 60) for i in range(1200)])
    assert reply.status == 431


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a socket's timers")
def test_accepted_sockets_carry_tcp_keepalive(srv: ServerProcess) -> None:
    port = port_of(srv)
    conn = Conn(port)
    try:
        conn.send(request_bytes("GET", "/api/info", host=host(port), close=False))
        conn.read_reply()
        out = subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
    finally:
        conn.close()
    assert "timer:(keepalive," in out, out
    seconds = int(out.split("timer:(keepalive,", 1)[1].split("sec", 1)[0].split("min")[0])
    assert 0 < seconds <= limits.TCP_KEEPIDLE_S
