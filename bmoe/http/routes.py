"""One flat route table.

``table.add("DELETE", "/api/models/local/{name}", handler)`` registers a route. A
pattern is literal segments and ``{param}`` segments (one non-empty segment each);
a last segment written ``{param:path}`` takes the rest of the path, slashes and all.
Matching works on the raw path split at ``/`` with each segment percent-decoded
afterwards, so ``%2F`` inside a name stays inside that one parameter.

When several patterns match, the one with literal segments furthest to the left
wins (``/api/models/download`` before ``/api/models/{x}``). An unknown path is a
JSON 404 ``not_found``; a known path with another method is 405
``method_not_allowed`` with an ``Allow`` header. ``HEAD`` falls back to ``GET``.

A route may carry a ``trio.CapacityLimiter``: the connection takes one of its
tokens without waiting before it reads the body, refuses the request with
``limiter_error`` when none is free, and gives the token back when the response is
done. That is how "at most 8 event streams" is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import unquote

import trio

from . import limits
from .errors import HTTPError
from .types import Handler


def path_segments(raw_path: str) -> list[str]:
    """The raw path's segments, each percent-decoded; bad UTF-8 is a 400."""
    if not raw_path.startswith("/"):
        raise HTTPError(400, "bad_request", "The request target must be a path.")
    try:
        return [unquote(s, errors="strict") for s in raw_path[1:].split("/")]
    except UnicodeDecodeError:
        raise HTTPError(400, "bad_request", "The request path is not valid UTF-8.") from None


@dataclass(frozen=True)
class Pattern:
    text: str
    parts: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Pattern:
        if not text.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {text!r}")
        parts = tuple(text[1:].split("/"))
        for i, part in enumerate(parts):
            if part.endswith(":path}") and i != len(parts) - 1:
                raise ValueError(f"{{name:path}} must be the last segment: {text!r}")
        return cls(text, parts)

    def match(self, segments: list[str]) -> dict[str, str] | None:
        params: dict[str, str] = {}
        for i, part in enumerate(self.parts):
            if _is_rest_param(part):
                rest = "/".join(segments[i:])
                if not rest:
                    return None
                params[part[1:-6]] = rest
                return params
            if i >= len(segments):
                return None
            if _is_param(part):
                if not segments[i]:
                    return None
                params[part[1:-1]] = segments[i]
            elif part != segments[i]:
                return None
        return params if len(segments) == len(self.parts) else None

    def match_loosely(self, segments: list[str]) -> bool:
        """Like ``match`` but every parameter may take one or more segments.

        Used for the local-only list: matching too much there only refuses more
        from the network, while matching too little would let a route through.
        """
        return _loose(self.parts, segments)

    @property
    def specificity(self) -> tuple[int, ...]:
        return tuple(0 if _is_param(p) else 1 for p in self.parts)


def _is_param(part: str) -> bool:
    return part.startswith("{") and part.endswith("}")


def _is_rest_param(part: str) -> bool:
    return _is_param(part) and part.endswith(":path}")


def _loose(parts: tuple[str, ...], segments: list[str]) -> bool:
    # reach: how many segments the parts so far can consume (a glob match, linear per part)
    reach = {0}
    for part in parts:
        if _is_param(part):
            reach = set(range(min(reach) + 1, len(segments) + 1)) if reach else set()
        else:
            reach = {j + 1 for j in reach if j < len(segments) and segments[j] == part}
    return len(segments) in reach


def busy_error() -> HTTPError:
    return HTTPError(503, "busy", "The server is busy; try again shortly.",
                     headers=[("Retry-After", "1")])


@dataclass(frozen=True)
class Route:
    method: str
    pattern: Pattern
    handler: Handler
    body_limit: int = limits.BODY_LIMIT_BYTES
    limiter: trio.CapacityLimiter | None = None
    limiter_error: HTTPError | None = None
    local_only: bool = False      # answered to a loopback peer only (403 local_only)


@dataclass
class Dispatch:
    """What the connection needs to serve one request: its handler and its limits."""

    handler: Handler
    body_limit: int
    limiter: trio.CapacityLimiter | None = None
    limiter_error: HTTPError | None = None
    params: dict[str, str] = field(default_factory=dict)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold a token of the route's limiter, or refuse at once with its error."""
        if self.limiter is None:
            yield
            return
        borrower = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            raise (self.limiter_error or busy_error()) from None
        try:
            yield
        finally:
            self.limiter.release_on_behalf_of(borrower)


class RouteTable:
    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(
        self,
        method: str,
        pattern: str,
        handler: Handler,
        *,
        body_limit: int = limits.BODY_LIMIT_BYTES,
        limiter: trio.CapacityLimiter | None = None,
        limiter_error: HTTPError | None = None,
        local_only: bool = False,
    ) -> None:
        """Register a route. ``local_only``: the access checks refuse it (403) to a peer
        that is not on loopback, whatever the key."""
        method = method.upper()
        parsed = Pattern.parse(pattern)
        if any(r.method == method and r.pattern.text == pattern for r in self._routes):
            raise ValueError(f"route registered twice: {method} {pattern}")
        self._routes.append(Route(method, parsed, handler, body_limit, limiter, limiter_error,
                                  local_only))

    def local_only_patterns(self) -> list[tuple[str, Pattern]]:
        """(method, pattern) of every route registered ``local_only``."""
        return [(r.method, r.pattern) for r in self._routes if r.local_only]

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes)

    def match(self, method: str, raw_path: str) -> Dispatch:
        """The route for ``method`` on ``raw_path``; HTTPError 404 or 405 if none."""
        segments = path_segments(raw_path)
        found = [(r, p) for r in self._routes if (p := r.pattern.match(segments)) is not None]
        if not found:
            raise HTTPError(404, "not_found", "No such route.")
        found.sort(key=lambda rp: rp[0].pattern.specificity, reverse=True)
        for wanted in ([method, "GET"] if method == "HEAD" else [method]):
            for route, params in found:
                if route.method == wanted:
                    return Dispatch(route.handler, route.body_limit, route.limiter,
                                    route.limiter_error, params)
        raise _not_allowed({r.method for r, _ in found})


def _not_allowed(methods: set[str]) -> HTTPError:
    if "GET" in methods:
        methods = methods | {"HEAD"}
    allow = ", ".join(sorted(methods))
    return HTTPError(405, "method_not_allowed", f"This route answers {allow} only.",
                     headers=[("Allow", allow)])
