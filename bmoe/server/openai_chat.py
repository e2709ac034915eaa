"""`POST /v1/chat/completions`: the OpenAI wire format ↔ the engine-level turn."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..engine.errors import EngineError
from ..engine.turn import TurnRequest, TurnResult
from ..http.errors import HTTPError, invalid_request
from ..http.sse import sse_comment, sse_done, sse_event
from ..http.types import Request, Response, Send, StreamResponse
from . import chatreq
from .chatoutput import (TurnOutput, check_json_answer, engine_http_error, open_stream_turn,
                         require_model, run_whole)
from .state import ServerState
from .turnrunner import Batch, TurnRun
from .validate import field, object_list

ROLES = ("system", "developer", "user", "assistant", "tool")


# -- request ------------------------------------------------------------------

def _text_of_parts(parts: list[Any], where: str, images: list[str]) -> str:
    out = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise invalid_request(f"`{where}[{i}]` must be an object.")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid_request(f"`{where}[{i}].text` must be a string.")
            out.append(text)
        elif kind == "image_url":
            img = part.get("image_url")
            url = img.get("url") if isinstance(img, dict) else img
            chatreq.check_image_url(url, f"{where}[{i}].image_url.url")
            images.append(url)
        elif kind in ("input_audio", "file", "audio"):
            raise invalid_request(f"`{where}[{i}]`: {kind} parts are not supported; send text.")
        else:
            raise invalid_request(f"`{where}[{i}].type` {kind!r} is not a known content part.")
    return "".join(out)


def _content(msg: dict[str, Any], where: str, images: list[str]) -> str | None:
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_of_parts(content, f"{where}.content", images)
    raise invalid_request(f"`{where}.content` must be a string, an array of parts, or null.")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    calls = []
    for j, call in enumerate(object_list(value, f"{where}.tool_calls")):
        fn = field(call, "function", dict, where=f"{where}.tool_calls[{j}]")
        if fn is None:
            raise invalid_request(f"`{where}.tool_calls[{j}].function` is required.")
        name = field(fn, "name", str, "", where=f"{where}.tool_calls[{j}].function")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # the template shows what the model wrote
        elif not isinstance(args, dict):
            raise invalid_request(f"`{where}.tool_calls[{j}].function.arguments` must be a string.")
        cid = field(call, "id", str, "", where=f"{where}.tool_calls[{j}]")
        calls.append({"id": cid, "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls


def convert_messages(raw: Any) -> tuple[list[dict[str, Any]], int]:
    """Template-ready messages and the number of images they carry."""
    messages = object_list(raw, "messages")
    if not messages:
        raise invalid_request("`messages` must hold at least one message.")
    out: list[dict[str, Any]] = []
    images: list[str] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = field(msg, "role", str, where=where)
        if role not in ROLES:
            raise invalid_request(f"`{where}.role` must be one of {', '.join(ROLES)}.")
        m: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _content(msg, where, images if role == "user" else [])}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                m["tool_calls"] = _tool_calls(msg["tool_calls"], where)
            rc = field(msg, "reasoning_content", str, where=where)
            if rc:
                m["reasoning_content"] = rc
        if role == "tool":
            m["tool_call_id"] = field(msg, "tool_call_id", str, "", where=where)
        if m["content"] is None:
            m["content"] = ""
        out.append(m)
    if out[-1]["role"] not in ("user", "tool"):
        raise invalid_request("The last message must be from the user or a tool: the engine "
                              "does not continue an assistant answer.")
    return out, len(images)


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    tools = object_list(raw, "tools")
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid_request(f"`tools[{i}].type` must be \"function\": only function tools "
                                  "are supported.")
        fn = field(tool, "function", dict, where=f"tools[{i}]")
        if fn is None:
            raise invalid_request(f"`tools[{i}].function` is required.")
        name = field(fn, "name", str, where=f"tools[{i}].function")
        if not name:
            raise invalid_request(f"`tools[{i}].function.name` is required.")
        field(fn, "description", str, where=f"tools[{i}].function")
        params = chatreq.schema_object(fn.get("parameters"), f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {
            "name": name, "description": fn.get("description") or "",
            "parameters": params or {"type": "object", "properties": {}}}})
    return out or None


def tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("auto"|"none"|"required", the named function or None)."""
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid_request("`tool_choice` must be \"auto\", \"none\", \"required\" or a "
                                  "named function.")
        if raw == "required" and not tools:
            raise invalid_request("`tool_choice` \"required\" needs `tools`.")
        return raw, None
    if isinstance(raw, dict):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if raw.get("type") != "function" or not isinstance(name, str):
            raise invalid_request("`tool_choice` as an object must be "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise invalid_request(f"`tool_choice` names {name!r}, which is not among `tools`.")
        return "required", name
    raise invalid_request("`tool_choice` must be a string or an object.")


def build_turn(state: ServerState, body: dict[str, Any]) -> tuple[TurnRequest, str | None]:
    values, user_keys = state.config.values, state.config.user_keys
    messages, n_images = convert_messages(body.get("messages"))
    chatreq.count_images(n_images)
    if n_images:
        raise chatreq.no_vision()
    tools = convert_tools(body.get("tools"))
    choice, named = tool_choice(body.get("tool_choice"), tools)
    kwargs = field(body, "chat_template_kwargs", dict, {})
    think = chatreq.thinking(values, user_keys, think=body.get("think"),
                             enable_thinking=kwargs.get("enable_thinking"),
                             effort=body.get("reasoning_effort"))
    budget = chatreq.budget(body.get("max_completion_tokens", body.get("max_tokens")),
                            "max_tokens", values)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        chatreq.budget(body.get("max_tokens"), "max_tokens", values)
    schema = chatreq.response_format_schema(body.get("response_format"), body.get("json_schema"))
    if schema is not None and choice == "required":
        raise invalid_request("An output schema cannot be combined with a required tool call "
                              "(`tool_choice` \"required\" or a named function).")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise invalid_request("`n` above 1 is not supported: the server answers one choice.")
    field(body, "stream", bool, False)
    field(body, "stream_options", dict, None)
    gbnf = field(body, "grammar", str)
    if gbnf is not None and (schema is not None or choice == "required"):
        raise invalid_request("`grammar` cannot be combined with an output schema or a required "
                              "tool call.")
    grammar_tools = [t for t in tools if t["function"]["name"] == named] if named and tools else None
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, max_tokens=budget,
                      think=think, schema=schema, grammar=gbnf or None,
                      grammar_tools=grammar_tools,
                      parallel_calls=field(body, "parallel_tool_calls", bool, False))
    return req, named


