"""The agent's routes (`docs/agent.md`, "Routes"): thin handlers over `AgentService`.

`add_flags` / `attach` / `run` / `register` are what `bmoe/server/main.py` and the
route table call, as for the models routes. Routes that reach this computer are
registered `Access.LOCAL_ONLY` (their rows in `ROUTES`), which the access checks refuse
to the network; the rules that depend on the conversation (one
with a workspace or a provider is invisible to the network) are checked here, and
every route that reaches files, processes or keys checks the peer again itself.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio
from pydantic import StrictBool, StrictStr

from ..http.access import is_loopback_binding
from ..http.errors import HTTPError, invalid_request
from ..http.routes import Access, RouteTable
from ..http.types import Request, Response
from ..runtime.state import Runtime
from ..server import wire
from . import clients, preview, skills, tasks
from . import conversation as cv
from .paths import OutsideWorkspace, ToolError, resolve
from .providers import check_entry
from .service import AgentService, busy, folder_of, not_found

Handler = Callable[[AgentService, Request], Awaitable[Response]]
TEXT_MAX_CHARS = 1_000_000        # a message's text


class NewConversation(wire.Wire):
    title: StrictStr | None = None
    mode: StrictStr | None = None
    workspace: StrictStr | None = None
    route: StrictStr | None = None
    skills: list[StrictStr] | None = None


class MessageBody(wire.Wire):
    text: StrictStr


class ApprovalBody(wire.Wire):
    item: StrictStr
    decision: StrictStr
    reason: StrictStr | None = None


class WorkspaceBody(wire.Wire):
    path: StrictStr


class SkillBody(wire.Wire):
    name: StrictStr
    description: StrictStr
    body: StrictStr = ""
    files: dict[StrictStr, StrictStr] | None = None


class SkillChange(wire.Wire):
    description: StrictStr | None = None
    body: StrictStr | None = None


class TaskBody(wire.Wire):
    title: StrictStr | None = None
    prompt: StrictStr | None = None
    workspace: StrictStr | None = None
    mode: StrictStr | None = None
    route: StrictStr | None = None
    schedule: dict[str, Any] | None = None
    enabled: StrictBool | None = None


class ProviderBody(wire.Wire):
    kind: StrictStr
    base_url: StrictStr
    model: StrictStr
    api_key: StrictStr | None = None


def local_only() -> HTTPError:
    return HTTPError(403, "local_only", "This route answers a client on this machine only.")


def require_local(request: Request) -> None:
    if not request.peer_is_loopback:
        raise local_only()


# -- wiring ------------------------------------------------------------------------------

def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-only", action="store_true",
                   help="conversations are plain chat: no agent tools, no workspaces")
    p.add_argument("--preview-network", choices=preview.CHOICES, default="auto",
                   help="whether a previewed workspace page may load from https "
                        "(auto: on when listening on loopback only)")
    p.add_argument("--skills-dir", type=Path, default=None, metavar="DIR",
                   help="the folder of bundled skills (default: the ones shipped with bmoe)")
    p.add_argument("--mcp-servers-config", type=Path, default=None, metavar="PATH",
                   help="the MCP servers the agent may use, in the {\"mcpServers\": ...} "
                        "format (default: <data>/mcp.json)")


def attach(state: Runtime, args: argparse.Namespace) -> None:
    state.agent = AgentService(state, state.options.data_dir,
                               chat_only=bool(getattr(args, "chat_only", False)),
                               preview_network=getattr(args, "preview_network", "auto"),
                               skills_dir=getattr(args, "skills_dir", None),
                               mcp_config=getattr(args, "mcp_servers_config", None))


async def run(state: Runtime, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    await state.agent.run(task_status=task_status)


def register(table: RouteTable, state: Runtime) -> None:
    for method, pattern, fn, access in ROUTES:
        table.add(method, pattern, _bound(fn, state), access=access)


def _bound(fn: Handler, state: Runtime) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        svc = state.agent
        if svc is None:
            raise HTTPError(503, "unavailable", "The agent is not running.")
        return await fn(svc, request)
    handler.__name__ = fn.__name__
    return handler


# -- what the agent can do ------------------------------------------------------------

async def get_agent(svc: AgentService, request: Request) -> Response:
    has_tools = not svc.chat_only
    agents = [{"id": "bmoe", "name": "bmoe's agent", "builtin": True, "installed": True}]
    others = await trio.to_thread.run_sync(clients.catalog)
    agents += [{"id": c["id"], "name": c["name"], "builtin": False, "program": c["program"],
                "installed": shutil.which(c["program"]) is not None} for c in others]
    mcp: list[dict[str, Any]] = []
    if has_tools and request.peer_is_loopback:
        svc.mcp.want_all()                 # a server starts when first asked about
        mcp = svc.mcp.listing()
    return Response.json({"tools": has_tools,
                          "commands": has_tools and shutil.which("sh") is not None,
                          "agents": agents, "mcp": mcp})


async def restart_mcp(svc: AgentService, request: Request) -> Response:
    """Start the MCP server again now (a failed one without waiting out its back-off)."""
    require_local(request)
    request.json()
    server = svc.mcp.servers.get(request.path_params["name"])
    if server is None or svc.chat_only:
        raise not_found("MCP server")
    server.restart()
    await trio.lowlevel.checkpoint()
    return Response.json(server.entry())


# -- conversations ------------------------------------------------------------------------

def _conversation(svc: AgentService, request: Request) -> cv.Conv:
    """The path's conversation; a private one is not found from the network."""
    conv = svc.get(request.path_params["id"])
    if cv.is_private(conv) and not request.peer_is_loopback:
        raise local_only()
    return conv


