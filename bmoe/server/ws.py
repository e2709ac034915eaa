"""`GET /api/ws`: the live events of `GET /api/events`, over a WebSocket.

Theory of operation
-------------------
The route is an ordinary `/api` route: the access checks (Host, key, Origin) run before
routing, and it holds a token of the same 8-stream limiter as `/api/events` (503
`streams_full` past it). The handler checks the opening handshake (RFC 6455 §4.2.1:
`GET`, `Upgrade: websocket`, `Connection: Upgrade`, version 13, a 16-byte key) and
returns an `Upgrade`; the HTTP layer answers `101` and hands over the socket with any
bytes already read past the request. From there, in one nursery:

    reader task:  socket → wsproto → a ping gets its pong, a close its close; the
                  client's end (close, EOF, reset) ends the session
    writer:       the event-bus subscription → one text message per event,
                  `{"event": name, "data": data}`; a WebSocket ping every 15 s

Writes are serialised by one lock (wsproto's framing and the socket in the same order)
and each has the HTTP layer's write timeout: a client that stops reading is let go
once a write cannot finish. A subscriber that falls too far behind is dropped by the
bus; its socket is closed with 1013 ("try again later") and the client reconnects.
Messages the client sends are read (to see pings and closes) and otherwise ignored.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import trio
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import CloseConnection, Event, Ping, TextMessage
from wsproto.utilities import LocalProtocolError, generate_accept_token

from ..http import limits
from ..http.errors import HTTPError
from ..http.types import Request, Upgrade, json_bytes
from ..runtime.state import Runtime

WS_PING_S = 15.0          # a WebSocket ping on an idle event socket this often
WS_VERSION = "13"
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN = 1013    # dropped for falling behind: reconnect


def _tokens(value: str | None) -> set[str]:
    return {t.strip().lower() for t in (value or "").split(",") if t.strip()}


def accept_headers(request: Request) -> list[tuple[str, str]]:
    """The 101's extra headers for a valid opening handshake; HTTPError otherwise."""
    if (request.method != "GET" or "websocket" not in _tokens(request.header("upgrade"))
            or "upgrade" not in _tokens(request.header("connection"))):
        raise HTTPError(426, "upgrade_required", "This route speaks WebSocket only: send "
                        "GET with Upgrade: websocket (or read GET /api/events).",
                        headers=[("Sec-WebSocket-Version", WS_VERSION)])
    if (request.header("sec-websocket-version") or "").strip() != WS_VERSION:
        raise HTTPError(426, "upgrade_required", "Only WebSocket version 13 is spoken here.",
                        headers=[("Sec-WebSocket-Version", WS_VERSION)])
    key = (request.header("sec-websocket-key") or "").strip()
    try:
        valid = len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        valid = False
    if not valid:
        raise HTTPError(400, "bad_request", "Sec-WebSocket-Key must be 16 bytes in base64.")
    return [("Sec-WebSocket-Accept", generate_accept_token(key.encode("ascii")).decode("ascii"))]


def event_message(name: str, data: Any) -> str:
    """One event as the text of one message (`json_bytes` escapes a lone surrogate)."""
    return json_bytes({"event": name, "data": data}).decode("utf-8")


class EventSocket:
    """One upgraded connection: wsproto over a trio stream, writes serialised."""

    def __init__(self, stream: trio.abc.Stream, leftover: bytes) -> None:
        self.stream = stream
        self.ws = Connection(ConnectionType.SERVER, trailing_data=leftover)
        self._write_lock = trio.Lock()

    async def send(self, event: Event) -> None:
        async with self._write_lock:
            try:
                data = self.ws.send(event)
            except LocalProtocolError:
                return  # the closing handshake is under way: nothing more to send
            with trio.fail_after(limits.WRITE_TIMEOUT_S):
                await self.stream.send_all(data)

    async def close(self, code: int, reason: str = "") -> None:
        if self.ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            await self.send(CloseConnection(code=code, reason=reason))

    async def read_until_closed(self) -> None:
        """Answer pings and the client's close; return when the client is gone."""
        while True:
            for event in self.ws.events():
                if isinstance(event, Ping):
                    await self.send(event.response())
                elif isinstance(event, CloseConnection):
                    if self.ws.state is ConnectionState.REMOTE_CLOSING:
                        await self.send(event.response())
                    return
            if self.ws.state is ConnectionState.CLOSED:
                return
            try:
                data = await self.stream.receive_some(limits.RECV_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self.ws.receive_data(bytes(data))


async def handle(state: Runtime, request: Request) -> Upgrade:
    headers = accept_headers(request)
    local = request.peer_is_loopback

    async def run(stream: trio.abc.Stream, leftover: bytes) -> None:
        sock = EventSocket(stream, leftover)
        try:
            async with trio.open_nursery() as nursery:
                async def reader() -> None:
                    await sock.read_until_closed()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(reader)
                await _pump_events(state, sock, local)
                nursery.cancel_scope.cancel()
        except* (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client stopped reading or went away: nothing to tell it

    return Upgrade(protocol="websocket", run=run, headers=headers)


async def _pump_events(state: Runtime, sock: EventSocket, local: bool) -> None:
    sub = state.bus.subscribe(local=local)
    try:
        await sock.send(TextMessage(data=event_message("state", state.info())))
        while True:
            with trio.move_on_after(WS_PING_S) as idle:
                try:
                    name, data = await sub.receive.receive()
                except trio.EndOfChannel:
                    await sock.close(CLOSE_TRY_AGAIN, "fell behind; reconnect")
                    return
            if idle.cancelled_caught:
                await sock.send(Ping(payload=b"bmoe"))
                continue
            await sock.send(TextMessage(data=event_message(name, data)))
    finally:
        sub.close()