# -- response -----------------------------------------------------------------

def _usage(result: TurnResult) -> dict[str, Any]:
    gen = result.generation
    return {"prompt_tokens": gen.n_prompt, "completion_tokens": len(gen.tokens),
            "total_tokens": gen.n_prompt + len(gen.tokens),
            "prompt_tokens_details": {"cached_tokens": gen.n_cached}}


def _finish(result: TurnResult, out: TurnOutput) -> str:
    finish = result.generation.finish
    if finish == "stop" and out.tool_calls():
        return "tool_calls"
    return finish


class ChatCompletion:
    def __init__(self, state: ServerState, req: TurnRequest) -> None:
        self.state = state
        self.req = req
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = ""

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    async def complete(self) -> Response:
        whole = await run_whole(self.state, self.req, engine_http_error)
        self.model, out, result, view = whole.model, whole.output, whole.result, whole.view
        calls = out.tool_calls_final(view)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": view.content if (view.content or not calls) else None}
        if view.reasoning:
            message["reasoning_content"] = view.reasoning
        if calls:
            message["tool_calls"] = calls
        body = self.envelope("chat.completion")
        body["choices"] = [{"index": 0, "message": message, "logprobs": None,
                            "finish_reason": _finish(result, out)}]
        body["usage"] = _usage(result)
        body["bmoe"] = {"summary": result.summary}
        return Response.json(body)

    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              extra: dict[str, Any] | None = None) -> bytes:
        body = self.envelope("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if extra:
            body.update(extra)
        return sse_event(None, body)

    async def stream(self, run: TurnRun, include_usage: bool, send: Send) -> None:
        try:
            await self._stream(run, include_usage, send)
        finally:
            run.close()

    async def _stream(self, run: TurnRun, include_usage: bool, send: Send) -> None:
        async def waiting() -> None:
            await send(sse_comment("waiting for a turn"))

        async def ping() -> None:
            await send(sse_comment("ping"))

        try:
            prepared = run.prepared or await run.start(on_wait=waiting)
            self.model = run.session.path.name if run.session else ""
            out = TurnOutput(prepared, self.req)
            await send(self.chunk({"role": "assistant", "content": ""}))

            async def on_batch(batch: Batch) -> None:
                for delta in out.feed_deltas("".join(ev.text for ev, _ in batch)):
                    await send(self._delta_chunk(delta))

            result = await run.run(on_batch, on_idle=ping)
            view = out.finish(result)
            for delta in out.final_deltas(view):
                await send(self._delta_chunk(delta))
            await check_json_answer(self.state, self.req, result, view)
        except (EngineError, HTTPError) as e:
            err = engine_http_error(e) if isinstance(e, EngineError) else e
            await send(sse_event(None, {"error": {"message": err.message, "code": err.code}}))
            await send(sse_done())
            return
        await send(self.chunk({}, _finish(result, out), {"bmoe": {"summary": result.summary}}))
        if include_usage:
            body = self.envelope("chat.completion.chunk")
            body["choices"] = []
            body["usage"] = _usage(result)
            await send(sse_event(None, body))
        await send(sse_done())

    def _delta_chunk(self, delta: dict[str, Any]) -> bytes:
        if delta.pop("reset", False):
            return self.chunk(delta, extra={"bmoe": {"reset": True}})
        return self.chunk(delta)


async def handle(state: ServerState, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    chatreq.refuse_lone_surrogates(body)
    req, _named = build_turn(state, body)
    require_model(state)
    chat = ChatCompletion(state, req)
    if not body.get("stream"):
        return await chat.complete()
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    run = await open_stream_turn(state, req, engine_http_error)
    return StreamResponse(produce=lambda send: chat.stream(run, include_usage, send),
                          on_close=run.close)
