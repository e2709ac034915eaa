"""Shared pieces of the HTTP tests: a small app, raw requests, a response reader."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from _slowloris import check_attack  # noqa: F401 (shared with the tests of this folder)

from bmoe.http.access import AccessPolicy
from bmoe.http.connection import serve_connection
from bmoe.http.errors import HTTPError, invalid_request
from bmoe.http.routes import RouteTable
from bmoe.http.server import ErrorShaper, HttpApp
from bmoe.http.sse import sse_done, sse_event, sse_response
from bmoe.http.types import Request, Response, Send, StreamResponse

PORT = 8765
HOST = f"127.0.0.1:{PORT}"
LOOPBACK_PEER = ("127.0.0.1", 40000)
NETWORK_PEER = ("192.168.7.20", 40000)
# The spec's policy, written out here rather than imported, so a change shows.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
    "connect-src 'self'; media-src 'none'; object-src 'none'; frame-src 'self' blob:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADER_NAMES = ["content-security-policy", "x-content-type-options",
                         "referrer-policy", "x-frame-options"]


# --- a small application -----------------------------------------------------------

@dataclass
class Probe:
    """What the test handlers saw, for tests to assert on."""

    gate: trio.Event = field(default_factory=trio.Event)
    started: trio.Event = field(default_factory=trio.Event)
    cancelled: trio.Event = field(default_factory=trio.Event)
    served: list[str] = field(default_factory=list)
    cancels: int = 0
    stream_error: BaseException | None = None


def _check_echo(body: dict[str, Any]) -> dict[str, Any]:
    """Field types as a real route checks them: every wrong type is a 400."""
    name = body.get("name", "")
    if not isinstance(name, str):
        raise invalid_request("'name' must be a string.")
    count = body.get("count", 0)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 1000:
        raise invalid_request("'count' must be an integer from 0 to 1000.")
    items = body.get("items", [])
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise invalid_request("'items' must be a list of strings.")
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise invalid_request("'options' must be an object.")
    return {"name": name, "count": count, "items": items}


def make_routes(probe: Probe, *, body_limit: int | None = None,
                stream_limiter: trio.CapacityLimiter | None = None) -> RouteTable:
    table = RouteTable()

    async def ping(request: Request) -> Response:
        probe.served.append(request.query.get("tag", ""))
        return Response.json({"ok": True, "tag": request.query.get("tag", "")})

    async def echo(request: Request) -> Response:
        return Response.json(_check_echo(request.json_object()))

    async def boom(request: Request) -> Response:
        raise RuntimeError("secret detail that must not leak")

    async def teapot(request: Request) -> Response:
        raise HTTPError(418, "teapot", "Short and stout.", headers=[("X-Tea", "earl grey")])

    async def item(request: Request) -> Response:
        return Response.json(request.path_params)

    async def wait(request: Request) -> Response:
        probe.started.set()
        try:
            await probe.gate.wait()
        except trio.Cancelled:
            probe.cancels += 1
            probe.cancelled.set()
            raise
        probe.served.append(request.query.get("tag", ""))
        return Response.json({"waited": True})

    async def stream(request: Request) -> StreamResponse:
        count_text = request.query.get("n", "3")
        if not count_text.isdigit():
            raise invalid_request("'n' must be a count.")
        count = int(count_text)

        async def produce(send: Send) -> None:
            try:
                for i in range(count):
                    await send(sse_event("tick", {"i": i}))
                if request.query.get("fail") == "http":
                    raise HTTPError(503, "busy", "Gone busy.")
                if request.query.get("fail") == "bug":
                    raise RuntimeError("secret stream detail")
                if request.query.get("forever"):
                    while True:
                        await send(b": filler " + b"x" * 4096 + b"\n\n")
                await send(sse_done())
            except BaseException as exc:
                probe.stream_error = exc
                raise
        return sse_response(produce)

    async def plain_stream(request: Request) -> StreamResponse:
        async def produce(send: Send) -> None:
            await send(b"part one,")
            raise RuntimeError("cut")
        return StreamResponse(produce, content_type="text/plain")

    table.add("GET", "/api/ping", ping)
    table.add("POST", "/api/echo", echo, **({"body_limit": body_limit} if body_limit else {}))
    table.add("PUT", "/api/echo", echo)
    table.add("GET", "/api/boom", boom)
    table.add("GET", "/api/teapot", teapot)
    table.add("GET", "/api/items/{id}", item)
    table.add("GET", "/api/wait", wait)
    table.add("GET", "/api/stream", stream, limiter=stream_limiter,
              limiter_error=HTTPError(503, "streams_full", "Too many event streams."))
    table.add("GET", "/api/plain-stream", plain_stream)
    table.add("POST", "/v1/messages", echo, shape="anthropic")
    return table


def anthropic_shaper(shape: str, err: HTTPError) -> Response | None:
    if shape != "anthropic":
        return None
    return Response.json({"type": "error", "error": {"type": err.code, "message": err.message}},
                         status=err.status)


def make_app(probe: Probe | None = None, *, policy: AccessPolicy | None = None,
             static_dir: Path | None = None, error_shaper: ErrorShaper | None = None,
             body_limit: int | None = None,
             stream_limiter: trio.CapacityLimiter | None = None) -> HttpApp:
    routes = make_routes(probe or Probe(), body_limit=body_limit, stream_limiter=stream_limiter)
    return HttpApp(routes, policy or AccessPolicy("127.0.0.1", port=PORT),
                   static_dir=static_dir, error_shaper=error_shaper)


# --- requests ------------------------------------------------------------------------

def request_bytes(method: str, target: str, *, host: str | None = HOST,
                  headers: list[tuple[str, str]] | None = None, body: bytes | None = None,
                  json_body: Any = None, content_type: str | None = None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    if json_body is not None:
        body = json.dumps(json_body).encode()
        content_type = content_type or "application/json"
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in headers or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


GET_PING_BYTES = request_bytes("GET", "/api/ping")


# --- responses -----------------------------------------------------------------------

@dataclass
class RawResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)


class ResponseReader:
    """Reads HTTP/1.1 responses off a stream, by hand, as a strict client would."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.eof = False

    async def _fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def _take_until(self, marker: bytes) -> bytes | None:
        while (i := self.buffer.find(marker)) < 0:
            if not await self._fill():
                return None
        chunk = bytes(self.buffer[:i])
        del self.buffer[:i + len(marker)]
        return chunk

    async def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not await self._fill():
                raise EOFError("response body cut short")
        chunk = bytes(self.buffer[:n])
        del self.buffer[:n]
        return chunk

    async def read(self, *, head_only: bool = False) -> RawResponse | None:
        """The next final response; None when the server closed before one began."""
        while True:
            head = await self._take_until(b"\r\n\r\n")
            if head is None:
                if self.buffer:
                    raise EOFError("response head cut short")
                return None
            status, headers = _parse_head(head)
            if status >= 200:
                break
        if head_only or status in (204, 304):
            return RawResponse(status, headers, b"")
        return RawResponse(status, headers, await self._body(headers))

    async def _body(self, headers: list[tuple[str, str]]) -> bytes:
        values = dict(headers)
        if "content-length" in values:
            return await self._take(int(values["content-length"]))
        if values.get("transfer-encoding", "").lower() == "chunked":
            return await self._chunked()
        while await self._fill():
            pass
        body = bytes(self.buffer)
        self.buffer.clear()
        return body

    async def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = await self._take_until(b"\r\n")
            if size_line is None:
                raise EOFError("chunked body cut short")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await self._take_until(b"\r\n")
                return bytes(body)
            body += await self._take(size)
            await self._take(2)

    async def read_chunks_until(self, marker: bytes) -> bytes:
        """Raw bytes (chunk framing included) until ``marker`` shows up."""
        while marker not in self.buffer:
            if not await self._fill():
                break
        return bytes(self.buffer)


