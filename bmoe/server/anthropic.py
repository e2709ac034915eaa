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

The answer runs through the turn service (`turnservice.serve`) with `MessagesEncoder`.
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
from typing import Any

from ..engine.chatparse import BlockAppend, BlockClose, BlockEvent, BlockOpen, ParseView
from ..engine.errors import EngineError
from ..engine.images import ImageSet
from ..engine.turn import TurnRequest
from ..http.errors import HTTPError, invalid_request
from ..http.sse import SSE_HEADERS, sse_event
from ..http.types import Request, Response, StreamResponse
from . import chatreq, turnservice, wire
from .imageparts import image_part, image_tokens, read_images
from .shapes import anthropic_error, engine_http_error
from .state import ServerState
from .turnevents import (Failed, Finished, Ping, Shape, Started, TurnEvent, Waiting,
                         opens_tool_call)
from .validate import field, object_list, required

log = logging.getLogger("bmoe.anthropic")

BILLING_HEADER = "x-anthropic-billing-header:"
TOO_LONG = "prompt is too long: "
BYTES_PER_TOKEN = 3          # count_tokens' estimate: on the high side for code and JSON
TOKENS_PER_MESSAGE = 4       # ... plus the role markup around each message


# -- request ------------------------------------------------------------------

def _text_blocks(raw: Any, where: str, sep: str = "\n\n") -> str:
    """A string, or an array of `text` blocks joined."""
    if isinstance(raw, str):
        return raw
    texts = []
    for i, block in enumerate(object_list(raw, where)):
        if block.get("type") != "text":
            raise invalid_request(f"`{where}[{i}].type` must be \"text\".")
        texts.append(required(block, "text", str, where=f"{where}[{i}]"))
    return sep.join(texts)