def _whole(svc: AgentService, conv: cv.Conv) -> dict[str, Any]:
    out = dict(conv)
    w = svc.workspaces.get(conv.get("workspace") or "")
    out["workspace"] = {"id": w["id"], "path": w["path"]} if w else None
    out.setdefault("skills", [])
    return out


async def list_conversations(svc: AgentService, request: Request) -> Response:
    local = request.peer_is_loopback
    convs = [cv.listing_entry(c) for c in svc.convs.values() if local or not cv.is_private(c)]
    convs.sort(key=lambda c: c["updated"], reverse=True)
    return Response.json({"conversations": convs})


def _settings(svc: AgentService, request: Request, body: NewConversation) -> dict[str, Any]:
    """The fields a create or a change sets, checked against who asks."""
    out: dict[str, Any] = {}
    if body.title is not None:
        out["title"] = body.title.strip()[:cv.TITLE_MAX] or "New conversation"
    if body.mode is not None:
        if body.mode not in cv.MODES:
            raise invalid_request("`mode` must be \"read\", \"ask\" or \"full\".")
        out["mode"] = body.mode
    if body.workspace is not None:
        if body.workspace and svc.chat_only:
            raise HTTPError(409, "chat_only", "This server runs conversations as plain chat: "
                            "it has no workspaces.")
        if body.workspace and body.workspace not in svc.workspaces:
            raise invalid_request("`workspace` names no workspace; add it first.")
        out["workspace"] = body.workspace or None
    if body.route is not None:
        if body.route != "local" and body.route not in svc.providers.providers:
            raise invalid_request("`route` must be \"local\" or a saved provider's id.")
        out["route"] = body.route
    if body.skills is not None:
        if len(body.skills) > skills.SKILLS_MAX:
            raise invalid_request(f"`skills` names at most {skills.SKILLS_MAX} skills.")
        out["skills"] = list(dict.fromkeys(body.skills))
    if not request.peer_is_loopback and (out.get("workspace") or out.get("mode") == "full"
                                         or out.get("route", "local") != "local"
                                         or out.get("skills")):
        raise local_only()
    return out


async def create_conversation(svc: AgentService, request: Request) -> Response:
    body = wire.parse(NewConversation, request.json_object())
    s = _settings(svc, request, body)
    await _check_skills(svc, s)
    conv = await svc.create(s.get("title", "New conversation"), s.get("mode", "ask"),
                            s.get("workspace"), s.get("route", "local"))
    if s.get("skills"):
        conv["skills"] = s["skills"]
        await svc.save(conv)
    return Response.json(_whole(svc, conv), status=201)