def _parse_head(head: bytes) -> tuple[int, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    assert parts[0] in ("HTTP/1.1", "HTTP/1.0"), lines[0]
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return int(parts[1]), headers


def assert_security_headers(response: RawResponse) -> None:
    for name in SECURITY_HEADER_NAMES:
        assert response.header(name), f"{name} missing on a {response.status}"
    assert response.header("content-security-policy") == CONTENT_SECURITY_POLICY
    assert response.header("x-content-type-options") == "nosniff"
    assert response.header("referrer-policy") == "no-referrer"
    assert response.header("x-frame-options") == "DENY"
    assert not any(k.startswith("access-control-") for k, _ in response.headers)


# --- running a connection over memory streams -----------------------------------------

async def exchange(app: HttpApp, *chunks: bytes, responses: int = 1,
                   peer: tuple[str, int] = LOOPBACK_PEER, head_only: bool = False,
                   local: tuple[str, int] = ("127.0.0.1", PORT)) -> list[RawResponse | None]:
    """Send ``chunks`` on one connection, read ``responses`` responses, close."""
    client, server = trio.testing.memory_stream_pair()
    got: list[RawResponse | None] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve_connection(app, server, peer=peer, local=local))
        for chunk in chunks:
            await client.send_all(chunk)
        reader = ResponseReader(client)
        for _ in range(responses):
            got.append(await reader.read(head_only=head_only))
        await client.aclose()
    return got


