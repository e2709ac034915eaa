"""The routes of the spec's "Backend packs and updates": thin handlers over
``bmoe/backends/service.py``'s ``BackendsService``.

Every one is ``Access.LOCAL_ONLY`` (their rows in ``ROUTES``): they read the network on
the person's behalf and install software. ``attach`` builds the service at start and
loads the installed packs into ggml first, before any model is loaded (a pack that does
not load is a line on stderr and an entry of ``GET /api/backends``'s ``load``). Their
events (``backend``, ``update``) go to clients on this machine only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import StrictBool

from ..backends import feed as feedmod
from ..backends import registry
from ..backends.errors import BackendsError
from ..backends.service import BackendsService
from ..http.errors import HTTPError, invalid_request
from ..http.routes import Access, RouteTable
from ..http.types import Request, Response
from ..models.curl import CurlConfig
from ..runtime.state import Runtime
from . import wire

Handler = Callable[[BackendsService, Request], Awaitable[Response]]


class InstallBody(wire.Wire):
    force: StrictBool = False


def register(table: RouteTable, state: Runtime) -> None:
    for method, pattern, fn in ROUTES:
        table.add(method, pattern, _bound(fn, state), access=Access.LOCAL_ONLY)


def _bound(fn: Handler, state: Runtime) -> Callable[[Request], Awaitable[Response]]:
    @wraps(fn)
    async def handler(request: Request) -> Response:
        service = state.backends
        if service is None:
            raise HTTPError(503, "unavailable", "The backends service is not running.")
        try:
            return await fn(service, request)
        except BackendsError as e:
            raise HTTPError(e.status, e.code, e.message) from None
    return handler


async def get_backends(b: BackendsService, request: Request) -> Response:
    refresh = request.query.get("refresh", "")
    if refresh not in ("", "0", "1", "true", "false"):
        raise invalid_request("`refresh` is 1 (read the feed first) or 0.")
    return Response.json(await b.listing(refresh in ("1", "true")))


async def install(b: BackendsService, request: Request) -> Response:
    body = wire.parse(InstallBody, request.json_object())
    return Response.json(await b.install(request.path_params["id"], body.force))


async def get_update(b: BackendsService, request: Request) -> Response:
    return Response.json(await b.update())


async def download_update(b: BackendsService, request: Request) -> Response:
    wire.parse(wire.EmptyBody, request.json_object())
    return Response.json(await b.download_update())


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/api/backends", get_backends),
    ("POST", "/api/backends/{id}/install", install),
    ("GET", "/api/update", get_update),
    ("POST", "/api/update/download", download_update),
]


# -- start-up --------------------------------------------------------------------------

def add_flags(p: Any) -> None:
    p.add_argument("--feed-url", default="", metavar="URL",
                   help="read the release feed (backend packs, updates) from this https "
                        "address instead of the release's, for testing")
    p.add_argument("--feed-key-file", type=Path, default=None, metavar="PATH",
                   help="check the feed with this Ed25519 public key (base64 or PEM) instead "
                        "of the release's, for testing")


def check_flags(args: Any) -> None:
    """Refuse a --feed-url or --feed-key-file that cannot be used (SystemExit with the
    reason): called before the server starts anything."""
    if args.feed_url:
        u = urlsplit(args.feed_url)
        if u.scheme != "https" or not u.hostname or u.username or u.password:
            raise SystemExit(f"bmoe-server: --feed-url {args.feed_url!r} is not an https URL "
                             "(no user name).")
    feed_key(args)


def feed_key(args: Any) -> Any:
    """The key the feed is checked with: --feed-key-file's, else the release's (or None)."""
    if args.feed_key_file is None:
        return feedmod.built_in_key()
    try:
        text = args.feed_key_file.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise SystemExit(f"bmoe-server: cannot read the feed key {args.feed_key_file}: "
                         f"{e.strerror or 'it could not be read'}.") from None
    try:
        return feedmod.parse_key(text)
    except ValueError as e:
        raise SystemExit(f"bmoe-server: the feed key {args.feed_key_file} is not usable: "
                         f"{e}.") from None


def attach(state: Runtime, args: Any) -> BackendsService:
    """Load the installed packs into ggml, then create ``state.backends`` (``check_flags``
    ran first)."""
    key = feed_key(args)
    data_dir = state.options.data_dir
    loads = registry.load_installed(data_dir / "backends")
    service = BackendsService(
        data_dir=data_dir,
        publish=lambda name, ev: state.bus.publish(name, ev, local_only=True),
        curl=CurlConfig(ca_file=args.hf_ca_file, stall_s=args.download_stall_s),
        key=key, url=args.feed_url or feedmod.FEED_URL,
        loads=loads)    # `registered` is read when first asked (registry.registered_at_start)
    state.backends = service
    return service
