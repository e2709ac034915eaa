"""The route table `bmoe-server` serves, built as the server builds it, and the routes
the spec keeps to a client on this machine (its own register() flags each one)."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

from bmoe.http.routes import Access, RouteTable
from bmoe.server.main import all_routes as build_routes

# The spec's local-only routes that are built: models (delete, add from a link, folders),
# the agent's reach into this computer, llama-server's /shutdown, and the backend-pack
# and update routes.
LOCAL_ONLY = {
    ("DELETE", "/api/models/local/{name:path}"), ("POST", "/api/models/url"),
    ("PUT", "/api/models/folders"),
    ("POST", "/api/conversations/{id}/approval"), ("GET", "/api/conversations/{id}/file"),
    ("GET", "/api/workspaces"), ("POST", "/api/workspaces"), ("DELETE", "/api/workspaces/{id}"),
    ("GET", "/api/providers"), ("PUT", "/api/providers/{id}"),
    ("DELETE", "/api/providers/{id}"),
    ("GET", "/api/skills"), ("POST", "/api/skills"), ("GET", "/api/skills/{name}"),
    ("PUT", "/api/skills/{name}"),
    ("DELETE", "/api/skills/{name}"),
    ("GET", "/api/tasks"), ("POST", "/api/tasks"), ("GET", "/api/tasks/{id}"),
    ("PUT", "/api/tasks/{id}"), ("DELETE", "/api/tasks/{id}"), ("POST", "/api/tasks/{id}/run"),
    ("GET", "/api/clients"), ("POST", "/api/connect/{id}"), ("POST", "/api/mcp/{name}/restart"),
    ("POST", "/shutdown"),
    ("GET", "/api/backends"), ("POST", "/api/backends/{id}/install"), ("GET", "/api/update"),
    ("POST", "/api/update/download"),
}


@cache
def app_routes() -> RouteTable:
    """The real table. Its handlers are bound to the state and never called here."""
    return build_routes(SimpleNamespace())  # type: ignore[arg-type]


def flagged() -> set[tuple[str, str]]:
    """(method, pattern) of every route the real table registered `Access.LOCAL_ONLY`."""
    return {(r.method, r.pattern.text) for r in app_routes() if r.access is Access.LOCAL_ONLY}


def concrete(pattern: str) -> str:
    """A path the pattern matches: each parameter as `x1`."""
    return "/".join("x1" if part.startswith("{") else part for part in pattern.split("/"))