async def _check_skills(svc: AgentService, settings: dict[str, Any]) -> None:
    names = settings.get("skills") or []
    if names:
        known = await trio.to_thread.run_sync(svc.skills.scan)
        missing = [n for n in names if n not in known]
        if missing:
            raise invalid_request(f"`skills` names no skill called {missing[0]}.")


async def get_conversation(svc: AgentService, request: Request) -> Response:
    return Response.json(_whole(svc, _conversation(svc, request)))


async def change_conversation(svc: AgentService, request: Request) -> Response:
    conv = _conversation(svc, request)
    s = _settings(svc, request, wire.parse(NewConversation, request.json_object()))
    await _check_skills(svc, s)
    moves = any(k in s and s[k] != conv[k] for k in ("workspace", "route"))
    if moves and svc.running(conv["id"]):
        raise busy()
    conv.update(s)
    svc.touch(conv)
    await svc.save(conv)
    return Response.json(_whole(svc, conv))


async def delete_conversation(svc: AgentService, request: Request) -> Response:
    request.json()
    await svc.delete(_conversation(svc, request))
    return Response.json({"deleted": True})


def _text(body: MessageBody) -> str:
    if not body.text.strip():
        raise invalid_request("`text` is empty.")
    if len(body.text) > TEXT_MAX_CHARS:
        raise invalid_request(f"`text` is longer than {TEXT_MAX_CHARS} characters.")
    return body.text


async def post_message(svc: AgentService, request: Request) -> Response:
    conv = _conversation(svc, request)
    body = request.json_object()
    if body.get("images"):
        raise HTTPError(400, "no_vision", "Messages here carry text only.")
    item = await svc.post_message(conv, _text(wire.parse(MessageBody, body)))
    return Response.json({"item": item}, status=202)


async def edit_message(svc: AgentService, request: Request) -> Response:
    conv = _conversation(svc, request)
    text = _text(wire.parse(MessageBody, request.json_object()))
    item = await svc.edit_message(conv, request.path_params["item"], text)
    return Response.json({"item": item}, status=202)


async def stop(svc: AgentService, request: Request) -> Response:
    request.json()
    return Response.json({"stopped": await svc.stop(_conversation(svc, request))})


async def approval(svc: AgentService, request: Request) -> Response:
    require_local(request)
    conv = _conversation(svc, request)
    body = wire.parse(ApprovalBody, request.json_object())
    if body.decision not in ("once", "always", "deny"):
        raise invalid_request("`decision` must be \"once\", \"always\" or \"deny\".")
    item = svc.approve(conv, body.item, body.decision, (body.reason or "").strip()[:2000])
    return Response.json({"item": item})


# -- the preview ------------------------------------------------------------------------

async def file_preview(svc: AgentService, request: Request) -> Response:
    require_local(request)
    conv = _conversation(svc, request)
    root = svc.workspace_root(conv)
    if root is None:
        raise not_found("workspace for this conversation")
    name = request.query.get("path", "")
    try:
        path = resolve(root, name)
    except OutsideWorkspace as e:
        raise HTTPError(403, "outside_workspace", e.message) from None
    except ToolError as e:
        raise invalid_request(e.message) from None
    data = await trio.to_thread.run_sync(_read_preview, path)
    loopback = is_loopback_binding(svc.state.options.host)
    return Response(status=200, body=data, content_type=preview.content_type(path.suffix),
                    headers=preview.headers(svc.preview_network, loopback))


def _read_preview(path: Path) -> bytes:
    if not path.is_file():
        raise not_found("file")
    if path.stat().st_size > preview.PREVIEW_MAX_BYTES:
        raise HTTPError(413, "too_large", "The file is larger than 16 MiB: it is not previewed.")
    with open(path, "rb") as f:
        data = f.read(preview.PREVIEW_MAX_BYTES + 1)
    if len(data) > preview.PREVIEW_MAX_BYTES:
        raise HTTPError(413, "too_large", "The file is larger than 16 MiB: it is not previewed.")
    return data


