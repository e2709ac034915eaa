"""Who may ask what: the checks every request passes before its handler runs.

The spec's security model defends against the browser (other web pages on this
machine), and against the network where the server was told to listen on one.
``check_access`` applies, in this order, and raises the first refusal:

1. **Host** (loopback binding only): the ``Host`` header must be a loopback name
   (``localhost``, ``127.x.y.z``, ``[::1]``) with the server's port, so a page whose
   own name was rebound to 127.0.0.1 (DNS rebinding) is not answered. Refused with
   ``421 Misdirected Request``, ``code: "bad_host"``: the request was sent to a name
   this server does not answer for, which 421 says exactly and which a client can
   tell apart from the browser refusals below (403). Applies to UI files too. A
   binding beyond loopback lifts the check; the key stands in its place.

The checks below apply to the API: every path the route table places there (a route's
own, or any path under a route's first segment: ``/api``, ``/v1``, llama-server's
``/completion``, ``/props``...; see ``routes.Lookup``). UI files are served without
them. Which checks a route takes is its ``Access``, stated where it is registered:

2. **Key**, when one is set: ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``,
   compared in constant time; else ``401 unauthorized`` + ``WWW-Authenticate: Bearer``.
   Not for an ``Access.PUBLIC`` route (``/health``, as in llama-server), which keeps
   the checks below.
3. **Origin**: a request carrying an ``Origin`` other than the server's own or an
   ``--allow-origin`` one is ``403 forbidden_origin``; with no ``Origin``, a
   ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` is refused the same way
   (``same-site`` included: another port on this host is the same site). The own
   origin is ``http://`` + the request's ``Host`` when that host is a loopback name or
   the address the server is bound to or the connection arrived on, with the port.
   A request with neither header is a program, not a browser page, and passes.
4. **Content type**: a request that is not ``GET`` (or ``HEAD``, which is a ``GET``
   without its body) must say ``Content-Type: application/json`` (any case,
   parameters such as ``; charset=utf-8`` allowed): else ``415``. An HTML form cannot.
5. **Local-only routes**: a route registered ``access=Access.LOCAL_ONLY``, asked by a
   peer that is not loopback, is ``403 local_only``, whatever the key. The check reads
   the route the request is dispatched to, so no spelling of a path reaches that
   handler past it. The application says which routes those are where it registers
   them: this layer keeps no application routes.

No CORS header is ever sent, so no other origin can read an answer either.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field

from .errors import HTTPError
from .routes import Access, Lookup, RouteTable
from .types import Request
from .types import is_loopback_address as is_loopback_address  # where it was first


@dataclass
class AccessPolicy:
    bound_host: str                       # the --host the server listens on
    port: int = 0                         # the port it took (set after binding)
    api_key: str | None = None
    allow_origins: list[str] = field(default_factory=list)


_SECURITY_OK_FETCH_SITES = {"same-origin", "none"}


def check_access(request: Request, policy: AccessPolicy, routes: RouteTable) -> Lookup:
    """Raise the first refusal that applies to ``request`` (see the module docstring);
    else the table's lookup of it (the route that answers it, or its 404 / 405)."""
    _check_host(request, policy)
    found = routes.lookup(request.method, request.raw_path, request.path)
    if found.access is None:
        return found
    if found.access is not Access.PUBLIC:
        _check_key(request, policy)
    _check_origin(request, policy)
    _check_content_type(request)
    if found.access is Access.LOCAL_ONLY and not request.peer_is_loopback:
        raise HTTPError(403, "local_only", "This route answers a client on this machine only.")
    return found


# --- Host --------------------------------------------------------------------------

def split_host(host: str) -> tuple[str, int | None] | None:
    """``"[::1]:80"`` → ``("::1", 80)``; ``"a"`` → ``("a", None)``; None if malformed."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, sep, port_text = host.partition(":")
        port_text = port_text if sep else None
    if not name or (port_text is not None and not (port_text.isascii() and port_text.isdigit())):
        return None
    return name, (int(port_text) if port_text is not None else None)


def is_loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def bound_names(bound_host: str) -> list[str]:
    """The names a ``--host`` value lists (several, comma-separated)."""
    return [h.strip().strip("[]").lower() for h in bound_host.split(",") if h.strip()] \
        or [bound_host.strip("[]").lower()]


def is_loopback_binding(bound_host: str) -> bool:
    return all(is_loopback_name(name) for name in bound_names(bound_host))


def _host_is_ours(host: str | None, request: Request, policy: AccessPolicy) -> bool:
    """The Host names this server: a loopback name, or the bound / arrived-on address,
    with the server's port (the port is implied as 80 when absent)."""
    parsed = split_host(host) if host else None
    if parsed is None:
        return False
    name, port = parsed
    if (port if port is not None else 80) != policy.port:
        return False
    own = {*bound_names(policy.bound_host), request.local[0].split("%", 1)[0].lower()}
    return is_loopback_name(name) or name in own


def _check_host(request: Request, policy: AccessPolicy) -> None:
    if not is_loopback_binding(policy.bound_host):
        return
    parsed = split_host(request.header("host") or "")
    port = parsed[1] if parsed and parsed[1] is not None else 80
    if parsed is None or not is_loopback_name(parsed[0]) or port != policy.port:
        raise HTTPError(421, "bad_host",
                        "This server answers to localhost, 127.0.0.1 or [::1] with its port only.")


# --- Key ---------------------------------------------------------------------------

def _presented_keys(request: Request) -> list[str]:
    keys = []
    for name, value in request.headers:
        if name == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                keys.append(token.strip())
        elif name == "x-api-key":
            keys.append(value.strip())
    return keys


def key_matches(presented: str, key: str) -> bool:
    return hmac.compare_digest(presented.encode("latin-1", "replace"), key.encode("utf-8"))


def _check_key(request: Request, policy: AccessPolicy) -> None:
    if policy.api_key is None:
        return
    if not any(key_matches(k, policy.api_key) for k in _presented_keys(request)):
        raise HTTPError(401, "unauthorized",
                        "An API key is required: send Authorization: Bearer KEY or X-Api-Key: KEY.",
                        headers=[("WWW-Authenticate", "Bearer")])


# --- Origin ------------------------------------------------------------------------

def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _origin_allowed(origin: str, request: Request, policy: AccessPolicy) -> bool:
    origin = _normal_origin(origin)
    if origin in {_normal_origin(o) for o in policy.allow_origins}:
        return True
    host = request.header("host")
    if host is None or not _host_is_ours(host, request, policy):
        return False
    return origin == "http://" + host.strip().lower()


def _forbidden_origin() -> HTTPError:
    return HTTPError(403, "forbidden_origin",
                     "A page from another origin may not use this server's API.")


def _check_origin(request: Request, policy: AccessPolicy) -> None:
    origins = [v for k, v in request.headers if k == "origin"]
    if origins:
        if not all(_origin_allowed(o, request, policy) for o in origins):
            raise _forbidden_origin()
        return
    for name, value in request.headers:
        if name == "sec-fetch-site" and value.strip().lower() not in _SECURITY_OK_FETCH_SITES:
            raise _forbidden_origin()


# --- Content type ------------------------------------------------------------------

def is_json_content_type(value: str) -> bool:
    return value.split(";", 1)[0].strip().lower() == "application/json"


def _check_content_type(request: Request) -> None:
    if request.method in ("GET", "HEAD"):
        return
    types = [v for k, v in request.headers if k == "content-type"]
    if not types or not all(is_json_content_type(t) for t in types):
        raise HTTPError(415, "unsupported_media_type",
                        "Send Content-Type: application/json with every request that is not a GET.")