def system_text(raw: Any) -> str:
    """The `system` field, without Claude Code's billing header (it changes on every
    request, and would keep any request from reusing the KV)."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        if raw.startswith(BILLING_HEADER):
            raw = raw.split("\n", 1)[1] if "\n" in raw else ""
        return raw
    blocks = [b for b in object_list(raw, "system")
              if not (isinstance(b.get("text"), str) and b["text"].startswith(BILLING_HEADER))]
    return _text_blocks(blocks, "system")


def _image(block: dict[str, Any], where: str, images: ImageSet, message: str) -> str:
    source = field(block, "source", dict, where=where)
    if source is None:
        raise invalid_request(f"`{where}.source` is required.")
    if source.get("type") != "base64":
        raise invalid_request(f"`{where}.source.type` must be \"base64\": the server does not "
                              "fetch URLs or files.")
    media = field(source, "media_type", str, "", where=f"{where}.source")
    data = field(source, "data", str, "", where=f"{where}.source")
    return image_part(images, f"data:{media};base64,{data}", f"{where}.source", message)


def _tool_result_text(block: dict[str, Any], where: str, images: ImageSet,
                      message: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(object_list(content, f"{where}.content")):
        kind, at = part.get("type"), f"{where}.content[{i}]"
        if kind == "text":
            parts.append(required(part, "text", str, where=at))
        elif kind == "tool_reference":
            parts.append("Tool loaded: " + required(part, "tool_name", str, where=at))
        elif kind == "image":
            parts.append(_image(part, at, images, message))
        elif kind == "document":
            raise invalid_request(f"`{at}`: documents are not supported; send text.")
        else:
            raise invalid_request(f"`{at}.type` {kind!r} is not a block a tool result may carry.")
    return "\n".join(parts)


def _user_message(blocks: list[dict[str, Any]], where: str,
                  images: ImageSet) -> list[dict[str, Any]]:
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}[{i}]"
        if kind == "text":
            texts.append(required(block, "text", str, where=at))
        elif kind == "image":
            texts.append(_image(block, at, images, where))
        elif kind == "tool_result":
            results.append({"role": "tool",
                            "tool_call_id": required(block, "tool_use_id", str, where=at),
                            "content": _tool_result_text(block, at, images, where)})
        elif kind == "document":
            raise invalid_request(f"`{at}`: documents are not supported; send text.")
        else:
            raise invalid_request(f"`{at}.type` {kind!r} is not a block a user message may carry.")
    if texts or not results:
        results.append({"role": "user", "content": "\n\n".join(texts)})
    return results


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for i, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}[{i}]"
        if kind == "text":
            texts.append(required(block, "text", str, where=at))
        elif kind == "thinking":
            thinking.append(required(block, "thinking", str, where=at))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append({"id": required(block, "id", str, where=at), "type": "function",
                          "function": {"name": required(block, "name", str, where=at),
                                       "arguments": field(block, "input", dict, {}, where=at)}})
        else:
            raise invalid_request(f"`{at}.type` {kind!r} is not a block an assistant message "
                                  "may carry.")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def convert_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], ImageSet]:
    """Template-ready messages (one system message first) and the images they carry."""
    raw = object_list(body.get("messages"), "messages")
    if not raw:
        raise invalid_request("`messages` must hold at least one message.")
    images = ImageSet()
    out: list[dict[str, Any]] = []
    system = system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        role = field(msg, "role", str, where=where)
        content = msg.get("content")
        if role not in ("user", "assistant", "system"):
            raise invalid_request(f"`{where}.role` must be \"user\", \"assistant\" or \"system\".")
        if not isinstance(content, (str, list)):
            raise invalid_request(f"`{where}.content` must be a string or an array of blocks.")
        if role == "system":
            out.append({"role": "system", "content": _text_blocks(content, f"{where}.content")})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            out += _user_message(object_list(content, f"{where}.content"), f"{where}.content",
                                 images)
        else:
            out.append(_assistant_message(object_list(content, f"{where}.content"),
                                          f"{where}.content"))
    out = chatreq.system_first(out)
    if out[-1]["role"] not in ("user", "tool"):
        raise invalid_request("The last message must be from the user or carry tool results: "
                              "the engine does not continue a prefilled assistant answer.")
    return out, images


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Client tools as the template reads them; `defer_loading` ones are not described."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(object_list(raw, "tools")):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid_request(f"`tools[{i}]` is a server tool ({kind!r}); nothing here runs "
                                  "it. Send client tools only.")
        described = chatreq.function_tool(tool, f"tools[{i}]", "input_schema")
        if not field(tool, "defer_loading", bool, False, where=f"tools[{i}]"):
            out.append(described)
    return out or None


def tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("auto"|"none"|"required", the named tool or None)."""
    if raw is None:
        return "auto", None
    if not isinstance(raw, dict):
        raise invalid_request("`tool_choice` must be an object such as {\"type\": \"auto\"}.")
    kind = raw.get("type")
    if kind in ("auto", "none"):
        return kind, None
    if kind not in ("any", "tool"):
        raise invalid_request("`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\".")
    if not tools:
        raise invalid_request(f"`tool_choice` {kind!r} needs `tools`.")
    if kind == "any":
        return "required", None
    name = field(raw, "name", str, where="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid_request(f"`tool_choice.name` {name!r} is not among `tools`.")
    return "required", name


def _think(config: Any, raw: Any) -> bool:
    values, user_keys = config.values, config.user_keys
    if raw is None:
        return chatreq.thinking(values, user_keys)
    if not isinstance(raw, dict) or raw.get("type") not in ("enabled", "adaptive", "disabled"):
        raise invalid_request("`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\".")
    return chatreq.thinking(values, user_keys, think=raw["type"] != "disabled")


def _output_schema(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_request("`output_config` must be an object.")
    fmt = field(raw, "format", dict, where="output_config")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise invalid_request("`output_config.format.type` must be \"json_schema\".")
    return chatreq.schema_object(fmt.get("schema"), "output_config.format.schema") or \
        {"type": "object"}


def read_turn(body: dict[str, Any], config: Any) -> tuple[TurnRequest, ImageSet]:
    """The turn a body asks for and the images it carries: every field checked, no model
    needed (count_tokens reads the same body)."""
    chatreq.refuse_lone_surrogates(body)
    wire.parse(wire.MessagesBody, body)
    messages, images = convert_messages(body)
    tools = convert_tools(body.get("tools"))
    choice, named = tool_choice(body.get("tool_choice"), tools)
    schema = _output_schema(body.get("output_config"))
    budget = chatreq.budget(body.get("max_tokens"), "max_tokens", config.values)
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, named_tool=named,
                      max_tokens=budget, think=_think(config, body.get("thinking")),
                      schema=schema, images=images)
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

def http_error(e: EngineError) -> HTTPError:
    """An engine failure as this protocol says it: a full context is "prompt is too long"
    (an agent compacts its conversation on those words)."""
    err = engine_http_error(e)
    if e.code != "context_full":
        return err
    head = f"{e.n_prompt} tokens > {e.n_ctx} maximum. " if e.n_prompt is not None else ""
    return HTTPError(400, "context_full", TOO_LONG + head + err.message)


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


def content_blocks(view: ParseView) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if view.reasoning:
        blocks.append({"type": "thinking", "thinking": view.reasoning, "signature": ""})
    if view.content:
        blocks.append({"type": "text", "text": view.content})
    for call in view.tool_calls:
        blocks.append({"type": "tool_use", "id": new_tool_id(), "name": call.name,
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
        body = self.message(content_blocks(view), _stop_reason(fin.finish, bool(view.tool_calls)),
                            _usage(fin))
        body["bmoe"] = {"summary": fin.summary}
        return body

    def encode(self, ev: TurnEvent) -> bytes:
        match ev:
            case Waiting() | Ping():
                return PING
            case Started(model=model):
                self.model = model
                zero = {"input_tokens": 0, "output_tokens": 0}
                return event("message_start", {"message": self.message([], None, zero)})
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
                return sse_event("error", anthropic_error(http_error(e)))
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


async def handle(state: ServerState, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req = decode(body, state.config)
    await read_images(req.images)
    return await turnservice.serve(state, req, MessagesEncoder(),
                                   streaming=bool(body.get("stream")), http_error=http_error)


async def count_tokens(state: ServerState, request: Request) -> Response:
    req, images = read_turn(request.json_object(), state.config)
    return Response.json({"input_tokens": estimate_tokens(req) + image_tokens(state, images)})
