"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic Messages ↔ the engine turn.

Theory of operation
-------------------
A request becomes the same `TurnRequest` as `/v1/chat/completions` builds:

* ``system`` (a string or text blocks, Claude Code's per-request
  ``x-anthropic-billing-header:`` block dropped) and any leading ``system`` messages
  become one system message; a later one becomes a user message in its place
  (`chatreq.system_first`).
* A user message's ``tool_result`` blocks become ``tool`` messages, in order, followed
  by one user message with its text, so the results sit right after the assistant
  message whose calls they answer, as templates expect.
* An assistant message's ``thinking`` blocks become its ``reasoning_content``,
  ``tool_use`` blocks its ``tool_calls``; ``redacted_thinking`` is skipped.

The answer runs through the turn service (`serving.serve`) with `MessagesEncoder`.
A non-streaming answer is built from the parser's final view. A streaming one is built from `AppendOnlyStream`'s block
events (the protocol cannot take text back): each block is a
``content_block_start`` / ``_delta`` / ``_stop`` triple, a thinking block closed by
an empty ``signature_delta``. Errors take this protocol's shape (`shapes.py` for a
refusal before the stream; ``event: error`` inside it); a full context says
``prompt is too long:`` so that an agent compacts its conversation.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Annotated, Any, Literal, NoReturn

from pydantic import Field, StrictBool, StrictStr, Tag

from ...engine.chatparse import BlockAppend, BlockClose, BlockEvent, BlockOpen, ParseView
from ...engine.errors import EngineError
from ...engine.images import ImageSet
from ...engine.turn import TurnRequest
from ...http.errors import HTTPError, invalid_request
from ...http.sse import SSE_HEADERS, sse_event
from ...http.types import Request, Response, StreamResponse
from ...runtime.state import Runtime
from ...runtime.turnevents import Failed, Finished, Ping, Shape, Started, TurnEvent, Waiting, opens_tool_call
from .. import chatreq, serving, wire
from ..imageparts import image_part, image_tokens, read_images
from ..shapes import anthropic_engine_error, anthropic_error
from ..wire import Schema, TokenBudget, Wire, tagged

log = logging.getLogger("bmoe.anthropic")

BILLING_HEADER = "x-anthropic-billing-header:"
BYTES_PER_TOKEN = 3          # count_tokens' estimate: on the high side for code and JSON
TOKENS_PER_MESSAGE = 4       # ... plus the role markup around each message


# -- the wire: the request's body, checked as wire.py says ---------------------------

class TextBlock(Wire):
    type: Literal["text"]
    text: StrictStr


class ImageSource(Wire):
    type: StrictStr                  # only "base64" is read: the decoder says why
    media_type: StrictStr = ""
    data: StrictStr = ""


class ImageBlock(Wire):
    type: Literal["image"]
    source: ImageSource


class DocumentBlock(Wire):
    """Known, and refused with a reason by the decoder."""
    type: Literal["document"]


class ToolReference(Wire):
    type: Literal["tool_reference"]
    tool_name: StrictStr


ResultPart = Annotated[Annotated[TextBlock, Tag("type=text")]
                       | Annotated[ImageBlock, Tag("type=image")]
                       | Annotated[ToolReference, Tag("type=tool_reference")]
                       | Annotated[DocumentBlock, Tag("type=document")], tagged()]


class ToolResultBlock(Wire):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ResultPart] | None = None


class ThinkingBlock(Wire):
    type: Literal["thinking"]
    thinking: StrictStr


class RedactedThinking(Wire):
    type: Literal["redacted_thinking"]


class ToolUseBlock(Wire):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any] | None = None


UserBlock = Annotated[Annotated[TextBlock, Tag("type=text")]
                      | Annotated[ImageBlock, Tag("type=image")]
                      | Annotated[ToolResultBlock, Tag("type=tool_result")]
                      | Annotated[DocumentBlock, Tag("type=document")], tagged()]


AssistantBlock = Annotated[Annotated[TextBlock, Tag("type=text")]
                           | Annotated[ThinkingBlock, Tag("type=thinking")]
                           | Annotated[RedactedThinking, Tag("type=redacted_thinking")]
                           | Annotated[ToolUseBlock, Tag("type=tool_use")], tagged()]


