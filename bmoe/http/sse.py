"""Server-sent events, encoded: pure functions from values to bytes.

Each event is one ``data:`` line of compact JSON (JSON text never holds a raw line
break, so one line is always enough), preceded by an ``event:`` line when named, and
ended by a blank line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .types import Send, StreamResponse, json_bytes

SSE_CONTENT_TYPE = "text/event-stream"
SSE_HEADERS = [("Cache-Control", "no-cache")]


def sse_event(name: str | None, data: Any) -> bytes:
    if name is not None and any(c in name for c in "\r\n"):
        raise ValueError(f"an SSE event name cannot hold a line break: {name!r}")
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json_bytes(data) + b"\n\n"


def sse_comment(text: str) -> bytes:
    """A comment (``: ping``), which clients ignore; keeps a quiet stream alive."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "".join(f": {line}\n" for line in lines).encode() + b"\n"


def sse_done() -> bytes:
    return b"data: [DONE]\n\n"


def sse_error(message: str, code: str) -> bytes:
    """The error chunk of a stream that already answered 200 (the spec's shape)."""
    return sse_event(None, {"error": {"message": message, "code": code}})


def sse_response(produce: Callable[[Send], Awaitable[None]],
                 headers: list[tuple[str, str]] | None = None) -> StreamResponse:
    """A ``text/event-stream`` response with ``Cache-Control: no-cache``."""
    return StreamResponse(produce=produce, content_type=SSE_CONTENT_TYPE,
                          headers=[*SSE_HEADERS, *(headers or [])])


__all__ = ["SSE_CONTENT_TYPE", "SSE_HEADERS", "Send", "sse_comment", "sse_done",
           "sse_error", "sse_event", "sse_response"]
