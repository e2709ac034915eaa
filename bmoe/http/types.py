"""Request and response values passed between the connection and the handlers."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import invalid_request


def is_loopback_address(ip: str) -> bool:
    """True for 127.0.0.0/8, ::1 and an IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


@dataclass
class Request:
    method: str                      # "GET", "POST", ...
    target: str                      # raw request target, e.g. "/v1/models?x=1"
    path: str                        # percent-decoded path without the query
    query: dict[str, str]            # last value wins
    headers: list[tuple[str, str]]   # names lower-cased, values decoded as latin-1
    body: bytes
    peer: tuple[str, int]            # the connection's peer address
    local: tuple[str, int]           # the address the connection arrived on
    path_params: dict[str, str] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def raw_path(self) -> str:
        """The target's path as sent, still percent-encoded (what routes match on)."""
        return self.target.split("?", 1)[0]

    @property
    def peer_is_loopback(self) -> bool:
        return is_loopback_address(self.peer[0])

    def json(self) -> Any:
        """The body as JSON; an empty body is ``{}``. Not JSON, or not UTF-8 text (raw
        bytes or a lone surrogate escape): 400 invalid_request, on every route."""
        if not self.body.strip():
            return {}
        try:
            text = self.body.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_request("The request body is not valid UTF-8.") from None
        try:
            value = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError:
            raise invalid_request("The request body's JSON is nested too deeply.") from None
        except ValueError as e:
            raise invalid_request(f"The request body is not valid JSON: {e}.") from None
        if _SURROGATE_ESCAPE.search(text) and _holds_lone_surrogate(value):
            raise invalid_request("The request body holds a lone UTF-16 surrogate (such as "
                                  "\\ud800), which is not a character and has no UTF-8 form.")
        return value

    def json_object(self) -> dict[str, Any]:
        value = self.json()
        if not isinstance(value, dict):
            raise invalid_request("The request body must be a JSON object.")
        return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# The body is valid UTF-8, so a surrogate can only come from a ``\uD800``-``\uDFFF``
# escape; a body without one (nearly all) is not walked. A pair decodes to one character,
# so a surrogate left in a decoded string is a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
    return False


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(cls, value: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
        return cls(status=status, body=json_bytes(value), headers=list(headers or []))


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON; a lone surrogate a client sent us comes back escaped."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


# A streaming body writes chunks through ``send``; the connection applies the write
# timeout and cancels the producer when the client goes away.
Send = Callable[[bytes], Awaitable[None]]


@dataclass
class StreamResponse:
    produce: Callable[[Send], Awaitable[None]]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)
    # Called exactly once when the response is over, however it ended (sent, client
    # gone, headers never written): where a handler releases what it took for the stream.
    on_close: Callable[[], None] | None = None


@dataclass
class Upgrade:
    """Switch the connection to another protocol (a WebSocket, RFC 6455).

    The connection answers ``101 Switching Protocols`` with ``Upgrade: protocol`` and
    ``headers``, then awaits ``run(stream, leftover)``: the socket and the bytes the
    client already sent past the request. ``run`` owns every read, write and timeout
    from there; the connection closes the socket when it returns. A request that did
    not ask to switch (no ``Upgrade`` header) is answered 400 instead.
    """

    protocol: str
    run: Callable[[Any, bytes], Awaitable[None]]
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable["Response | StreamResponse | Upgrade"]]
