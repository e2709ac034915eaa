"""The route table: every route of bmoe-server, in one place you can grep.

Each registration says what the route is (see `bmoe/http/routes.py`): who it answers
(`access`, the key by default), its errors' shape (`shape`, the server's own by
default) and whether it runs the model (`model`: with `--autoload` a request to it
loads the model first). The families below register their own the same way; the
packages above this one (the agent's routes) are passed in by the composition root
(`bmoe/server/main.py`'s `all_routes`).

An `EngineError` that leaves a handler is mapped here, once, for every route: into the
HTTP error of the route's own protocol (`shapes.engine_error`), which the error shaper
then writes in that protocol's shape.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

from ..engine import params
from ..engine.errors import EngineError
from ..http import limits
from ..http.errors import HTTPError, invalid_request
from ..http.routes import RouteTable
from ..http.sse import sse_comment, sse_event
from ..http.types import Handler, Request, Response, Send, StreamResponse
from ..runtime.config import OutsideModelsDir, confine_model_path
from ..runtime.state import Runtime
from . import backends_routes, decide, llama_compat, models_routes, plan_routes, shapes, wire, ws
from .protocols import anthropic, openai_chat, responses

EVENTS_PING_S = 15.0  # a `: ping` comment on every event stream this often


Register = Callable[[RouteTable, Any], None]   # a package's routes, added to the table


def build_routes(state: Runtime, extra: Iterable[Register] = ()) -> RouteTable:
    """The server's routes, and `extra`'s (registered the same way), each handler's
    `EngineError` mapped in its route's protocol."""
    table = RouteTable()
    streams = trio.CapacityLimiter(limits.EVENT_STREAMS)
    streams_full = HTTPError(503, "streams_full", f"{limits.EVENT_STREAMS} event streams are "
                             "already open; retry later.", headers=[("Retry-After", "2")])

    def add(method: str, path: str, fn: Any, **kw: Any) -> None:
        table.add(method, path, partial(fn, state), **kw)

    add("GET", "/api/info", info)
    add("POST", "/api/session/load", session_load)
    add("POST", "/api/session/unload", session_unload)
    add("POST", "/api/cancel", cancel)
    add("GET", "/api/params", get_params)
    add("GET", "/api/config", get_config)
    add("PUT", "/api/config", put_config)
    add("GET", "/api/events", events, limiter=streams, limiter_error=streams_full)
    add("GET", "/api/ws", ws.handle, limiter=streams, limiter_error=streams_full)
    add("POST", "/api/decide", decide.handle, model=True)
    add("GET", "/v1/models", llama_compat.models)   # one list: OpenAI's and llama-server's
    add("POST", "/v1/chat/completions", openai_chat.handle, model=True,
        body_limit=limits.BIG_BODY_LIMIT_BYTES)
    add("POST", "/v1/messages", anthropic.handle, shape=shapes.ANTHROPIC, model=True,
        body_limit=limits.BIG_BODY_LIMIT_BYTES)
    add("POST", "/v1/messages/count_tokens", anthropic.count_tokens, shape=shapes.ANTHROPIC,
        model=True, body_limit=limits.BIG_BODY_LIMIT_BYTES)
    for path in ("/v1/responses", "/responses"):        # llama-server serves both
        add("POST", path, responses.handle, shape=shapes.RESPONSES, model=True,
            body_limit=limits.BIG_BODY_LIMIT_BYTES)
    models_routes.register(table, state)
    plan_routes.register(table, state)
    backends_routes.register(table, state)   # backend packs and updates (local only)
    llama_compat.register(table, state)  # llama-server's routes (/completion, /props, ...)
    for register in extra:               # the agent's conversations, workspaces, providers
        register(table, state)
    return table.wrapped(lambda route: engine_errors(route.handler, route.shape))


def engine_errors(handler: Handler, shape: str | None) -> Handler:
    """`handler`, its engine failures as the HTTP errors of its route's protocol."""
    async def mapped(request: Request) -> Any:
        try:
            return await handler(request)
        except EngineError as e:
            raise shapes.engine_error(shape, e) from None
    return mapped