# -- workspaces -----------------------------------------------------------------------

def _no_workspaces(svc: AgentService) -> None:
    if svc.chat_only:
        raise HTTPError(409, "chat_only", "This server runs conversations as plain chat: it "
                        "has no workspaces.")


async def list_workspaces(svc: AgentService, request: Request) -> Response:
    require_local(request)
    return Response.json({"workspaces": list(svc.workspaces.values())})


async def add_workspace(svc: AgentService, request: Request) -> Response:
    require_local(request)
    _no_workspaces(svc)
    body = wire.parse(WorkspaceBody, request.json_object())
    real = await trio.to_thread.run_sync(folder_of, body.path)
    for w in svc.workspaces.values():
        if w["path"] == str(real):
            return Response.json(w, status=201)
    w = {"id": cv.new_id("w_"), "path": str(real), "name": real.name or str(real)}
    svc.workspaces[w["id"]] = w
    await svc.save_workspaces()
    return Response.json(w, status=201)


async def delete_workspace(svc: AgentService, request: Request) -> Response:
    require_local(request)
    request.json()
    wid = request.path_params["id"]
    if wid not in svc.workspaces:
        raise not_found("workspace")
    if any(svc.running(c["id"]) for c in svc.convs.values() if c.get("workspace") == wid):
        raise busy()
    del svc.workspaces[wid]
    await svc.save_workspaces()
    return Response.json({"deleted": True})


# -- providers ----------------------------------------------------------------------------

async def list_providers(svc: AgentService, request: Request) -> Response:
    require_local(request)
    listing = await trio.to_thread.run_sync(svc.providers.listing)
    return Response.json({"providers": listing})


async def put_provider(svc: AgentService, request: Request) -> Response:
    require_local(request)
    body = request.json_object()
    parsed = wire.parse(ProviderBody, body)
    try:
        entry = check_entry(request.path_params["id"], body)
    except ValueError as e:
        raise invalid_request(str(e)) from None
    saved = await trio.to_thread.run_sync(svc.providers.save, entry["id"], entry, parsed.api_key)
    return Response.json(saved)


async def delete_provider(svc: AgentService, request: Request) -> Response:
    require_local(request)
    request.json()
    pid = request.path_params["id"]
    if pid not in svc.providers.providers:
        raise not_found("provider")
    if any(svc.running(c["id"]) for c in svc.convs.values() if c.get("route") == pid):
        raise busy()
    await trio.to_thread.run_sync(svc.providers.delete, pid)
    return Response.json({"deleted": True})


# -- other coding agents (clients) --------------------------------------------------------

_connect_lock = trio.Lock()      # one settings rewrite at a time


async def list_clients(svc: AgentService, request: Request) -> Response:
    require_local(request)
    return Response.json({"clients": await trio.to_thread.run_sync(clients.listing)})


async def connect_client(svc: AgentService, request: Request) -> Response:
    """Write the client's own settings so it uses this server (`409 conflict` when the
    file is one we will not rewrite: it is left byte for byte as it was)."""
    require_local(request)
    request.json()
    entry = clients.find(request.path_params["id"])
    if entry is None:
        raise not_found("client")
    info = svc.state.model_info()
    if info is None:
        raise HTTPError(409, "conflict", "No model is loaded: load one first, so the client "
                        "has a model to use.")
    target = clients.Target(base_url=_base_url(request), model=str(info["name"]),
                            n_ctx=int(info["n_ctx"]), key=_request_key(request))
    async with _connect_lock:
        try:
            result = await trio.to_thread.run_sync(clients.connect, entry, target)
        except clients.Unmergeable as e:
            raise HTTPError(409, "conflict", f"{e.message} The file was left as it is: fix it "
                            "or move it away, then connect again.") from None
        except OSError:
            raise HTTPError(409, "conflict", f"{entry['name']}'s settings could not be "
                            "written here (a folder that cannot be created?).") from None
    return Response.json(result)


