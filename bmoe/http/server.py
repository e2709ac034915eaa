"""The HTTP server: listening sockets, the worker pool, and the application object.

Theory of operation
-------------------

``serve_http`` binds the listening sockets (port 0 takes a free port, which it hands
to ``task_status.started``) and sets TCP keep-alive on them, so that accepted
sockets inherit it (Linux clones a listener's TCP options into each connection).
Then, in one nursery::

    accept loop ──► one task per connection (a reader's seat) ══ whole head ══► WORKERS
        │ queue full, or no seat to be had:       │ HEAD_TIMEOUT_S          (queue of
        └ the new connection is closed at once    └ PEER_ARRIVING per peer   ACCEPT_QUEUE)

Each accepted connection gets its own task (``connection.Connection``) and a seat
among READERS (``admission.Readers``); it reads its request head without a worker,
and only a request whose head is whole (and which passed the access checks) waits
for one of WORKERS (``admission.Workers``), in the order requests began to arrive.
A worker is held from there to the end of the answer; between two requests a
kept-alive connection holds a seat, never a worker. While ACCEPT_QUEUE requests wait,
a new connection is closed at once without a word. ``admission`` tells the whole story.

``HttpApp`` is what a connection calls: ``dispatch`` runs the access checks
(``access.check_access``, which looks the request up in the route table and checks it
as its route says) and hands back that route (static files from ``static_dir`` for
the paths outside the API, which no route's first segment claims); ``call`` runs the
handler and turns what it raises into a response: an ``HTTPError`` into its JSON (or,
for a route registered with a ``shape``, what ``error_shaper`` makes of it), anything
else into a 500 ``internal`` whose traceback goes to the log (stderr), never to the
client.

Stopping: cancel the scope around ``serve_http``; every connection's handler is
cancelled with it and every socket closed. ``watch_parent`` does that when a
``--parent-pid`` process ends.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket as stdsocket
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

from . import limits
from .access import AccessPolicy, check_access
from .admission import Admission
from .connection import serve_connection
from .errors import HTTPError, internal_error, sole_exception, storage_error
from .parent import watch_parent
from .routes import Dispatch, RouteTable
from .static import StaticFiles
from .types import Request, Response, StreamResponse, Upgrade

log = logging.getLogger("bmoe.http")

# (the route's shape name, the error) -> that shape's response, or None for the server's own
ErrorShaper = Callable[[str, HTTPError], "Response | None"]


class HttpApp:
    def __init__(self, routes: RouteTable, policy: AccessPolicy, static_dir: Path | None = None,
                 error_shaper: ErrorShaper | None = None) -> None:
        self.routes = routes
        self.policy = policy
        self.static = StaticFiles(static_dir) if static_dir is not None else None
        self.error_shaper = error_shaper

    def dispatch(self, request: Request) -> Dispatch:
        """Access checks, then the route (or a static file); HTTPError if refused."""
        found = check_access(request, self.policy, self.routes)
        if found.route is None and found.access is None and self.static is not None \
                and request.method in ("GET", "HEAD") and found.refusal is not None \
                and found.refusal.status == 404:
            return Dispatch(self.static, limits.BODY_LIMIT_BYTES)
        dispatch = found.dispatch()
        request.path_params = found.params
        return dispatch

    async def call(self, dispatch: Dispatch, request: Request) -> Response | StreamResponse | Upgrade:
        try:
            return await dispatch.handler(request)
        except Exception as exc:
            leaf = sole_exception(exc)
            if not isinstance(leaf, HTTPError):
                stored = storage_error(leaf)
                if stored is not None:
                    log.warning("%s %s: %s", request.method, request.path, stored.message)
                    leaf = stored
                else:
                    log.error("%s %s failed", request.method, request.path, exc_info=exc)
                    leaf = internal_error()
            return self.error_response(request, leaf)

    def error_response(self, request: Request | None, err: HTTPError) -> Response:
        """The error's JSON, or the shape the request's route declares for it (``None``:
        no request could be read)."""
        shaped = self._shaped(request, err)
        if shaped is None:
            return Response.json({"error": err.message, "code": err.code}, status=err.status,
                                 headers=err.headers)
        named = {k.lower() for k, _ in shaped.headers}
        extra = [(k, v) for k, v in err.headers if k.lower() not in named]
        return dataclasses.replace(shaped, headers=[*shaped.headers, *extra])

    def _shaped(self, request: Request | None, err: HTTPError) -> Response | None:
        if self.error_shaper is None or request is None:
            return None
        shape = self.routes.lookup(request.method, request.raw_path, request.path).shape
        if shape is None:
            return None
        try:
            return self.error_shaper(shape, err)
        except Exception:
            log.exception("the error shaper failed for %s (%s)", request.path, shape)
            return None


# --- listening ---------------------------------------------------------------------

def configure_listening_socket(sock: stdsocket.socket | trio.socket.SocketType) -> None:
    """TCP keep-alive probes and the unacknowledged-data bound, for accepted sockets to
    inherit. Options a platform lacks are skipped."""
    sock.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_KEEPALIVE, 1)
    options = [("TCP_KEEPIDLE", limits.TCP_KEEPIDLE_S), ("TCP_KEEPINTVL", limits.TCP_KEEPINTVL_S),
               ("TCP_KEEPCNT", limits.TCP_KEEPCNT),
               ("TCP_USER_TIMEOUT", limits.TCP_USER_TIMEOUT_S * 1000)]
    for name, value in options:
        option = getattr(stdsocket, name, None)
        if option is not None:
            sock.setsockopt(stdsocket.IPPROTO_TCP, option, value)


def host_names(host: str) -> list[str]:
    """The names a ``--host`` value lists (comma-separated; ``[::1]`` read as ``::1``)."""
    return [h.strip().strip("[]") for h in host.split(",") if h.strip()] or [host]


async def bind_listening_sockets(host: str, port: int) -> list[trio.socket.SocketType]:
    """One listening socket per address ``host`` resolves to, all on the same port
    (with port 0, the one the first socket took). ``host`` may list several names or
    addresses, comma-separated (``127.0.0.1,::1``), as llama-server's ``--host`` does."""
    infos = []
    for name in host_names(host):
        infos += await trio.socket.getaddrinfo(name, port, type=stdsocket.SOCK_STREAM,
                                               flags=stdsocket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, str(addr[0])) for family, _, _, _, addr in infos))
    sockets: list[trio.socket.SocketType] = []
    try:
        for family, ip in addresses:
            chosen = sockets[0].getsockname()[1] if sockets else port
            sock = await _bind_one(family, ip, chosen, first=not sockets)
            if sock is not None:
                sockets.append(sock)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _bind_one(family: int, ip: str, port: int, *, first: bool) -> trio.socket.SocketType | None:
    sock = trio.socket.socket(family, stdsocket.SOCK_STREAM)
    try:
        sock.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_REUSEADDR, 1)
        if family == stdsocket.AF_INET6:
            sock.setsockopt(stdsocket.IPPROTO_IPV6, stdsocket.IPV6_V6ONLY, 1)
        configure_listening_socket(sock)
        await sock.bind((ip, port))
        sock.listen(limits.LISTEN_BACKLOG)
        return sock
    except OSError as exc:
        sock.close()
        if first:
            raise
        log.warning("not listening on %s port %d: %s", ip, port, exc)
        return None