# -- state ------------------------------------------------------------------------

async def info(state: Runtime, request: Request) -> Response:
    return Response.json(state.info())


def model_dirs(state: Runtime) -> list[Path]:
    return [state.options.models_dir, *state.options.scan_dirs]


async def session_load(state: Runtime, request: Request) -> Response:
    model = wire.parse(wire.SessionLoadBody, request.json_object()).model
    if model:
        confined = state.options.models_only or not request.peer_is_loopback
        if confined:
            try:
                model = str(confine_model_path(model, model_dirs(state)))
            except OutsideModelsDir as e:
                raise HTTPError(403, "outside_models_dir", str(e)) from None
            except ValueError:  # a NUL or a lone surrogate: no file is named so
                raise invalid_request("`model` is not a usable file path.") from None
        _, rejected = await trio.to_thread.run_sync(partial(
            state.config.put, {"model": model}, [], peer_is_local=True,
            model_dirs=model_dirs(state)))
        if rejected:
            raise invalid_request(params.render(str(rejected.get("model"))))
        state.bus.publish("config", config_state(state))
    error = params.validate(state.config.values)
    if error:
        raise HTTPError(400, "invalid_config", params.render(error))
    path = state.config.values.get("model")
    if not path:
        raise invalid_request("No model is set: send {\"model\": \"/path/to/model.gguf\"}.")
    state.begin_load(str(path), state.config.values)
    return Response.json({"state": "loading", "model": str(path)}, status=202)


async def session_unload(state: Runtime, request: Request) -> Response:
    wire.parse(wire.EmptyBody, request.json_object())
    await state.unload()
    return Response.json({"state": state.state})


async def cancel(state: Runtime, request: Request) -> Response:
    wire.parse(wire.EmptyBody, request.json_object())
    return Response.json({"cancelled": state.cancel_current()})


# -- parameters and config ----------------------------------------------------------

async def get_params(state: Runtime, request: Request) -> Response:
    return Response.json(params.describe(server=True))


def config_state(state: Runtime) -> dict[str, Any]:
    return state.config.state(state.loaded_values)


async def get_config(state: Runtime, request: Request) -> Response:
    return Response.json(config_state(state))


async def put_config(state: Runtime, request: Request) -> Response:
    raw = request.json_object()
    body = wire.parse(wire.ConfigBody, raw)
    auto = raw.get("auto_plan")
    if auto is not None and not isinstance(auto, bool):
        raise invalid_request("`auto_plan` must be true or false.")
    if auto is not None:
        await trio.to_thread.run_sync(state.config.set_auto_plan, auto)
    put = partial(state.config.put, dict(body.values), list(body.reset),
                  peer_is_local=request.peer_is_loopback, model_dirs=model_dirs(state),
                  models_only=state.options.models_only, loaded_values=state.loaded_values)
    result, rejected = await trio.to_thread.run_sync(put)  # the settings file is fsynced
    result = dict(result)
    result["error"] = params.render(result.get("error", ""))
    result["rejected"] = {k: params.render(str(v)) for k, v in rejected.items()}
    state.bus.publish("config", config_state(state))
    return Response.json(result)


# -- live events --------------------------------------------------------------------

async def events(state: Runtime, request: Request) -> StreamResponse:
    sub = state.bus.subscribe(local=request.peer_is_loopback)

    async def produce(send: Send) -> None:
        try:
            await send(sse_event("state", state.info()))
            while True:
                with trio.move_on_after(EVENTS_PING_S) as idle:
                    try:
                        name, data = await sub.receive.receive()
                    except trio.EndOfChannel:
                        return  # dropped for falling behind: the client reconnects
                if idle.cancelled_caught:
                    await send(sse_comment("ping"))
                    continue
                await send(sse_event(name, data))
        finally:
            sub.close()

    return StreamResponse(produce=produce, headers=[("Cache-Control", "no-cache")],
                          on_close=sub.close)
