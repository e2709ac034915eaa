"""Small blocking clients for the live-event tests: an SSE reader and a WebSocket one."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, CloseConnection, Message, Ping, Pong,
                            RejectConnection, RejectData, Request, TextMessage)


@pytest.fixture(scope="session")
def quick_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[Any]:
    """A bmoe-server with the tiny MoE on one compute thread: on a shared two-core machine
    two threads wait on each other at every barrier and decode ten times slower."""
    from conftest import start_server
    srv = start_server(tmp_path_factory.mktemp("quick-server"), "-m", str(tiny_moe),
                       "-c", "4096", "--threads", "1")
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


class EventStream:
    """`GET /api/events`, read event by event (comments skipped)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None,
                 timeout: float = 30.0) -> None:
        host, port = host_port(url)
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout)
        self.conn.request("GET", "/api/events", headers=headers or {})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.comments: list[str] = []

    def error(self) -> dict[str, Any]:
        return json.loads(self.resp.read())  # type: ignore[no-any-return]

    def next(self) -> tuple[str, Any]:
        name, data = "message", None
        while True:
            raw = self.resp.readline()
            if not raw:
                raise EOFError("the event stream ended")
            line = raw.decode("utf-8").rstrip("\n")
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
            elif line == "" and data is not None:
                return name, data

    def until(self, wanted: str) -> list[tuple[str, Any]]:
        """Every event up to and including the next one named ``wanted``."""
        seen = []
        while True:
            seen.append(self.next())
            if seen[-1][0] == wanted:
                return seen

    def close(self) -> None:
        self.conn.close()


class WebSocketRefused(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = json.loads(body) if body else None


class WebSocketClient:
    """A blocking WebSocket client over wsproto: text messages as (event, data)."""

    def __init__(self, url: str, path: str = "/api/ws",
                 headers: list[tuple[str, str]] | None = None, timeout: float = 10.0) -> None:
        host, port = host_port(url)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(host=f"{host}:{port}", target=path,
                                               extra_headers=headers or [])))
        self.pending: list[Any] = []
        try:
            self._handshake()
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self) -> None:
        status, body = 0, b""
        while True:
            events = self._events()
            for i, event in enumerate(events):
                if isinstance(event, AcceptConnection):
                    self.pending.extend(events[i + 1:])
                    return
                if isinstance(event, RejectConnection):
                    status = event.status_code
                    if not event.has_body:
                        raise WebSocketRefused(status, b"")
                elif isinstance(event, RejectData):
                    body += event.data
                    if event.body_finished:
                        raise WebSocketRefused(status, body)
                else:
                    self.pending.append(event)

    def _events(self) -> list[Any]:
        events = list(self.ws.events())
        if events:
            return events
        data = self.sock.recv(65536)
        self.ws.receive_data(data or None)
        return list(self.ws.events())

    def next_frame(self) -> Any:
        while not self.pending:
            self.pending.extend(self._events())
        return self.pending.pop(0)

    def next(self) -> tuple[str, Any]:
        parts: list[str] = []
        while True:
            frame = self.next_frame()
            if isinstance(frame, CloseConnection):
                raise EOFError(f"closed: {frame.code} {frame.reason}")
            if isinstance(frame, Message):
                assert isinstance(frame, TextMessage), frame
                parts.append(frame.data)
                if frame.message_finished:
                    msg = json.loads("".join(parts))
                    return msg["event"], msg["data"]

    def until(self, wanted: str) -> list[tuple[str, Any]]:
        seen = []
        while True:
            seen.append(self.next())
            if seen[-1][0] == wanted:
                return seen

    def ping(self, payload: bytes) -> None:
        self.sock.sendall(self.ws.send(Ping(payload=payload)))

    def wait_pong(self) -> bytes:
        while True:
            frame = self.next_frame()
            if isinstance(frame, Pong):
                return bytes(frame.payload)

    def close_handshake(self) -> CloseConnection:
        self.sock.sendall(self.ws.send(CloseConnection(code=1000)))
        while True:
            frame = self.next_frame()
            if isinstance(frame, CloseConnection):
                return frame

    def close(self) -> None:
        self.sock.close()


def ws_key() -> str:
    return base64.b64encode(os.urandom(16)).decode()
