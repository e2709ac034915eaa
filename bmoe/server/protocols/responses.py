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

The answer runs through the turn service with `ResponsesEncoder`. Output items are the parser's
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
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, Tag

from ...engine import families
from ...engine.chatparse import BlockAppend, BlockClose, BlockOpen, ParseView
from ...engine.errors import EngineError
from ...engine.images import ImageSet
from ...engine.turn import TurnRequest
from ...http.errors import HTTPError, invalid_request
from ...http.sse import SSE_HEADERS, sse_comment, sse_event
from ...http.types import Request, Response, StreamResponse
from ...runtime.state import Runtime
from ...runtime.turnevents import (
    Decoded,
    Failed,
    Finished,
    Opened,
    Ping,
    Progress,
    RunningTimings,
    Shape,
    Started,
    Stopped,
    TurnEvent,
    Waiting,
    generation_timings,
)
from .. import chatreq, serving, wire
from ..imageparts import image_part, read_images
from ..shapes import responses_engine_error
from ..wire import FunctionDef, Other, Schema, TokenBudget, Wire, tagged

STATEFUL = "This server is stateless: send the whole conversation in `input` (as with " \
           "`store: false`)."


# -- the wire: the request's body, checked as wire.py says ---------------------------

class InputText(Wire):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class Refusal(Wire):
    type: Literal["refusal"]
    refusal: StrictStr


class InputImage(Wire):
    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: Any = None


class InputFile(Wire):
    """Files and audio: known, and refused with a reason by the decoder."""
    type: Literal["input_file", "input_audio", "file", "audio"]


InputPart = Annotated[Annotated[InputText, Tag("type=input_text")]
                      | Annotated[InputText, Tag("type=output_text")]
                      | Annotated[Refusal, Tag("type=refusal")]
                      | Annotated[InputImage, Tag("type=input_image")]
                      | Annotated[InputFile, Tag("type=input_file")]
                      | Annotated[InputFile, Tag("type=input_audio")]
                      | Annotated[InputFile, Tag("type=file")]
                      | Annotated[InputFile, Tag("type=audio")], tagged()]


class MessageItem(Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputPart]


class FunctionCallItem(Wire):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr | None = None


class FunctionCallOutputItem(Wire):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputPart]


class ReasoningText(Wire):
    type: Literal["reasoning_text"]
    text: StrictStr


ReasoningPart = Annotated[Annotated[ReasoningText, Tag("type=reasoning_text")]
                          | Annotated[Other, Tag("type=*")],
                          tagged(only=("reasoning_text",))]


class ReasoningItem(Wire):
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None


class ItemReference(Wire):
    """A stored item: refused by the decoder (nothing is stored here)."""
    type: Literal["item_reference"]