class UserMessage(Wire):
    role: Literal["user"]
    content: StrictStr | list[UserBlock]


class AssistantMessage(Wire):
    role: Literal["assistant"]
    content: StrictStr | list[AssistantBlock]


class SystemMessage(Wire):
    role: Literal["system"]
    content: StrictStr | list[TextBlock]


Message = Annotated[Annotated[UserMessage, Tag("role=user")]
                    | Annotated[AssistantMessage, Tag("role=assistant")]
                    | Annotated[SystemMessage, Tag("role=system")], tagged("role")]


class ClientTool(Wire):
    type: Literal["custom"] | None = None
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    input_schema: Schema = None
    defer_loading: StrictBool | None = None


class ServerTool(Wire):
    """A tool the provider runs (`web_search_...`): refused by the decoder."""
    type: StrictStr


MessagesTool = Annotated[Annotated[ClientTool, Tag("type=custom")]
                         | Annotated[ServerTool, Tag("type=*")],
                         tagged(default=lambda _: "custom", only=("custom",))]


class MessagesKindChoice(Wire):
    type: Literal["auto", "any", "none"]


class MessagesNamedChoice(Wire):
    type: Literal["tool"]
    name: StrictStr


MessagesChoice = Annotated[Annotated[MessagesKindChoice, Tag("type=auto")]
                           | Annotated[MessagesKindChoice, Tag("type=any")]
                           | Annotated[MessagesKindChoice, Tag("type=none")]
                           | Annotated[MessagesNamedChoice, Tag("type=tool")], tagged()]


class ThinkingConfig(Wire):
    type: Literal["enabled", "adaptive", "disabled"]


class OutputFormat(Wire):
    type: Literal["json_schema"]
    schema_: Schema = Field(None, alias="schema")


class OutputConfig(Wire):
    format: OutputFormat | None = None


class MessagesBody(Wire):
    messages: list[Message]              # empty: answered, as llama-server answers it
    system: StrictStr | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesChoice | None = None
    stream: StrictBool | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    max_tokens: TokenBudget = None


# -- request ------------------------------------------------------------------
# `MessagesBody` has checked every field's type; what is left here is meaning.