def _base_url(request: Request) -> str:
    host, port = request.local[0], request.local[1]
    if host.startswith("::ffff:"):
        host = host[7:]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _request_key(request: Request) -> str | None:
    """The server's key, as the request carried it (the access check has compared it)."""
    auth = request.header("authorization") or ""
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return (request.header("x-api-key") or "").strip() or None


# -- skills --------------------------------------------------------------------------------

def _skill_error(e: skills.SkillError) -> HTTPError:
    status = {"exists": 409, "not_found": 404}.get(e.code, 400)
    return HTTPError(status, e.code, e.message)


async def list_skills(svc: AgentService, request: Request) -> Response:
    require_local(request)
    return Response.json({"skills": await trio.to_thread.run_sync(svc.skills.listing)})


async def get_skill(svc: AgentService, request: Request) -> Response:
    require_local(request)
    try:
        detail = await trio.to_thread.run_sync(svc.skills.detail, request.path_params["name"])
    except skills.SkillError as e:
        raise _skill_error(e) from None
    except OSError:
        raise HTTPError(404, "not_found", "That skill's SKILL.md cannot be read.") from None
    return Response.json(detail)


async def create_skill(svc: AgentService, request: Request) -> Response:
    require_local(request)
    body = wire.parse(SkillBody, request.json_object())
    try:
        made = await trio.to_thread.run_sync(svc.skills.create, body.name, body.description,
                                             body.body, body.files)
    except skills.SkillError as e:
        raise _skill_error(e) from None
    return Response.json(made.entry(), status=201)


async def change_skill(svc: AgentService, request: Request) -> Response:
    require_local(request)
    body = wire.parse(SkillChange, request.json_object())
    try:
        made = await trio.to_thread.run_sync(svc.skills.update, request.path_params["name"],
                                             body.description, body.body)
    except skills.SkillError as e:
        raise _skill_error(e) from None
    return Response.json(made.entry())


async def delete_skill(svc: AgentService, request: Request) -> Response:
    require_local(request)
    request.json()
    try:
        await trio.to_thread.run_sync(svc.skills.delete, request.path_params["name"])
    except skills.SkillError as e:
        raise _skill_error(e) from None
    return Response.json({"deleted": True})


# -- tasks ---------------------------------------------------------------------------------

def _task_fields(svc: AgentService, raw: dict[str, Any], *, new: bool) -> dict[str, Any]:
    body = wire.parse(TaskBody, raw)
    out: dict[str, Any] = {}
    if body.title is not None:
        out["title"] = body.title.strip()[:cv.TITLE_MAX] or "Task"
    if body.prompt is not None or new:
        prompt = (body.prompt or "").strip()
        if not prompt or len(prompt) > tasks.PROMPT_MAX_CHARS:
            raise invalid_request(f"`prompt` must be 1 to {tasks.PROMPT_MAX_CHARS} characters.")
        out["prompt"] = prompt
    if body.workspace is not None or new:
        if body.workspace not in svc.workspaces:
            raise invalid_request("`workspace` must name a workspace; add it first.")
        out["workspace"] = body.workspace
    if body.mode is not None:
        if body.mode not in cv.MODES:
            raise invalid_request("`mode` must be \"read\", \"ask\" or \"full\".")
        out["mode"] = body.mode
    if body.route is not None:
        if body.route != "local" and body.route not in svc.providers.providers:
            raise invalid_request("`route` must be \"local\" or a saved provider's id.")
        out["route"] = body.route
    if "schedule" in raw:
        try:
            out["schedule"] = tasks.check_schedule(raw["schedule"])
        except tasks.ScheduleError as e:
            raise invalid_request(str(e)) from None
    if body.enabled is not None:
        out["enabled"] = body.enabled
    return out


def _task(svc: AgentService, request: Request) -> dict[str, Any]:
    task = svc.tasks.tasks.get(request.path_params["id"])
    if task is None:
        raise not_found("task")
    return task


async def list_tasks(svc: AgentService, request: Request) -> Response:
    require_local(request)
    listed = sorted(svc.tasks.tasks.values(), key=lambda t: t["created"], reverse=True)
    return Response.json({"tasks": listed})


