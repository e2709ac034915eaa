"""One connection's life: bytes in through h11, one handler call per request, bytes out.

The loop, per request (keep-alive repeats it; ``start_next_cycle`` between):

    idle ── first byte ──► head ──► access + route ══► worker ──► body ──► handler ──► response
     │ KEEPALIVE_IDLE_S     └ HEAD_TIMEOUT_S (408) ┘  queued   └ BODY_* (408) ┘ watched   │ WRITE_TIMEOUT_S
     │                                                                                    per write
     └─────────────── no worker held (admission.Seat) ───┘ └──── one worker held (admission.Workers) ────┘

* Reading (``Connection.seat`` set): no worker is held. An idle connection may be closed
  to seat a new one; one that must wait for more of a request takes one of its peer's
  places, or is closed at once (``Crowded``) when it has none left. The whole head has
  HEAD_TIMEOUT_S; a refusal of the access checks or the route is answered from here,
  so a client without the key never holds a worker.
* Served: the request waits for a worker in arrival order (closed at once when the
  queue is full), then the body is read under a deadline that starts at BODY_GRACE_S
  and grows with every byte at BODY_FLOOR_BYTES_PER_S, so it is at most
  BODY_GRACE_S + length / rate and a client must keep up that rate to hold a worker
  for longer than the grace.
* The head is held to ``MAX_HEADER_BYTES`` (h11 says 431); anything h11 refuses is
  answered with its hint (400, or 431; a 5xx hint is sent as 400: client garbage is
  never a server error) and the connection is closed.
* A refusal before the body was read (401, 403, 404, 503 of a full limiter ...)
  throws away a small body to keep the connection, else closes it. Closing while a
  client is still sending lingers briefly (``send_eof`` and drain), so the client reads
  our answer instead of a reset.
* While a handler runs (and while a ``StreamResponse`` produces), a reader task watches
  the socket: end of file or a reset cancels exactly that handler ("cancel on
  disconnect"). Bytes of a pipelined next request are kept for later, up to
  ``PIPELINE_BUFFER_BYTES``; past that they are dropped (the reader keeps watching)
  and the connection closes after this answer, as a pipelining client must expect.
  A client cannot be told apart from one that only half-closed (``shutdown(SHUT_WR)``
  after sending its request): that one is taken as gone too.
* Every write has ``WRITE_TIMEOUT_S``; a write that cannot finish marks the connection
  broken, cancels the producer and closes.
* A handler that returns an ``Upgrade`` (a WebSocket) gets the socket: the connection
  answers 101 through h11 and awaits ``upgrade.run(stream, leftover_bytes)``, then
  closes. The access checks and the route's limiter have run (and the limiter is held)
  as for any request.

The pure parts (request building, response headers, the refusals) are in ``messages``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import h11
import trio

from . import limits
from .admission import Admission, Seat
from .errors import HTTPError, internal_error, sole_exception
from .messages import (
    CLOSING_STATUSES,
    Address,
    body_coding,
    build_request,
    decode_body,
    malformed,
    response_headers,
    timed_out,
    too_large,
    too_long,
)
from .routes import Dispatch
from .sse import SSE_CONTENT_TYPE, sse_error
from .types import Request, Response, StreamResponse, Upgrade

log = logging.getLogger("bmoe.http")

T = TypeVar("T")

class App(Protocol):
    """What a connection needs from the application (``server.HttpApp``)."""

    def dispatch(self, request: Request) -> Dispatch: ...

    async def call(self, dispatch: Dispatch, request: Request) -> Response | StreamResponse | Upgrade: ...

    def error_response(self, request: Request | None, err: HTTPError) -> Response: ...


class PeerGone(Exception):
    """The client left, or stopped reading for longer than the write timeout."""


class Crowded(Exception):
    """The peer has no place left for one more request to arrive: close at once."""


class Connection:
    def __init__(self, app: App, stream: trio.abc.Stream, peer: Address, local: Address,
                 admission: Admission | None = None, seat: Seat | None = None, ticket: int = 0) -> None:
        self.app = app
        self.stream = stream
        self.peer = peer
        self.local = local
        self.admission = admission        # None: no worker bound, no seats (one connection alone)
        self.seat = seat                  # held while reading (no worker); None while served
        self.ticket = ticket              # the request's place in the arrival order
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.MAX_HEADER_BYTES)
        self.deadline = math.inf          # of the head or body being read
        self.served = 0                   # requests answered on this connection
        self.broken = False               # a write failed: nothing more can be sent
        self.peer_gone = False            # the reader saw the client leave
        self.overflowed = False           # pipelined bytes were dropped: close after this answer
        self.linger = False               # refused a request still arriving: drain before closing
        self.watch_scope: trio.CancelScope | None = None

    # --- the loop ------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            while await self._serve_next():
                self.served += 1
                self.h11.start_next_cycle()
        except Exception as exc:
            if not isinstance(sole_exception(exc), PeerGone):
                log.exception("HTTP connection from %s failed", self.peer[0])
                await self._try_send_internal_error()
        finally:
            await self._close()

    async def _serve_next(self) -> bool:
        """Read one request's head (no worker held), then serve it; True when the
        connection can carry another."""
        if not await self._await_request_start():
            return False
        try:
            event = await self._next_event()
        except h11.RemoteProtocolError as exc:
            return await self._refuse(None, malformed(exc))
        except trio.TooSlowError:
            return await self._refuse(None, timed_out())
        except Crowded:
            return False
        if not isinstance(event, h11.Request):
            return False
        request: Request | None = None
        try:
            request = build_request(event, self.peer, self.local)
            dispatch = self.app.dispatch(request)
        except HTTPError as err:
            return await self._refuse(request, err)
        return await self._with_worker(dispatch, request)

    async def _with_worker(self, dispatch: Dispatch, request: Request) -> bool:
        """Serve a request whose head is whole, holding a worker (waiting for one in
        arrival order); then take a reader's seat again for the next request."""
        if self.admission is None:
            return await self._serve_request(dispatch, request)
        workers, readers = self.admission.workers, self.admission.readers
        if workers.full():
            return False                  # the queue is full: closed at once, unanswered
        self._leave_seat()
        async with workers.hold(self.ticket):
            keep = await self._serve_request(dispatch, request)
        if keep:
            self.seat = readers.seat(self.peer[0])
        return keep and self.seat is not None

    async def _serve_request(self, dispatch: Dispatch, request: Request) -> bool:
        self.deadline = trio.current_time() + limits.BODY_GRACE_S
        try:
            with dispatch.hold():
                await self._read_body(request, dispatch.body_limit)
                return await self._answer(dispatch, request)
        except HTTPError as err:
            return await self._refuse(request, err)
        except h11.RemoteProtocolError as exc:
            return await self._refuse(request, malformed(exc))
        except trio.TooSlowError:
            return await self._refuse(request, timed_out())

    def _leave_seat(self) -> None:
        if self.seat is not None:
            self.seat.leave()
            self.seat = None

    def _cycle_done(self) -> bool:
        return (not self.broken and not self.overflowed and self.h11.our_state is h11.DONE
                and self.h11.their_state is h11.DONE)

    # --- reading -------------------------------------------------------------------

    async def _receive_some(self) -> bytes:
        """Bytes from the client; b"" at its end of file or when the socket failed."""
        try:
            data = await self.stream.receive_some(limits.RECV_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""
        return data if isinstance(data, bytes) else bytes(data)

    async def _await_request_start(self) -> bool:
        """Wait, idle, for the next request's first byte (KEEPALIVE_IDLE_S, or less when
        the seat is taken back for a new connection: ``Seat.idle``); False to close.
        The head deadline runs from that byte."""
        buffered, closed = self.h11.trailing_data
        if not (buffered or closed):
            data = None
            with trio.move_on_after(limits.KEEPALIVE_IDLE_S) as scope, self._idle(scope):
                data = await self._receive_some()
            if data is None or (self.seat is not None and self.seat.gone):
                return False              # idle too long, or the seat was taken back as bytes came
            self.h11.receive_data(data)
        self.deadline = trio.current_time() + limits.HEAD_TIMEOUT_S
        if self.served and self.admission is not None:
            self.ticket = self.admission.workers.ticket()   # a new connection's: taken at accept
        return True

    def _idle(self, scope: trio.CancelScope) -> contextlib.AbstractContextManager[None]:
        return self.seat.idle(scope) if self.seat is not None else contextlib.nullcontext()

    async def _next_event(self) -> Any:
        """The next h11 event, reading under the request's deadline (TooSlowError).
        Waiting for bytes without a worker needs a place for the peer (Crowded)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self.seat is not None and not self.seat.take_place():
                raise Crowded
            with trio.fail_at(self.deadline):
                data = await self._receive_some()
            self.h11.receive_data(data)

    async def _read_body(self, request: Request, limit: int) -> None:
        declared = request.header("content-length")
        if too_long(declared, limit):
            raise too_large(limit)
        coding = body_coding(request)      # refused before a 100 Continue invites the body
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[]))
        start = trio.current_time()
        body = bytearray()
        while not isinstance(event := await self._next_event(), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                raise h11.RemoteProtocolError("the request body ended early", error_status_hint=400)
            body += event.data
            if len(body) > limit:
                raise too_large(limit)
            self.deadline = body_deadline(start, len(body))
        request.body = bytes(body)
        if coding is not None:             # the cap holds again for the decoded bytes
            request.body = await trio.to_thread.run_sync(decode_body, request.body, coding, limit)

    async def _drain(self, request: Request | None) -> bool:
        """Read and drop the rest of a refused request's small body; True if done."""
        if self.h11.their_state is h11.DONE:
            return True
        declared = request.header("content-length") if request else None
        if (request is None or self.h11.they_are_waiting_for_100_continue
                or too_long(declared, limits.DISCARD_BODY_BYTES)):
            return False
        dropped = 0
        try:
            while not isinstance(event := await self._next_event(), h11.EndOfMessage):
                dropped += len(getattr(event, "data", b""))
                if dropped > limits.DISCARD_BODY_BYTES or not isinstance(event, h11.Data):
                    return False
        except (h11.RemoteProtocolError, trio.TooSlowError, Crowded):
            return False
        return True

    # --- the handler, watched ------------------------------------------------------

    async def _watched(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T | None:
        """``await fn(*args)`` while a reader task watches for the client leaving;
        None when it left (fn was cancelled)."""
        result: T | None = None
        async with trio.open_nursery() as nursery:
            self.watch_scope = nursery.cancel_scope
            nursery.start_soon(self._watch_peer)
            result = await fn(*args)
            nursery.cancel_scope.cancel()
        self.watch_scope = None
        return None if self.peer_gone else result

    async def _watch_peer(self) -> None:
        while data := await self._receive_some():
            if self.overflowed or len(self.h11.trailing_data[0]) + len(data) > limits.PIPELINE_BUFFER_BYTES:
                # Too much sent ahead: keep watching, drop it, close after this answer.
                self.overflowed = True
                continue
            self.h11.receive_data(data)
        self.peer_gone = True
        self._cancel_watched()

    def _cancel_watched(self) -> None:
        if self.watch_scope is not None:
            self.watch_scope.cancel()

    async def _answer(self, dispatch: Dispatch, request: Request) -> bool:
        response = await self._watched(self.app.call, dispatch, request)
        if response is None:
            return False
        if isinstance(response, Upgrade):
            await self._switch(response, request)
            return False
        head_only = request.method == "HEAD"
        if isinstance(response, StreamResponse):
            try:
                await self._send_stream(response, request, head_only)
            finally:
                if response.on_close is not None:
                    response.on_close()
        else:
            await self._send_response(response, head_only=head_only, close=False)
        return self._cycle_done()

    async def _switch(self, upgrade: Upgrade, request: Request) -> None:
        """Answer 101 and hand the socket to the new protocol until it is done."""
        if self.h11.their_state is not h11.MIGHT_SWITCH_PROTOCOL:
            err = HTTPError(400, "bad_request",
                            f"This route needs an Upgrade: {upgrade.protocol} request.")
            await self._send_response(self.app.error_response(request, err),
                                      head_only=False, close=True)
            return
        await self._send(h11.InformationalResponse(status_code=101, headers=[
            ("Upgrade", upgrade.protocol), ("Connection", "Upgrade"), *upgrade.headers]))
        leftover, _ = self.h11.trailing_data
        await upgrade.run(self.stream, bytes(leftover))

    # --- writing -------------------------------------------------------------------

    async def _write(self, data: bytes) -> None:
        if self.broken:
            raise PeerGone
        failed = False
        with trio.move_on_after(limits.WRITE_TIMEOUT_S) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                failed = True
        if failed or scope.cancelled_caught:
            self.broken = True
            self._cancel_watched()
            raise PeerGone

    async def _send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            await self._write(data)

    def _head(self, status: int, content_type: str, extra: list[tuple[str, str]],
              length: int | None, close: bool) -> h11.Response:
        return h11.Response(status_code=status, headers=response_headers(
            status, content_type, extra, length=length, close=close))

    async def _send_response(self, response: Response, *, head_only: bool, close: bool) -> None:
        try:
            head = self._head(response.status, response.content_type, response.headers,
                              len(response.body), close)
        except (h11.LocalProtocolError, UnicodeError, ValueError):
            log.exception("a handler's response could not be sent")
            response = self.app.error_response(None, internal_error())
            head = self._head(response.status, response.content_type, response.headers,
                              len(response.body), close)
        await self._send(head)
        if response.body and not head_only and response.status not in (204, 304):
            await self._send(h11.Data(data=response.body))
        await self._send(h11.EndOfMessage())

    async def _send_stream(self, response: StreamResponse, request: Request, head_only: bool) -> None:
        extra = response.headers
        if response.content_type.startswith(SSE_CONTENT_TYPE) and not any(
                k.lower() == "cache-control" for k, _ in extra):
            extra = [*extra, ("Cache-Control", "no-cache")]
        await self._send(self._head(response.status, response.content_type, extra, None, False))
        if head_only or await self._watched(self._produce, response, request):
            await self._send(h11.EndOfMessage())

    async def _produce(self, response: StreamResponse, request: Request) -> bool:
        """Run the producer; True when the body may end normally."""
        async def send(data: bytes) -> None:
            if data:
                await self._send(h11.Data(data=data))

        try:
            await response.produce(send)
            return True
        except Exception as exc:
            leaf = sole_exception(exc)
            if isinstance(leaf, PeerGone):
                return False
            if not isinstance(leaf, HTTPError):
                log.error("stream of %s %s failed", request.method, request.path, exc_info=exc)
                leaf = internal_error()
            return await self._stream_failed(response, leaf)

    async def _stream_failed(self, response: StreamResponse, err: HTTPError) -> bool:
        """An event stream ends with one error chunk; any other body is cut short so the
        client cannot take it for a whole one."""
        if not response.content_type.startswith(SSE_CONTENT_TYPE):
            return False
        await self._send(h11.Data(data=sse_error(err.message, err.code)))
        return True

    # --- refusing and closing ------------------------------------------------------

    async def _refuse(self, request: Request | None, err: HTTPError) -> bool:
        """Answer a refusal; True when the connection can carry another request."""
        if self.broken or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return False
        keep = err.status not in CLOSING_STATUSES and await self._drain(request)
        self.linger = not keep and self.h11.their_state is not h11.DONE
        head_only = request is not None and request.method == "HEAD"
        await self._send_response(self.app.error_response(request, err), head_only=head_only,
                                  close=not keep)
        return keep and self._cycle_done()

    async def _try_send_internal_error(self) -> None:
        if self.broken or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        try:
            response = self.app.error_response(None, internal_error())
            await self._send_response(response, head_only=False, close=True)
        except Exception:
            pass

    async def _close(self) -> None:
        try:
            if self.linger and not (self.broken or self.peer_gone):
                await self._linger()
        finally:
            self._leave_seat()
            await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        """Half-close and drain what a refused client still sends, so it reads our
        answer instead of a reset (an idle seat meanwhile: a new connection may end it)."""
        if not isinstance(self.stream, trio.abc.HalfCloseableStream):
            return
        with trio.move_on_after(limits.LINGER_S) as scope, self._idle(scope):
            try:
                await self.stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            received = 0
            while received < limits.LINGER_BYTES:
                data = await self._receive_some()
                if not data:
                    return
                received += len(data)


def body_deadline(start: float, received: int) -> float:
    """When a body begun at ``start`` must have sent its next bytes: the grace, plus
    what the bytes so far earn at the floor rate."""
    return start + limits.BODY_GRACE_S + received / limits.BODY_FLOOR_BYTES_PER_S


async def serve_connection(app: App, stream: trio.abc.Stream, *, peer: Address = ("127.0.0.1", 0),
                           local: Address = ("127.0.0.1", 0), admission: Admission | None = None,
                           seat: Seat | None = None, ticket: int = 0) -> None:
    """Serve every request of one connection, then close it. With ``admission``, the
    connection arrives holding ``seat`` (taken at accept) and its first ``ticket``."""
    await Connection(app, stream, peer, local, admission, seat, ticket).serve()