# --- serving -----------------------------------------------------------------------

_ACCEPT_RETRY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


async def serve_http(app: HttpApp, host: str, port: int, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``host``:``port`` until cancelled; ``started(actual_port)``."""
    sockets = await bind_listening_sockets(host, port)
    listeners = [trio.SocketListener(sock) for sock in sockets]
    app.policy.bound_host = host              # the checks follow the actual binding
    app.policy.port = sockets[0].getsockname()[1]
    admission = Admission.from_limits()
    try:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(_accept_loop, app, listener, admission, nursery)
            task_status.started(app.policy.port)
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await trio.aclose_forcefully(listener)


async def _accept_loop(app: HttpApp, listener: trio.SocketListener, admission: Admission,
                       nursery: trio.Nursery) -> None:
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _ACCEPT_RETRY_ERRNOS:
                raise
            log.warning("accept failed (%s); retrying", exc)
            await trio.sleep(limits.ACCEPT_RETRY_S)
            continue
        try:
            peer, local = _addresses(stream)
        except OSError:
            await trio.aclose_forcefully(stream)
            continue
        seat = None if admission.workers.full() else admission.readers.seat(peer[0])
        if seat is None:
            await trio.aclose_forcefully(stream)     # the queue is full, or no seat: closed at once
            continue
        nursery.start_soon(partial(serve_connection, app, stream, peer=peer, local=local,
                                   admission=admission, seat=seat,
                                   ticket=admission.workers.ticket()))


def _addresses(stream: trio.SocketStream) -> tuple[tuple[str, int], tuple[str, int]]:
    peer = stream.socket.getpeername()
    local = stream.socket.getsockname()
    return (peer[0], peer[1]), (local[0], local[1])


__all__ = ["ErrorShaper", "HttpApp", "bind_listening_sockets", "configure_listening_socket",
           "serve_http", "watch_parent"]