async def create_task(svc: AgentService, request: Request) -> Response:
    require_local(request)
    if svc.chat_only:
        raise HTTPError(409, "chat_only", "This server runs conversations as plain chat: it "
                        "has no tasks.")
    raw = request.json_object()
    fields = _task_fields(svc, raw, new=True)
    fields.setdefault("schedule", None)
    task = svc.tasks.new(fields)
    await svc.tasks.save()
    svc.tasks.publish(task)
    return Response.json(task, status=201)


async def get_task(svc: AgentService, request: Request) -> Response:
    require_local(request)
    return Response.json(_task(svc, request))


async def change_task(svc: AgentService, request: Request) -> Response:
    require_local(request)
    task = _task(svc, request)
    fields = _task_fields(svc, request.json_object(), new=False)
    svc.tasks.apply(task, fields)
    await svc.tasks.save()
    svc.tasks.publish(task)
    return Response.json(task)


async def delete_task(svc: AgentService, request: Request) -> Response:
    require_local(request)
    request.json()
    task = _task(svc, request)
    svc.tasks.tasks.pop(task["id"], None)
    await svc.tasks.save()
    svc.tasks.publish(task, deleted=True)
    return Response.json({"deleted": True})


async def run_task(svc: AgentService, request: Request) -> Response:
    require_local(request)
    request.json()
    task = _task(svc, request)
    conv = await svc.tasks.fire(task)
    await svc.tasks.save()
    return Response.json({"task": task, "conversation": conv["id"] if conv else None},
                         status=202)


# LOCAL: the route reaches this computer's files, processes or secrets (the spec's list)
KEY, LOCAL = Access.KEY, Access.LOCAL_ONLY

ROUTES: list[tuple[str, str, Handler, Access]] = [
    ("GET", "/api/agent", get_agent, KEY),
    ("GET", "/api/conversations", list_conversations, KEY),
    ("POST", "/api/conversations", create_conversation, KEY),
    ("GET", "/api/conversations/{id}", get_conversation, KEY),
    ("PUT", "/api/conversations/{id}", change_conversation, KEY),
    ("DELETE", "/api/conversations/{id}", delete_conversation, KEY),
    ("POST", "/api/conversations/{id}/messages", post_message, KEY),
    ("PUT", "/api/conversations/{id}/items/{item}", edit_message, KEY),
    ("POST", "/api/conversations/{id}/stop", stop, KEY),
    ("POST", "/api/conversations/{id}/approval", approval, LOCAL),
    ("GET", "/api/conversations/{id}/file", file_preview, LOCAL),
    ("GET", "/api/workspaces", list_workspaces, LOCAL),
    ("POST", "/api/workspaces", add_workspace, LOCAL),
    ("DELETE", "/api/workspaces/{id}", delete_workspace, LOCAL),
    ("GET", "/api/providers", list_providers, LOCAL),
    ("PUT", "/api/providers/{id}", put_provider, LOCAL),
    ("DELETE", "/api/providers/{id}", delete_provider, LOCAL),
    ("GET", "/api/skills", list_skills, LOCAL),
    ("POST", "/api/skills", create_skill, LOCAL),
    ("GET", "/api/skills/{name}", get_skill, LOCAL),
    ("PUT", "/api/skills/{name}", change_skill, LOCAL),
    ("DELETE", "/api/skills/{name}", delete_skill, LOCAL),
    ("GET", "/api/tasks", list_tasks, LOCAL),
    ("POST", "/api/tasks", create_task, LOCAL),
    ("GET", "/api/tasks/{id}", get_task, LOCAL),
    ("PUT", "/api/tasks/{id}", change_task, LOCAL),
    ("DELETE", "/api/tasks/{id}", delete_task, LOCAL),
    ("POST", "/api/tasks/{id}/run", run_task, LOCAL),
    ("GET", "/api/clients", list_clients, LOCAL),
    ("POST", "/api/connect/{id}", connect_client, LOCAL),
    ("POST", "/api/mcp/{name}/restart", restart_mcp, LOCAL),
]
