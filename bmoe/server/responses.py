"""`POST /v1/responses`: the OpenAI Responses API (stateless) ↔ the engine-level turn.

Theory of operation
-------------------
Every request carries its whole conversation in `input`, as Codex sends it with
`store: false`; nothing is stored, so the fields that name stored state
(`previous_response_id`, `conversation`, an `item_reference`, `background: true`) are
refused rather than answered without it.

Input items become template messages: `instructions` and leading system/developer
messages one system message, later ones user messages in place
(`chatreq.system_first`); the items of one model turn (`reasoning`, an assistant
`message`, `function_call`s) one assistant message with `reasoning_content`, `content`
and `tool_calls`; a `function_call_output` a `tool` message. Function tools are
described; every other tool type is dropped, since nothing here runs it.

The answer runs through `TurnRun` like a chat turn. Output items are the parser's
blocks: `reasoning`, `message` and one `function_call` per call. Streaming, each
block of `AppendOnlyStream` is one item: `response.output_item.added`, its deltas,
its `.done` events and `response.output_item.done`; every event is named in `event:`
and in its `type` and numbered by `sequence_number`, between `response.created` /
`response.in_progress` and `response.completed` / `response.incomplete` (or
`response.failed`, with a code Codex reads: `context_length_exceeded` for a full
context, so that it compacts its conversation).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..engine.chatparse import AppendOnlyStream, BlockClose, BlockEvent, BlockOpen, ParseView
from ..engine.errors import EngineError
from ..engine.turn import TurnRequest, TurnResult
from ..http.errors import HTTPError, invalid_request
from ..http.sse import SSE_HEADERS, sse_comment, sse_event
from ..http.types import Request, Response, Send, StreamResponse
from . import chatreq
from .chatoutput import (TurnOutput, check_json_answer, engine_http_error, open_stream_turn,
                         require_model, run_whole)
from .state import ServerState
from .turnrunner import Batch, TurnRun
from .validate import field, object_list, required

TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
FILE_PARTS = ("input_file", "input_audio", "file", "audio")
STATEFUL = "This server is stateless: send the whole conversation in `input` (as with " \
           "`store: false`)."


# -- request ------------------------------------------------------------------

def _parts_text(content: Any, where: str, role: str, images: list[str],
                sep: str = "\n\n") -> str:
    """A message's content: a string, or text (and, from the user, image) parts."""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(object_list(content, where)):
        kind, at = part.get("type"), f"{where}[{i}]"
        if kind in TEXT_PARTS:
            texts.append(required(part, TEXT_PARTS[kind], str, where=at))
        elif kind == "input_image" and role in ("user", "tool"):
            if part.get("file_id") is not None:
                raise invalid_request(f"`{at}.file_id`: files are not stored here; send the "
                                      "image inline as a data URL in `image_url`.")
            url = part.get("image_url")
            chatreq.check_image_url(url, f"{at}.image_url")
            images.append(url)
        elif kind in FILE_PARTS:
            raise invalid_request(f"`{at}`: {kind} parts are not supported; send text.")
        else:
            raise invalid_request(f"`{at}.type` {kind!r} is not a content part a {role} "
                                  "message may carry here.")
    return sep.join(texts)


def _arguments(raw: Any, where: str) -> Any:
    """A call's arguments for the template: the object they encode, or the text as sent."""
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise invalid_request(f"`{where}.arguments` must be a string.")
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw


class _Input:
    """Builds the messages item by item, merging the items of one model turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.images: list[str] = []
        self._turn: dict[str, Any] | None = None   # the assistant message being built

    def _assistant(self, starts_new: bool) -> dict[str, Any]:
        if self._turn is None or starts_new:
            self._turn = {"role": "assistant", "content": ""}
            self.messages.append(self._turn)
        return self._turn

    def _other(self, msg: dict[str, Any]) -> None:
        self._turn = None
        self.messages.append(msg)

    def add(self, item: dict[str, Any], where: str) -> None:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            turn = self._assistant(False)
            call = {"id": required(item, "call_id", str, where=where), "type": "function",
                    "function": {"name": required(item, "name", str, where=where),
                                 "arguments": _arguments(item.get("arguments"), where)}}
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise invalid_request(f"`{where}.output` must be a string or an array of parts.")
            self._other({"role": "tool", "tool_call_id": required(item, "call_id", str,
                                                                   where=where),
                         "content": _parts_text(output, f"{where}.output", "tool", self.images,
                                                sep="\n")})
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "item_reference":
            raise invalid_request(f"`{where}` is an item_reference. " + STATEFUL)
        else:
            raise invalid_request(f"`{where}.type` {kind!r} is not an input item this server "
                                  "reads.")

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = field(item, "role", str, where=where)
        if role not in ("user", "system", "developer", "assistant"):
            raise invalid_request(f"`{where}.role` must be \"user\", \"system\", \"developer\" "
                                  "or \"assistant\".")
        content = item.get("content")
        if not isinstance(content, (str, list)):
            raise invalid_request(f"`{where}.content` must be a string or an array of parts.")
        if role == "assistant":
            turn = self._assistant(bool(self._turn and self._turn.get("tool_calls")))
            turn["content"] += _parts_text(content, f"{where}.content", role, [], sep="")
            return
        text = _parts_text(content, f"{where}.content", role,
                           self.images if role == "user" else [])
        self._other({"role": "user" if role == "user" else "system", "content": text})

    def _reasoning(self, item: dict[str, Any], where: str) -> None:
        texts = []
        for i, part in enumerate(object_list(item.get("content") or [], f"{where}.content")):
            if part.get("type") == "reasoning_text":
                texts.append(required(part, "text", str, where=f"{where}.content[{i}]"))
        turn = self._turn
        turn = self._assistant(bool(turn and (turn["content"] or turn.get("tool_calls"))))
        if texts:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(texts)


def convert_input(body: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Template-ready messages (one system message first) and the images they carry."""
    conv = _Input()
    instructions = field(body, "instructions", str, "")
    if instructions:
        conv.messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        conv.messages.append({"role": "user", "content": raw})
    else:
        items = object_list(raw, "input")
        if not items:
            raise invalid_request("`input` must hold at least one item.")
        for i, item in enumerate(items):
            conv.add(item, f"input[{i}]")
    messages = chatreq.system_first(conv.messages)
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise invalid_request("The last input item must be from the user or a "
                              "function_call_output: the engine does not continue an "
                              "assistant answer.")
    return messages, len(conv.images)


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Function tools as the template reads them; every other tool type is dropped."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(object_list(raw, "tools")):
        if tool.get("type") != "function":
            continue
        name = field(tool, "name", str, where=f"tools[{i}]")
        if not name:
            raise invalid_request(f"`tools[{i}].name` is required.")
        description = field(tool, "description", str, "", where=f"tools[{i}]")
        params = chatreq.schema_object(tool.get("parameters"), f"tools[{i}].parameters")
        out.append({"type": "function", "function": {
            "name": name, "description": description,
            "parameters": params or {"type": "object", "properties": {}}}})
    return out or None


def tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("auto"|"none"|"required", the named function or None)."""
    if raw is None:
        return "auto", None
    if raw in ("auto", "none", "required"):
        if raw == "required" and not tools:
            raise invalid_request("`tool_choice` \"required\" needs function `tools`.")
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = field(raw, "name", str, where="tool_choice")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise invalid_request(f"`tool_choice` names {name!r}, which is not among the "
                                  "function `tools`.")
        return "required", name
    raise invalid_request("`tool_choice` must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"name\": ...}.")


def _text_schema(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_request("`text` must be an object.")
    fmt = field(raw, "format", dict, where="text")
    kind = fmt.get("type") if fmt else None
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return chatreq.schema_object(fmt.get("schema"), "text.format.schema") or \
            {"type": "object"}
    raise invalid_request(f"`text.format.type` {kind!r} is not supported: use \"text\", "
                          "\"json_object\" or \"json_schema\".")


def refuse_state(body: dict[str, Any]) -> None:
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise invalid_request(f"`{key}` is not supported. " + STATEFUL)
    if body.get("background") is True:
        raise invalid_request("`background: true` is not supported: nothing here keeps a "
                              "response to fetch later. Stream it instead.")


def build_turn(state: ServerState, body: dict[str, Any]) -> TurnRequest:
    values, user_keys = state.config.values, state.config.user_keys
    chatreq.refuse_lone_surrogates(body)
    refuse_state(body)
    messages, n_images = convert_input(body)
    chatreq.count_images(n_images)
    if n_images:
        raise chatreq.no_vision()
    tools = convert_tools(body.get("tools"))
    choice, named = tool_choice(body.get("tool_choice"), tools)
    schema = _text_schema(body.get("text"))
    if schema is not None and choice == "required":
        raise invalid_request("An output schema cannot be combined with a required tool call "
                              "(`tool_choice` \"required\" or a named function).")
    reasoning = field(body, "reasoning", dict, {})
    think = chatreq.thinking(values, user_keys, effort=reasoning.get("effort"))
    budget = chatreq.budget(body.get("max_output_tokens"), "max_output_tokens", values)
    field(body, "stream", bool, False)
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, max_tokens=budget,
                      think=think, schema=schema)
    req.grammar_tools = (  # type: ignore[attr-defined]
        [t for t in tools if t["function"]["name"] == named] if named and tools else None)
    return req


# -- response -----------------------------------------------------------------

def http_error(e: EngineError) -> HTTPError:
    """An engine failure as this protocol says it: a full context is
    `context_length_exceeded`, the code Codex compacts its conversation on."""
    err = engine_http_error(e)
    if e.code == "context_full":
        return HTTPError(400, "context_length_exceeded", err.message)
    return err


def failed_code(err: HTTPError) -> str:
    """The `response.failed` code: the ones a Responses client decides on."""
    if err.code == "context_length_exceeded":
        return err.code
    return "invalid_prompt" if err.status < 500 else "server_error"


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def reasoning_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or _new_id("rs_"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or _new_id("msg_"), "type": "message", "role": "assistant",
            "status": status, "content": [] if text is None else [output_text(text)]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or _new_id("fc_"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(view: ParseView) -> list[dict[str, Any]]:
    items = []
    if view.reasoning:
        items.append(reasoning_item(view.reasoning))
    if view.content:
        items.append(message_item(view.content))
    for call in view.tool_calls:
        items.append(call_item(_new_id("call_"), call.name, call.arguments_text or "{}"))
    return items


def _status(result: TurnResult) -> tuple[str, dict[str, Any] | None]:
    finish = result.generation.finish
    if finish == "stop":
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish == "length" else "cancelled"}


class ResponsesTurn:
    def __init__(self, state: ServerState, req: TurnRequest, body: dict[str, Any]) -> None:
        self.state = state
        self.req = req
        self.id = _new_id("resp_")
        self.created = int(time.time())
        self.model = state.session.path.name if state.session else ""
        self.echo = _echo(body, req)
        self.reasoning_tokens = 0

    def response(self, status: str, output: list[dict[str, Any]],
                 result: TurnResult | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": None, "incomplete_details": None,
            **self.echo, "usage": None}
        body.update(extra)
        if result is not None:
            body["usage"] = self._usage(result)
            body["bmoe"] = {"summary": result.summary}
            if status != "in_progress":
                body["completed_at"] = int(time.time())
        return body

    def _usage(self, result: TurnResult) -> dict[str, Any]:
        gen = result.generation
        n_out = len(gen.tokens)
        return {"input_tokens": gen.n_prompt,
                "input_tokens_details": {"cached_tokens": gen.n_cached, "cache_write_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens, n_out)},
                "total_tokens": gen.n_prompt + n_out}

    def count_reasoning(self, batch: Batch, view: ParseView) -> None:
        """Tokens of batches that left the answer reasoning only (a batch-grained count)."""
        if view.reasoning and not view.content and not view.tool_calls:
            self.reasoning_tokens += len(batch)

    async def complete(self) -> Response:
        whole = await run_whole(self.state, self.req, http_error, on_view=self.count_reasoning)
        self.model = whole.model or self.model
        result, view = whole.result, whole.view
        status, incomplete = _status(result)
        return Response.json(self.response(status, output_items(view), result,
                                           incomplete_details=incomplete))

    async def stream(self, run: TurnRun, send: Send) -> None:
        try:
            await _Stream(self, send).run(run)
        finally:
            run.close()


def _echo(body: dict[str, Any], req: TurnRequest) -> dict[str, Any]:
    """The request fields a `response` object repeats."""
    choice: Any = body.get("tool_choice") or "auto"
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": False}
             for t in req.tools or []]
    return {"instructions": body.get("instructions"), "max_output_tokens":
            body.get("max_output_tokens"), "parallel_tool_calls": True, "tool_choice": choice,
            "tools": tools, "temperature": None, "top_p": None, "store": False}


class _Stream:
    """One streamed response: numbered events, one output item per parser block."""

    def __init__(self, turn: ResponsesTurn, send: Send) -> None:
        self.turn = turn
        self.send = send
        self.seq = 0
        self.created = False
        self.items: dict[int, dict[str, Any]] = {}   # output_index -> the item as sent
        self.done: list[dict[str, Any]] = []          # finished items, in order
        self.finish_status = "completed"

    async def event(self, name: str, data: dict[str, Any]) -> None:
        await self.send(sse_event(name, {"type": name, "sequence_number": self.seq, **data}))
        self.seq += 1

    async def start(self) -> None:
        if not self.created:
            self.created = True
            await self.event("response.created",
                             {"response": self.turn.response("in_progress", [])})

    async def run(self, run: TurnRun) -> None:
        turn = self.turn

        async def waiting() -> None:
            await self.send(sse_comment("waiting for a turn"))

        async def ping() -> None:
            await self.send(sse_comment("ping"))

        blocks = AppendOnlyStream(lambda: _new_id("call_"))
        try:
            await self.start()
            prepared = run.prepared or await run.start(on_wait=waiting)
            turn.model = run.session.path.name if run.session else turn.model
            out = TurnOutput(prepared, turn.req)
            await self.event("response.in_progress",
                             {"response": turn.response("in_progress", [])})

            async def on_batch(batch: Batch) -> None:
                view = out.feed("".join(ev.text for ev, _ in batch))
                turn.count_reasoning(batch, view)
                await self.blocks(blocks.update(view))

            result = await run.run(on_batch, on_idle=ping)
            view = out.finish(result)
            status, incomplete = _status(result)
            self.finish_status = "completed" if status == "completed" else "incomplete"
            await self.blocks(blocks.finish(view))
            await check_json_answer(turn.state, turn.req, result, view)
        except (EngineError, HTTPError) as e:
            await self.failed(http_error(e) if isinstance(e, EngineError) else e)
            return
        body = turn.response(status, self.done, result, incomplete_details=incomplete)
        await self.event("response." + status, {"response": body})

    async def failed(self, err: HTTPError) -> None:
        await self.start()
        error = {"code": failed_code(err), "message": err.message}
        await self.event("response.failed",
                         {"response": self.turn.response("failed", self.done, error=error)})

    async def blocks(self, events: list[BlockEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockOpen):
                await self.open(ev)
            elif isinstance(ev, BlockClose):
                await self.close(ev)
            else:
                await self.append(ev.index, ev.kind, ev.text)

    async def open(self, ev: BlockOpen) -> None:
        if ev.kind == "reasoning":
            item = reasoning_item("", "in_progress")
        elif ev.kind == "text":
            item = message_item(None, "in_progress")
        else:
            item = call_item(ev.call_id or _new_id("call_"), ev.name or "", "", "in_progress")
        self.items[ev.index] = item
        await self.event("response.output_item.added", {"output_index": ev.index, "item": item})
        if ev.kind == "text":
            await self.event("response.content_part.added", {
                "item_id": item["id"], "output_index": ev.index, "content_index": 0,
                "part": output_text("")})

    async def append(self, index: int, kind: str, text: str) -> None:
        ids = {"item_id": self.items[index]["id"], "output_index": index}
        if kind == "reasoning":
            await self.event("response.reasoning_text.delta",
                             {**ids, "content_index": 0, "delta": text})
        elif kind == "text":
            await self.event("response.output_text.delta",
                             {**ids, "content_index": 0, "delta": text, "logprobs": []})
        else:
            await self.event("response.function_call_arguments.delta", {**ids, "delta": text})

    async def close(self, ev: BlockClose) -> None:
        sent = self.items[ev.index]
        ids = {"item_id": sent["id"], "output_index": ev.index}
        status = self.finish_status
        if ev.kind == "reasoning":
            item = reasoning_item(ev.text, status, sent["id"])
            await self.event("response.reasoning_text.done",
                             {**ids, "content_index": 0, "text": ev.text})
        elif ev.kind == "text":
            item = message_item(ev.text, status, sent["id"])
            await self.event("response.output_text.done",
                             {**ids, "content_index": 0, "text": ev.text, "logprobs": []})
            await self.event("response.content_part.done",
                             {**ids, "content_index": 0, "part": output_text(ev.text)})
        else:
            arguments = ev.text
            if not arguments:
                arguments = "{}"
                await self.append(ev.index, ev.kind, arguments)
            item = call_item(sent["call_id"], sent["name"], arguments, status, sent["id"])
            await self.event("response.function_call_arguments.done",
                             {**ids, "name": sent["name"], "arguments": arguments})
        self.done.append(item)
        await self.event("response.output_item.done", {"output_index": ev.index, "item": item})


async def handle(state: ServerState, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req = build_turn(state, body)
    require_model(state)
    turn = ResponsesTurn(state, req, body)
    if not body.get("stream"):
        return await turn.complete()
    run = await open_stream_turn(state, req, http_error)
    return StreamResponse(produce=lambda send: turn.stream(run, send), headers=list(SSE_HEADERS),
                          on_close=run.close)