InputItem = Annotated[Annotated[MessageItem, Tag("type=message")]
                      | Annotated[FunctionCallItem, Tag("type=function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("type=function_call_output")]
                      | Annotated[ReasoningItem, Tag("type=reasoning")]
                      | Annotated[ItemReference, Tag("type=item_reference")],
                      tagged(default=lambda item: "message" if "role" in item else None)]


class FunctionTool(FunctionDef):
    type: Literal["function"]


ResponsesTool = Annotated[Annotated[FunctionTool, Tag("type=function")]
                          | Annotated[Other, Tag("type=*")], tagged(only=("function",))]


class ResponsesNamedChoice(Wire):
    type: Literal["function"]
    name: StrictStr


class TextFormat(Wire):
    type: Literal["text", "json_object", "json_schema"] | None = None
    schema_: Schema = Field(None, alias="schema")


class TextConfig(Wire):
    format: TextFormat | None = None


class ReasoningConfig(Wire):
    effort: StrictStr | None = None


class ResponsesBody(Wire):
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedChoice | None = None
    stream: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: TokenBudget = None
    background: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    return_progress: StrictBool | None = None      # llama-server's: the prefill's progress
    timings_per_token: StrictBool | None = None    # ... and timings on every delta


# -- request ------------------------------------------------------------------
# `ResponsesBody` has checked every field's type; what is left here is meaning.

def _parts_text(content: str | list[Any], where: str, role: str, images: ImageSet | None,
                sep: str = "\n\n", message: str = "") -> str:
    """A message's content: a string, or text (and, from the user, image) parts."""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        match part:
            case InputText(text=text) | Refusal(refusal=text):
                texts.append(text)
            case InputImage() if role in ("user", "tool"):
                if part.file_id is not None:
                    raise invalid_request(f"`{at}.file_id`: files are not stored here; send "
                                          "the image inline as a data URL in `image_url`.")
                texts.append(image_part(images, part.image_url, f"{at}.image_url",
                                        message or where))
            case InputImage():
                raise invalid_request(f"`{at}`: only a user message or a function_call_output "
                                      "carries images.")
            case InputFile(type=kind):
                raise invalid_request(f"`{at}`: {kind} parts are not supported; send text.")
    return sep.join(texts)


def _arguments(raw: str | None) -> Any:
    """A call's arguments for the template: the object they encode, or the text as sent."""
    if raw is None:
        return {}
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw


class _Input:
    """Builds the messages item by item, merging the items of one model turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.images = ImageSet()
        self._turn: dict[str, Any] | None = None   # the assistant message being built

    def _assistant(self, starts_new: bool) -> dict[str, Any]:
        if self._turn is None or starts_new:
            self._turn = {"role": "assistant", "content": ""}
            self.messages.append(self._turn)
        return self._turn

    def _other(self, msg: dict[str, Any]) -> None:
        self._turn = None
        self.messages.append(msg)

    def add(self, item: Any, where: str) -> None:
        match item:
            case MessageItem():
                self._message(item, where)
            case FunctionCallItem():
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
                self._assistant(False).setdefault("tool_calls", []).append(call)
            case FunctionCallOutputItem():
                self._other({"role": "tool", "tool_call_id": item.call_id,
                             "content": _parts_text(item.output, f"{where}.output", "tool",
                                                    self.images, sep="\n")})
            case ReasoningItem():
                self._reasoning(item)
            case ItemReference():
                raise invalid_request(f"`{where}` is an item_reference. " + STATEFUL)

    def _message(self, item: MessageItem, where: str) -> None:
        role, content = item.role, item.content
        if role == "assistant":
            turn = self._assistant(bool(self._turn and self._turn.get("tool_calls")))
            turn["content"] += _parts_text(content, f"{where}.content", role, None, sep="")
            return
        text = _parts_text(content, f"{where}.content", role,
                           self.images if role == "user" else None, message=where)
        self._other({"role": "user" if role == "user" else "system", "content": text})

    def _reasoning(self, item: ReasoningItem) -> None:
        texts = [p.text for p in item.content or [] if isinstance(p, ReasoningText)]
        turn = self._turn
        turn = self._assistant(bool(turn and (turn["content"] or turn.get("tool_calls"))))
        if texts:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(texts)


def convert_input(body: ResponsesBody) -> tuple[list[dict[str, Any]], ImageSet]:
    """Template-ready messages (one system message first) and the images they carry."""
    conv = _Input()
    if body.instructions:
        conv.messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        conv.messages.append({"role": "user", "content": body.input})
    elif not body.input:
        raise invalid_request("`input` must hold at least one item.")
    else:
        for i, item in enumerate(body.input):
            conv.add(item, f"input[{i}]")
    messages = chatreq.system_first(conv.messages)
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise invalid_request("The last input item must be from the user or a "
                              "function_call_output: the engine does not continue an "
                              "assistant answer.")
    return messages, conv.images


def convert_tools(raw: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools as the template reads them; every other tool type is dropped."""
    out = [chatreq.function_tool(t.name, t.description, t.parameters)
           for t in raw or [] if isinstance(t, FunctionTool)]
    return out or None


def _text_schema(raw: TextConfig | None) -> dict[str, Any] | None:
    kind = raw.format.type if raw is not None and raw.format is not None else None
    if kind is None or kind == "text" or raw is None or raw.format is None:
        return None
    if kind == "json_object":
        return {"type": "object"}
    return raw.format.schema_ or {"type": "object"}


def refuse_state(body: ResponsesBody) -> None:
    for key in ("previous_response_id", "conversation"):
        if getattr(body, key) is not None:
            raise invalid_request(f"`{key}` is not supported. " + STATEFUL)
    if body.background is True:
        raise invalid_request("`background: true` is not supported: nothing here keeps a "
                              "response to fetch later. Stream it instead.")


def decode(body: dict[str, Any], config: Any) -> TurnRequest:
    """The turn a Responses body asks for (400 invalid_request naming the field otherwise)."""
    parsed = wire.parse(ResponsesBody, body)
    refuse_state(parsed)
    messages, images = convert_input(parsed)
    tools = convert_tools(parsed.tools)
    raw = parsed.tool_choice
    choice, named = chatreq.tool_choice(raw if isinstance(raw, str) else None,
                                        None if raw is None or isinstance(raw, str)
                                        else raw.name, tools)
    effort = parsed.reasoning.effort if parsed.reasoning is not None else None
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, named_tool=named,
                      max_tokens=chatreq.budget(parsed.max_output_tokens, "max_output_tokens",
                                                config.values),
                      think=chatreq.thinking(config.values, config.user_keys, effort=effort),
                      schema=_text_schema(parsed.text), images=images,
                      template_kwargs=families.effort_kwargs(effort),
                      progress=bool(parsed.return_progress or parsed.timings_per_token))
    return chatreq.checked(req, "(`tool_choice` \"required\" or a named function)")


# -- response -----------------------------------------------------------------

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


def output_items(view: ParseView, ids: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The answer's items; its calls take `ids` (the turn's, in order) while they last."""
    items = []
    if view.reasoning:
        items.append(reasoning_item(view.reasoning))
    if view.content:
        items.append(message_item(view.content))
    for i, call in enumerate(view.tool_calls):
        items.append(call_item(ids[i] if i < len(ids) else _new_id("call_"), call.name,
                               call.arguments_text or "{}"))
    return items


def _status(finish: str) -> tuple[str, dict[str, Any] | None]:
    if finish == "stop":
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish == "length" else "cancelled"}


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


class ResponsesEncoder:
    """Turn events → a `response` JSON or the numbered Responses SSE events (sans-I/O):
    one output item per parser block."""

    shape: Shape = "blocks"
    headers = list(SSE_HEADERS)

    def __init__(self, echo: dict[str, Any], created: int | None = None) -> None:
        self.id = _new_id("resp_")
        self.created = int(time.time()) if created is None else created
        self.model = ""
        self.echo = echo
        self.seq = 0
        self.opened = False
        self.items: dict[int, dict[str, Any]] = {}   # output_index -> the item as sent
        self.done: list[dict[str, Any]] = []          # finished items, in order
        self.finish_status = "completed"
        self.show_progress = False                    # `return_progress`: prefill events
        self.per_token = False                        # `timings_per_token`: on each delta
        self.timings = RunningTimings()

    def new_call_id(self) -> str:
        return _new_id("call_")

    def response(self, status: str, output: list[dict[str, Any]],
                 fin: Finished | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": None, "incomplete_details": None,
            **self.echo, "usage": None}
        body.update(extra)
        if fin is not None:
            body["usage"] = self._usage(fin)
            body["bmoe"] = {"summary": fin.summary}
            if status != "in_progress":
                body["completed_at"] = int(time.time())
        return body

    def _usage(self, fin: Finished) -> dict[str, Any]:
        n_out = fin.n_output
        return {"input_tokens": fin.n_prompt,
                "input_tokens_details": {"cached_tokens": fin.n_cached, "cache_write_tokens": 0},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": min(fin.reasoning_tokens, n_out)},
                "total_tokens": fin.n_prompt + n_out}

    def whole(self, fin: Finished) -> dict[str, Any]:
        self.model = fin.model or self.model
        status, incomplete = _status(fin.finish)
        return self.response(status, output_items(fin.view, fin.call_ids), fin, incomplete_details=incomplete)

    # -- streaming ------------------------------------------------------------------

    def event(self, name: str, data: dict[str, Any]) -> bytes:
        out = sse_event(name, {"type": name, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def encode(self, ev: TurnEvent) -> bytes:
        match ev:
            case Opened(model=model):
                self.model = model
                return self._open()
            case Waiting():
                return sse_comment("waiting for a turn")
            case Ping():
                return sse_comment("ping")
            case Started(model=model):
                self.model = model or self.model
                return self.event("response.in_progress",
                                  {"response": self.response("in_progress", [])})
            case Stopped(finish=finish):
                self.finish_status = "completed" if finish == "stop" else "incomplete"
                return b""
            case Decoded():
                self.timings.take(ev)
                return b""
            case Progress():
                self.timings.take(ev)
                if not self.show_progress:
                    return b""
                update = {"response": self.response("in_progress", []),
                          "prompt_progress": ev.body()}
                if self.per_token:
                    update["timings"] = self.timings.body()
                return self.event("response.in_progress", update)
            case BlockOpen():
                return self.open(ev)
            case BlockAppend(index=index, kind=kind, text=text):
                return self.append(index, kind, text)
            case BlockClose():
                return self.close(ev)
            case Finished(finish=finish):
                status, incomplete = _status(finish)
                body = self.response(status, self.done, ev, incomplete_details=incomplete)
                data: dict[str, Any] = {"response": body}
                if self.per_token and ev.generation is not None:
                    data["timings"] = generation_timings(ev.generation)
                return self.event("response." + status, data)
            case Failed(error=EngineError() as e):
                return self._failed(responses_engine_error(e))
            case Failed(error=HTTPError() as e):
                return self._failed(e)
        return b""

    def _failed(self, err: HTTPError) -> bytes:
        error = {"code": failed_code(err), "message": err.message}
        return self._open() + self.event(
            "response.failed", {"response": self.response("failed", self.done, error=error)})

    def _open(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        return self.event("response.created", {"response": self.response("in_progress", [])})

    def open(self, ev: BlockOpen) -> bytes:
        if ev.kind == "reasoning":
            item = reasoning_item("", "in_progress")
        elif ev.kind == "text":
            item = message_item(None, "in_progress")
        else:
            item = call_item(ev.call_id or _new_id("call_"), ev.name or "", "", "in_progress")
        self.items[ev.index] = item
        out = self.event("response.output_item.added", {"output_index": ev.index, "item": item})
        if ev.kind == "text":
            out += self.event("response.content_part.added", {
                "item_id": item["id"], "output_index": ev.index, "content_index": 0,
                "part": output_text("")})
        return out

    def append(self, index: int, kind: str, text: str) -> bytes:
        ids: dict[str, Any] = {"item_id": self.items[index]["id"], "output_index": index}
        if self.per_token:
            ids["timings"] = self.timings.body()
        if kind == "reasoning":
            return self.event("response.reasoning_text.delta",
                              {**ids, "content_index": 0, "delta": text})
        if kind == "text":
            return self.event("response.output_text.delta",
                              {**ids, "content_index": 0, "delta": text, "logprobs": []})
        return self.event("response.function_call_arguments.delta", {**ids, "delta": text})

    def close(self, ev: BlockClose) -> bytes:
        sent = self.items[ev.index]
        ids = {"item_id": sent["id"], "output_index": ev.index}
        status = self.finish_status
        if ev.kind == "reasoning":
            item = reasoning_item(ev.text, status, sent["id"])
            out = self.event("response.reasoning_text.done",
                             {**ids, "content_index": 0, "text": ev.text})
        elif ev.kind == "text":
            item = message_item(ev.text, status, sent["id"])
            out = self.event("response.output_text.done",
                             {**ids, "content_index": 0, "text": ev.text, "logprobs": []})
            out += self.event("response.content_part.done",
                              {**ids, "content_index": 0, "part": output_text(ev.text)})
        else:
            arguments, out = ev.text, b""
            if not arguments:
                arguments = "{}"
                out += self.append(ev.index, ev.kind, arguments)
            item = call_item(sent["call_id"], sent["name"], arguments, status, sent["id"])
            out += self.event("response.function_call_arguments.done",
                              {**ids, "name": sent["name"], "arguments": arguments})
        self.done.append(item)
        return out + self.event("response.output_item.done",
                                {"output_index": ev.index, "item": item})


async def handle(state: Runtime, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req = decode(body, state.config)
    await read_images(req.images)
    encoder = ResponsesEncoder(_echo(body, req))
    encoder.show_progress = bool(body.get("return_progress"))      # (types checked)
    encoder.per_token = bool(body.get("timings_per_token"))
    return await serving.serve(state, [req], [encoder], streaming=bool(body.get("stream")))