def run(fn: Any, *args: Any, autojump: bool = False) -> Any:
    clock = trio.testing.MockClock(autojump_threshold=0) if autojump else None
    return trio.run(fn, *args, clock=clock)


def one(app: HttpApp, data: bytes, **kw: Any) -> RawResponse:
    """Exchange one request for one response."""
    async def main() -> RawResponse:
        (response,) = await exchange(app, data, **kw)
        assert response is not None
        return response
    return trio.run(main)


# --- a slow-client attack, and what the other clients see meanwhile ---------------------

SLOWLORIS = Path(__file__).resolve().parents[1] / "_slowloris.py"
CHAT_TICK_S = 0.05                # the stand-in chat stream's token interval
EVENTS_TICK_S = 0.1               # the stand-in event stream's interval


def streaming_app(policy: AccessPolicy) -> HttpApp:
    """``GET /api/info`` at once; a chat that streams forever (``POST /v1/chat/completions``)
    and the UI's event stream (``GET /api/events``), each a tick at a steady pace."""
    async def info(request: Request) -> Response:
        return Response.json({"state": "ready"})

    def ticking(interval: float) -> StreamResponse:
        async def produce(send: Send) -> None:
            i = 0
            while True:
                await send(sse_event("tick", {"i": i}))
                i += 1
                await trio.sleep(interval)
        return sse_response(produce)

    async def chat(request: Request) -> StreamResponse:
        return ticking(CHAT_TICK_S)

    async def events(request: Request) -> StreamResponse:
        return ticking(EVENTS_TICK_S)

    routes = RouteTable()
    routes.add("GET", "/api/info", info)
    routes.add("POST", "/v1/chat/completions", chat)
    routes.add("GET", "/api/events", events)
    return HttpApp(routes, policy)


@dataclass
class StreamWatch:
    """When each chunk of a long response arrived, and whether it ended."""

    times: list[float] = field(default_factory=list)
    ended: bool = False

    def max_gap(self, since: float) -> float:
        times = [t for t in self.times if t >= since]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=math.inf)


async def open_and_watch(nursery: trio.Nursery, host: str, port: int, data: bytes,
                         watch: StreamWatch) -> trio.SocketStream:
    """Send ``data`` on a new connection, wait for the first chunk, then record every
    chunk in the background."""
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(data)
    first = await stream.receive_some(65536)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]

    async def watch_chunks() -> None:
        while await stream.receive_some(65536):
            watch.times.append(trio.current_time())
        watch.ended = True
    nursery.start_soon(watch_chunks)
    return stream


ATTACK_HEAD_TIMEOUT_S = 2.0      # the head deadline the HTTP tests patch in: attacks run briefly
ATTACK_S = ATTACK_HEAD_TIMEOUT_S + 2.5


async def attack(host: str, port: int, tricklers: int, *, prefix: tuple[str, ...] = (),
                 key: str | None = None) -> tuple[dict[str, Any], StreamWatch, StreamWatch, float]:
    """Open a chat stream and an event stream, run the slowloris script (after
    ``prefix``: ``ip netns exec NS``), and return its report, both watches and when the
    attack began."""
    chat, events = StreamWatch(), StreamWatch()
    headers = [("Authorization", f"Bearer {key}")] if key else []
    at = f"{host}:{port}"
    async with trio.open_nursery() as nursery:
        streams = [await open_and_watch(nursery, host, port, request_bytes(
            "POST", "/v1/chat/completions", host=at, json_body={"stream": True}, headers=headers), chat),
            await open_and_watch(nursery, host, port, request_bytes(
                "GET", "/api/events", host=at, headers=headers), events)]
        began = trio.current_time()
        command = [*prefix, sys.executable, str(SLOWLORIS), host, str(port),
                   "--tricklers", str(tricklers), "--seconds", str(ATTACK_S)]
        if key:
            command += ["--key", key]
        result = await trio.run_process(command, capture_stdout=True)
        nursery.cancel_scope.cancel()
    for stream in streams:
        await stream.aclose()
    return json.loads(result.stdout), chat, events, began


def check_streams(chat: StreamWatch, events: StreamWatch, began: float) -> None:
    assert not chat.ended and not events.ended
    assert chat.max_gap(began) < 1.0, "the chat stream stalled during the attack"
    assert events.max_gap(began) < 1.0, "the event stream stalled during the attack"
    assert chat.times[-1] - began > ATTACK_S - 1.0 and events.times[-1] - began > ATTACK_S - 1.0
