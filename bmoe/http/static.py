"""The UI's files, served from one folder at ``/``.

A path is taken apart into decoded segments and refused (404) if any segment is
empty, ``.``, ``..``, hidden (``.git``), or holds a slash, a backslash or a NUL;
what is left is resolved (links included) and served only if it is a regular file
still inside the folder. ``/`` serves ``index.html``.
"""

from __future__ import annotations

from pathlib import Path

import trio

from .errors import HTTPError
from .routes import path_segments
from .types import Request, Response

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".webmanifest": "application/manifest+json",
    ".txt": "text/plain; charset=utf-8",
    ".woff2": "font/woff2",
}


def content_type_for(path: Path) -> str:
    return CONTENT_TYPES.get(path.suffix.lower(), "application/octet-stream")


def _not_found() -> HTTPError:
    return HTTPError(404, "not_found", "No such file.")


def _safe_segment(segment: str) -> bool:
    return bool(segment) and not segment.startswith(".") and not any(c in segment for c in "/\\\0")


def resolve_static(root: Path, raw_path: str) -> Path:
    """The file ``raw_path`` names inside ``root``; HTTPError 404 for anything else."""
    segments = path_segments(raw_path)
    if segments == [""]:
        segments = ["index.html"]
    if not all(_safe_segment(s) for s in segments):
        raise _not_found()
    try:
        root = root.resolve()
        target = root.joinpath(*segments).resolve()
        inside = target.is_relative_to(root) and target.is_file()
    except (OSError, RuntimeError, ValueError):
        inside = False
    if not inside:
        raise _not_found()
    return target


class StaticFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    async def __call__(self, request: Request) -> Response:
        target = await trio.to_thread.run_sync(resolve_static, self.root, request.raw_path)
        try:
            body = await trio.Path(target).read_bytes()
        except OSError:
            raise _not_found() from None
        return Response(body=body, content_type=content_type_for(target),
                        headers=[("Cache-Control", "no-cache")])
