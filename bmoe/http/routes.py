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

What a route is, is said once, where it is registered, and kept by every wrapper of
the table (``RouteTable.wrapped`` replaces handlers only):

* ``access``: who it answers (``Access``), read by the access checks;
* ``shape``: the name of the error shape its refusals take, the access checks' included
  (``None``: the server's own ``{"error", "code"}``); the application's error shaper
  knows the names, this layer does not;
* ``model``: it runs the model, so a server that loads the model on demand loads it
  first.

A request no route answers takes its attributes from the table too (``Lookup``): under
the first segment of some route (``/api``, ``/v1``, ``/completion``...) it is the API,
with the key, and its error takes the shape of the deepest route the path lies below;
anywhere else it is outside the API (a UI file may answer it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator
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

    def depth_above(self, segments: list[str]) -> int:
        """How many of ``segments`` the whole pattern covers when the path lies at or
        below it (a parameter takes any one segment, an empty one too; a ``:path`` one
        the rest); 0 when it does not."""
        for i, part in enumerate(self.parts):
            if _is_rest_param(part):
                return len(segments) if i <= len(segments) else 0
            if i >= len(segments) or not (_is_param(part) or part == segments[i]):
                return 0
        return len(self.parts)

    @property
    def specificity(self) -> tuple[int, ...]:
        return tuple(0 if _is_param(p) else 1 for p in self.parts)


def _is_param(part: str) -> bool:
    return part.startswith("{") and part.endswith("}")


def _is_rest_param(part: str) -> bool:
    return _is_param(part) and part.endswith(":path}")


def busy_error() -> HTTPError:
    return HTTPError(503, "busy", "The server is busy; try again shortly.",
                     headers=[("Retry-After", "1")])


class Access(enum.Enum):
    """Who a route answers; the access checks (``access.check_access``) read it."""

    PUBLIC = "public"          # no key; the browser checks (Origin, 415) still apply
    KEY = "key"                # the key, when the server has one
    LOCAL_ONLY = "local_only"  # the key, and a peer on loopback: 403 local_only otherwise


@dataclass(frozen=True)
class Route:
    method: str
    pattern: Pattern
    handler: Handler
    access: Access = Access.KEY
    shape: str | None = None      # its errors' shape, by the name the error shaper knows
    model: bool = False           # it runs the model (an on-demand load wakes first)
    body_limit: int = limits.BODY_LIMIT_BYTES
    limiter: trio.CapacityLimiter | None = None
    limiter_error: HTTPError | None = None


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


@dataclass(frozen=True)
class Lookup:
    """What the table says of one request: the route that answers it, or the refusal
    (404, 405, 400) when none does, and the access class and error shape either way."""

    route: Route | None
    params: dict[str, str]
    refusal: HTTPError | None
    access: Access | None         # None: outside the API (no route's first segment)
    shape: str | None

    def dispatch(self) -> Dispatch:
        """The route's handler and limits; its refusal raised when there is no route."""
        if self.route is None:
            raise self.refusal or HTTPError(404, "not_found", "No such route.")
        r = self.route
        return Dispatch(r.handler, r.body_limit, r.limiter, r.limiter_error, self.params)


class RouteTable:
    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(
        self,
        method: str,
        pattern: str,
        handler: Handler,
        *,
        access: Access = Access.KEY,
        shape: str | None = None,
        model: bool = False,
        body_limit: int = limits.BODY_LIMIT_BYTES,
        limiter: trio.CapacityLimiter | None = None,
        limiter_error: HTTPError | None = None,
    ) -> Route:
        """Register a route with what it is: ``access`` (who it answers), ``shape`` (its
        errors' shape, by name; None for the server's own), ``model`` (it runs the model)."""
        method = method.upper()
        parsed = Pattern.parse(pattern)
        if any(r.method == method and r.pattern.text == pattern for r in self._routes):
            raise ValueError(f"route registered twice: {method} {pattern}")
        route = Route(method, parsed, handler, access, shape, model, body_limit, limiter,
                      limiter_error)
        self._routes.append(route)
        return route

    def wrapped(self, wrap: Callable[[Route], Handler]) -> RouteTable:
        """The same routes, each handler replaced by ``wrap(route)``: every other attribute
        (access, shape, model, limits, and any added later) is kept as registered."""
        out = RouteTable()
        out._routes = [dataclasses.replace(r, handler=wrap(r)) for r in self._routes]
        return out

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes)

    def match(self, method: str, raw_path: str) -> Dispatch:
        """The route for ``method`` on ``raw_path``; HTTPError 404 or 405 if none."""
        return self.lookup(method, raw_path).dispatch()

    def lookup(self, method: str, raw_path: str, path: str | None = None) -> Lookup:
        """The route for ``method`` on ``raw_path``, or why there is none. ``path`` is the
        decoded path (``Request.path``; from ``raw_path`` when not given), which places
        a request no route answers: inside the API or not, below which route."""
        decoded = (unquote(raw_path) if path is None else path)[1:].split("/")
        try:
            segments = path_segments(raw_path)
        except HTTPError as err:
            return self._unmatched(err, decoded, [], [])
        found = [(r, p) for r in self._routes if (p := r.pattern.match(segments)) is not None]
        found.sort(key=lambda rp: rp[0].pattern.specificity, reverse=True)
        for wanted in ([method, "GET"] if method == "HEAD" else [method]):
            for route, params in found:
                if route.method == wanted:
                    return Lookup(route, params, None, route.access, route.shape)
        if not found:
            return self._unmatched(HTTPError(404, "not_found", "No such route."), decoded,
                                   segments, [])
        return self._unmatched(_not_allowed({r.method for r, _ in found}), decoded, segments,
                               [r for r, _ in found])

    def _unmatched(self, refusal: HTTPError, decoded: list[str], segments: list[str],
                   at_path: list[Route]) -> Lookup:
        """A request no route answers. At a route's path with another method (405): the
        key unless every route there is public, and their shape. Elsewhere: the key when
        the path lies under a route's first segment, and the deepest such route's shape."""
        if at_path:
            public = all(r.access is Access.PUBLIC for r in at_path)
            return Lookup(None, {}, refusal, Access.PUBLIC if public else Access.KEY,
                          at_path[0].shape)
        firsts = {s[0] for s in (decoded, segments) if s}
        inside = any(_is_param(r.pattern.parts[0]) or r.pattern.parts[0] in firsts
                     for r in self._routes)
        return Lookup(None, {}, refusal, Access.KEY if inside else None, self._shape_above(decoded))

    def _shape_above(self, segments: list[str]) -> str | None:
        depth, best = 0, None
        for r in self._routes:
            d = r.pattern.depth_above(segments)
            if d and (d, r.pattern.specificity) > (depth, best.pattern.specificity if best else ()):
                depth, best = d, r
        return best.shape if best else None


def _not_allowed(methods: set[str]) -> HTTPError:
    if "GET" in methods:
        methods = methods | {"HEAD"}
    allow = ", ".join(sorted(methods))
    return HTTPError(405, "method_not_allowed", f"This route answers {allow} only.",
                     headers=[("Allow", allow)])