def system_text(raw: str | list[TextBlock] | None) -> str:
    """The `system` field, without Claude Code's billing header (it changes on every
    request, and would keep any request from reusing the KV)."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        if raw.startswith(BILLING_HEADER):
            raw = raw.split("\n", 1)[1] if "\n" in raw else ""
        return raw
    return "\n\n".join(b.text for b in raw if not b.text.startswith(BILLING_HEADER))


def _refuse_document(where: str) -> NoReturn:
    raise invalid_request(f"`{where}`: documents are not supported; send text.")


def _image(block: ImageBlock, where: str, images: ImageSet, message: str) -> str:
    source = block.source
    if source.type != "base64":
        raise invalid_request(f"`{where}.source.type` must be \"base64\": the server does not "
                              "fetch URLs or files.")
    return image_part(images, f"data:{source.media_type};base64,{source.data}",
                      f"{where}.source", message)


def _tool_result_text(block: ToolResultBlock, where: str, images: ImageSet,
                      message: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    parts = []
    for i, part in enumerate(block.content):
        at = f"{where}.content[{i}]"
        match part:
            case TextBlock(text=text):
                parts.append(text)
            case ToolReference(tool_name=name):
                parts.append("Tool loaded: " + name)
            case ImageBlock():
                parts.append(_image(part, at, images, message))
            case DocumentBlock():
                _refuse_document(at)
    return "\n".join(parts)


def _user_message(blocks: list[Any], where: str, images: ImageSet) -> list[dict[str, Any]]:
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        match block:
            case TextBlock(text=text):
                texts.append(text)
            case ImageBlock():
                texts.append(_image(block, at, images, where))
            case ToolResultBlock():
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": _tool_result_text(block, at, images, where)})
            case DocumentBlock():
                _refuse_document(at)
    if texts or not results:
        results.append({"role": "user", "content": "\n\n".join(texts)})
    return results


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for block in blocks:
        match block:
            case TextBlock(text=text):
                texts.append(text)
            case ThinkingBlock(thinking=text):
                thinking.append(text)
            case ToolUseBlock():
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input or {}}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def convert_messages(body: MessagesBody) -> tuple[list[dict[str, Any]], ImageSet]:
    """Template-ready messages (one system message first) and the images they carry."""
    images = ImageSet()
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
        elif isinstance(msg, SystemMessage):
            out.append({"role": "system", "content": "\n\n".join(b.text for b in msg.content)})
        elif isinstance(msg, UserMessage):
            out += _user_message(msg.content, f"messages[{i}].content", images)
        else:
            out.append(_assistant_message(msg.content))
    out = chatreq.system_first(out)
    if not body.messages:
        # llama-server answers an empty conversation (its template's generation prompt,
        # after the system text when there is one); Anthropic's API would refuse it
        return out, images
    if out[-1]["role"] not in ("user", "tool", "assistant"):
        raise invalid_request("The last message must be from the user or carry tool results, "
                              "or be the assistant's answer begun (a prefill).")
    if out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        raise invalid_request("The last message is the assistant's with tool calls: send "
                              "their results in a user message, or end with the answer's "
                              "beginning as text (a prefill the answer goes on from).")
    return out, images


def convert_tools(raw: list[ClientTool | ServerTool] | None) -> list[dict[str, Any]] | None:
    """Client tools as the template reads them; `defer_loading` ones are not described."""
    out = []
    for i, tool in enumerate(raw or []):
        if isinstance(tool, ServerTool):
            raise invalid_request(f"`tools[{i}]` is a server tool ({tool.type!r}); nothing here "
                                  "runs it. Send client tools only.")
        if not tool.defer_loading:
            out.append(chatreq.function_tool(tool.name, tool.description, tool.input_schema))
    return out or None


def _output_schema(raw: OutputConfig | None) -> dict[str, Any] | None:
    if raw is None or raw.format is None:
        return None
    return raw.format.schema_ or {"type": "object"}


def read_turn(body: dict[str, Any], config: Any) -> tuple[TurnRequest, ImageSet]:
    """The turn a body asks for and the images it carries: every field checked, no model
    needed (count_tokens reads the same body)."""
    parsed = wire.parse(MessagesBody, body)
    messages, images = convert_messages(parsed)
    tools = convert_tools(parsed.tools)
    raw = parsed.tool_choice           # "any" is OpenAI's "required"; "tool" names one
    choice, named = chatreq.tool_choice(
        None if raw is None else ("required" if raw.type == "any" else raw.type),
        raw.name if isinstance(raw, MessagesNamedChoice) else None, tools)
    think = None if parsed.thinking is None else parsed.thinking.type != "disabled"
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, named_tool=named,
                      max_tokens=chatreq.budget(parsed.max_tokens, "max_tokens", config.values),
                      think=chatreq.thinking(config.values, config.user_keys, think=think),
                      schema=_output_schema(parsed.output_config), images=images,
                      continue_final=bool(messages) and messages[-1]["role"] == "assistant")
    return chatreq.checked(req, "(`tool_choice` \"any\" or \"tool\")"), images


def decode(body: dict[str, Any], config: Any) -> TurnRequest:
    req, _ = read_turn(body, config)
    return req


def estimate_tokens(req: TurnRequest) -> int:
    """count_tokens: the prompt's text at about 3 bytes a token (no tokenizer needed)."""
    tools = req.tools or []
    size = len(json.dumps(tools, ensure_ascii=False).encode()) if tools else 0
    for m in req.messages:
        for key in ("content", "reasoning_content"):
            size += len(str(m.get(key) or "").encode())
        for call in m.get("tool_calls") or []:
            size += len(json.dumps(call["function"], ensure_ascii=False).encode())
    return -(-size // BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(req.messages)


# -- response -----------------------------------------------------------------

def _usage(fin: Finished) -> dict[str, Any]:
    return {"input_tokens": fin.n_prefilled, "cache_read_input_tokens": fin.n_cached,
            "cache_creation_input_tokens": 0, "output_tokens": fin.n_output}


def _stop_reason(finish: str, calls: bool) -> str:
    if finish == "length":
        return "max_tokens"
    return "tool_use" if calls and finish == "stop" else "end_turn"


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("a tool call's arguments are not a JSON object; sending {} as its input")
        return {}
    return value


def new_tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def content_blocks(view: ParseView, ids: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The answer's blocks; its calls take `ids` (the turn's, in order) while they last."""
    blocks: list[dict[str, Any]] = []
    if view.reasoning:
        blocks.append({"type": "thinking", "thinking": view.reasoning, "signature": ""})
    if view.content:
        blocks.append({"type": "text", "text": view.content})
    for i, call in enumerate(view.tool_calls):
        blocks.append({"type": "tool_use", "id": ids[i] if i < len(ids) else new_tool_id(),
                       "name": call.name,
                       "input": _tool_input(call.arguments_text)})
    return blocks


def event(name: str, data: dict[str, Any]) -> bytes:
    return sse_event(name, {"type": name, **data})


PING = event("ping", {})


class MessagesEncoder:
    """Turn events → a `message` JSON or the Messages SSE events (sans-I/O)."""

    shape: Shape = "blocks"
    headers = list(SSE_HEADERS)

    def __init__(self) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = ""
        self.calls = False

    def new_call_id(self) -> str:
        return new_tool_id()

    def message(self, content: list[dict[str, Any]], stop_reason: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": usage}

    def whole(self, fin: Finished) -> dict[str, Any]:
        self.model = fin.model
        view = fin.view
        body = self.message(content_blocks(view, fin.call_ids), _stop_reason(fin.finish, bool(view.tool_calls)),
                            _usage(fin))
        body["bmoe"] = {"summary": fin.summary}
        return body

    def encode(self, ev: TurnEvent) -> bytes:
        match ev:
            case Waiting() | Ping():
                return PING
            case Started(model=model, n_prompt=n_prompt):
                self.model = model
                # the whole prompt: how much of it the KV held is known once it ran (the
                # message_delta's usage, which a client takes over these)
                start = {"input_tokens": n_prompt, "output_tokens": 0}
                return event("message_start", {"message": self.message([], None, start)})
            case BlockOpen() | BlockAppend() | BlockClose():
                self.calls = self.calls or opens_tool_call(ev)
                return b"".join(block_events(ev))
            case Finished():
                return event("message_delta", {
                    "delta": {"stop_reason": _stop_reason(ev.finish, self.calls),
                              "stop_sequence": None},
                    "usage": _usage(ev), "bmoe": {"summary": ev.summary}}) + \
                    event("message_stop", {})
            case Failed(error=EngineError() as e):
                return sse_event("error", anthropic_error(anthropic_engine_error(e)))
            case Failed(error=HTTPError() as e):
                return sse_event("error", anthropic_error(e))
        return b""


def block_events(ev: BlockEvent) -> list[bytes]:
    """One block event as this protocol's SSE events."""
    if isinstance(ev, BlockOpen):
        if ev.kind == "reasoning":
            block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif ev.kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}}
        return [event("content_block_start", {"index": ev.index, "content_block": block})]
    if isinstance(ev, BlockClose):
        out = []
        if ev.kind == "reasoning":
            out.append(event("content_block_delta", {
                "index": ev.index, "delta": {"type": "signature_delta", "signature": ""}}))
        return out + [event("content_block_stop", {"index": ev.index})]
    if ev.kind == "reasoning":
        delta = {"type": "thinking_delta", "thinking": ev.text}
    elif ev.kind == "text":
        delta = {"type": "text_delta", "text": ev.text}
    else:
        delta = {"type": "input_json_delta", "partial_json": ev.text}
    return [event("content_block_delta", {"index": ev.index, "delta": delta})]


async def handle(state: Runtime, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req = decode(body, state.config)
    await read_images(req.images)
    return await serving.serve(state, [req], [MessagesEncoder()],
                               streaming=bool(body.get("stream")))


async def count_tokens(state: Runtime, request: Request) -> Response:
    req, images = read_turn(request.json_object(), state.config)
    return Response.json({"input_tokens": estimate_tokens(req) + image_tokens(state, images)})
