"""The routes of the spec's ``## Models`` section: thin handlers over ``ModelsService``.

``register(table, state)`` adds them to the route table, deleting a model, adding one
from a link and choosing the folders as ``Access.LOCAL_ONLY`` (their rows in ``ROUTES``):
the access checks keep them to a client on this machine. A ``ModelsError`` the
service raises becomes the ``HTTPError`` with its status, code and sentence.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from ..http.errors import HTTPError
from ..http.routes import Access, RouteTable
from ..http.types import Request, Response
from ..models.errors import ModelsError
from ..models.service import ModelsService
from ..runtime.state import Runtime

Handler = Callable[[ModelsService, Request], Awaitable[Response]]


def register(table: RouteTable, state: Runtime) -> None:
    """Add the models routes; the service is ``state.models`` (set at start)."""
    for method, pattern, fn, access in ROUTES:
        table.add(method, pattern, _bound(fn, state), access=access)


def _bound(fn: Handler, state: Runtime) -> Callable[[Request], Awaitable[Response]]:
    @wraps(fn)
    async def handler(request: Request) -> Response:
        service = state.models
        if service is None:
            raise HTTPError(503, "unavailable", "The models service is not running.")
        try:
            return await fn(service, request)
        except ModelsError as e:
            raise HTTPError(e.status, e.code, e.message) from None
    return handler


async def get_models(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.listing_async())


async def put_folders(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.put_folders(request.json_object()))


async def download(m: ModelsService, request: Request) -> Response:
    body = request.json_object()
    return Response.json(await m.start_download(body.get("id"), body.get("token")), status=202)


async def cancel_download(m: ModelsService, request: Request) -> Response:
    request.json()
    return Response.json(m.cancel_download(request.path_params["id"]))


async def delete_partial(m: ModelsService, request: Request) -> Response:
    request.json()
    return Response.json(m.delete_partial(request.path_params["id"]))


async def delete_local(m: ModelsService, request: Request) -> Response:
    request.json()
    return Response.json(await m.delete_local(request.path_params["name"]))


async def add_url(m: ModelsService, request: Request) -> Response:
    body = request.json_object()
    return Response.json(await m.add_url(body.get("url")), status=201)


async def hf_search(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.hf_search(request.json_object()))


async def hf_models(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.hf_models(request.json_object()))


async def hf_inspect(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.hf_inspect(request.json_object()))


async def hf_add(m: ModelsService, request: Request) -> Response:
    return Response.json(await m.hf_add(request.json_object()), status=201)


async def forget_entry(m: ModelsService, request: Request) -> Response:
    request.json()
    return Response.json(m.forget_entry(request.path_params["id"]))


KEY, LOCAL = Access.KEY, Access.LOCAL_ONLY      # LOCAL: they change files or fetch a link

ROUTES: list[tuple[str, str, Handler, Access]] = [
    ("GET", "/api/models", get_models, KEY),
    ("PUT", "/api/models/folders", put_folders, LOCAL),
    ("POST", "/api/models/download", download, KEY),
    ("DELETE", "/api/models/download/{id:path}", cancel_download, KEY),
    ("DELETE", "/api/models/partial/{id:path}", delete_partial, KEY),
    ("DELETE", "/api/models/local/{name:path}", delete_local, LOCAL),
    ("POST", "/api/models/url", add_url, LOCAL),
    ("POST", "/api/hf/search", hf_search, KEY),
    ("POST", "/api/hf/models", hf_models, KEY),
    ("POST", "/api/hf/inspect", hf_inspect, KEY),
    ("POST", "/api/hf/add", hf_add, KEY),
    ("DELETE", "/api/hf/entry/{id:path}", forget_entry, KEY),
]


# -- start-up --------------------------------------------------------------------------

def add_flags(p: Any) -> None:
    """The command line's models options."""
    p.add_argument("--hf-endpoint", default="https://huggingface.co", metavar="URL",
                   help="the Hugging Face site or mirror models are searched and fetched from "
                        "(default https://huggingface.co)")
    p.add_argument("--hf-ca-file", default="", metavar="PATH",
                   help="one more CA bundle to trust for downloads and the site (a private "
                        "mirror's, or a test's own): https stays required")
    p.add_argument("--download-stall-s", type=int, default=30, metavar="S",
                   help="a download receiving nothing for this long is retried (default 30)")


def check_flags(args: Any) -> None:
    u = urlsplit(args.hf_endpoint)
    if u.scheme not in ("https", "http") or not u.hostname or u.username or u.password \
            or u.query or u.fragment:
        raise SystemExit(f"bmoe-server: --hf-endpoint {args.hf_endpoint!r} is not an https "
                         "URL of a site (no user name, query or fragment).")
    if args.hf_ca_file and not os.path.isfile(args.hf_ca_file):
        raise SystemExit(f"bmoe-server: --hf-ca-file {args.hf_ca_file} is not a file.")
    if args.download_stall_s < 1:
        raise SystemExit("bmoe-server: --download-stall-s must be at least 1.")


def attach(state: Runtime, args: Any) -> ModelsService:
    """Create the models service as ``state.models``; run it with ``nursery.start``."""
    check_flags(args)

    def held_paths() -> list[str]:
        held = []
        session = state.session
        if session is not None:
            held.append(str(session.path))
        if state.state.loading:                 # a planning load too
            held.append(str(state.config.values.get("model") or ""))
        return held

    def held_bytes() -> int:
        planner = state.planner
        return int(planner.held_now()) if planner is not None else 0

    service = ModelsService.create(
        state.options, state.config, state.bus,
        models_dir_at_launch=getattr(args, "models_dir", None) is not None,
        endpoint=args.hf_endpoint.rstrip("/"), ca_file=args.hf_ca_file,
        stall_s=args.download_stall_s, held_paths=held_paths, held_bytes=held_bytes)
    state.models = service
    return service


async def run(state: Runtime, *, task_status: Any) -> None:
    """Run ``state.models`` (its download jobs) in the server's nursery."""
    if state.models is None:
        raise RuntimeError("models_routes.attach() was not called")
    await state.models.run(task_status=task_status)
