"""`POST /v1/chat/completions`: the OpenAI wire format ↔ the engine-level turn."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, ConfigDict, Field, StrictBool, StrictStr, Tag

from ...engine import families
from ...engine.chatparse import random_call_ids
from ...engine.errors import EngineError
from ...engine.images import ImageSet
from ...engine.params import MAX_TEMPLATE_KWARGS_CHARS, TEMPLATE_OWN_VARIABLES
from ...engine.sampling import SEED_RANDOM, Sampling
from ...engine.turn import TurnRequest
from ...http.errors import HTTPError, invalid_request
from ...http.sse import sse_comment, sse_done, sse_event
from ...http.types import Request, Response, StreamResponse
from ...runtime.state import Runtime
from ...runtime.turnevents import (
    Decoded,
    Failed,
    Finished,
    Ping,
    Progress,
    RawTokens,
    ReasoningDelta,
    Reset,
    RunningTimings,
    Shape,
    Started,
    TextDelta,
    ToolArgsDelta,
    ToolCallStart,
    TurnEvent,
    Waiting,
    generation_timings,
)
from .. import chatreq, serving, wire
from ..imageparts import image_part, read_images
from ..llama_options import llama_options
from ..shapes import engine_error
from ..wire import (
    MAX_SCHEMA_DEPTH,
    TOP_LOGPROBS_MAX,
    FunctionDef,
    Integer,
    ResponseFormat,
    Schema,
    StreamOptions,
    TokenBudget,
    Wire,
    nesting_depth,
    problem,
    tagged,
)
from . import choices

# -- the wire: the request's body, checked as wire.py says ---------------------------

class ChatText(Wire):
    type: Literal["text"]
    text: StrictStr


class ImageURL(Wire):
    url: StrictStr


class ChatImage(Wire):
    type: Literal["image_url"]
    image_url: ImageURL | StrictStr


class ChatFilePart(Wire):
    """Audio and files: known, and refused with a reason by the decoder."""
    type: Literal["input_audio", "file", "audio"]


ChatPart = Annotated[Annotated[ChatText, Tag("type=text")]
                     | Annotated[ChatImage, Tag("type=image_url")]
                     | Annotated[ChatFilePart, Tag("type=input_audio")]
                     | Annotated[ChatFilePart, Tag("type=file")]
                     | Annotated[ChatFilePart, Tag("type=audio")], tagged()]


class ChatFunction(Wire):
    name: StrictStr = ""
    arguments: StrictStr | dict[str, Any] = "{}"


class ChatToolCall(Wire):
    id: StrictStr = ""
    function: ChatFunction


class ChatMessage(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ChatPart] | None = None
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class ChatTool(Wire):
    type: Literal["function"]
    function: FunctionDef


class ChatChoiceName(Wire):
    name: StrictStr


class ChatNamedChoice(Wire):
    type: Literal["function"]
    function: ChatChoiceName


class TemplateVariables(Wire):
    """A request's ``chat_template_kwargs`` (llama-server's): template variables, JSON
    values as the server's ``--chat-template-kwargs`` holds them; ``enable_thinking`` is
    the turn's thinking switch too."""
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    enable_thinking: StrictBool | None = None

    def variables(self) -> dict[str, Any]:
        """The variables the template reads (enable_thinking when it was given)."""
        out = dict(self.model_extra or {})
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out


def _template_kwargs(value: TemplateVariables | None) -> TemplateVariables | None:
    """Bounded as the setting is: its JSON size, its nesting, and none of the variables
    the server gives the template itself."""
    if value is None:
        return None
    extra = value.model_extra or {}
    if nesting_depth(extra) > MAX_SCHEMA_DEPTH:
        raise problem(f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
    size = len(json.dumps(extra))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise problem(f"is {size:,} characters of JSON; the limit is "
                       f"{MAX_TEMPLATE_KWARGS_CHARS:,}")
    taken = sorted(k for k in extra if k in TEMPLATE_OWN_VARIABLES)
    if taken:
        raise problem(f"cannot set {', '.join(taken)}: the server gives the template those "
                       "itself")
    return value


TemplateKwargs = Annotated[TemplateVariables | None, AfterValidator(_template_kwargs)]


class ChatBody(Wire):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ChatNamedChoice | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: TemplateKwargs = None
    think: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    grammar: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    max_tokens: TokenBudget = None
    max_completion_tokens: TokenBudget = None
    json_schema: Schema = None
    n: Any = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[Any, Integer(0, TOP_LOGPROBS_MAX)] = None
    return_progress: StrictBool | None = None       # llama-server's: the prefill's progress
    timings_per_token: StrictBool | None = None     # ... and its timings on the stream
    add_generation_prompt: StrictBool | None = None             # llama-server's and vLLM's:
    continue_final_message: StrictBool | StrictStr | None = None  # an answer continued


# -- request ------------------------------------------------------------------
# `ChatBody` has checked every field's type; what is left here is meaning.

def _text_of_parts(parts: list[Any], where: str, images: ImageSet | None,
                   message: str) -> str:
    out = []
    for i, part in enumerate(parts):
        match part:
            case ChatText(text=text):
                out.append(text)
            case ChatImage(image_url=ImageURL(url=url) | str(url)):
                out.append(image_part(images, url, f"{where}[{i}].image_url.url", message))
            case ChatFilePart(type=kind):
                raise invalid_request(f"`{where}[{i}]`: {kind} parts are not supported; "
                                      "send text.")
    return "".join(out)


def _arguments(raw: str | dict[str, Any]) -> Any:
    """A call's arguments for the template: the object they encode, or the text as sent
    (the template shows what the model wrote)."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw


def convert_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], ImageSet]:
    """Template-ready messages and the images they carry (marked at their places)."""
    out: list[dict[str, Any]] = []
    images = ImageSet()
    for i, msg in enumerate(messages):
        where, role, content = f"messages[{i}]", msg.role, msg.content
        if isinstance(content, list):
            content = _text_of_parts(content, f"{where}.content",
                                     images if role == "user" else None, where)
        m: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": content or ""}
        if role == "assistant":
            if msg.tool_calls is not None:
                m["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in msg.tool_calls]
            if msg.reasoning_content:
                m["reasoning_content"] = msg.reasoning_content
        if role == "tool":
            m["tool_call_id"] = msg.tool_call_id or ""
        out.append(m)
    if out[-1]["role"] not in ("user", "tool", "assistant"):
        raise invalid_request("The last message must be from the user or a tool, or be the "
                              "assistant's answer begun (a prefill the answer goes on from).")
    return out, images


def continuation(parsed: ChatBody, messages: list[dict[str, Any]]) -> bool:
    """Whether the answer goes on from the last message, as llama-server decides it: an
    assistant message last is the answer begun (a prefill) unless the request says
    otherwise; `continue_final_message` asks for it by name, and then
    `add_generation_prompt` must be false."""
    asked = parsed.continue_final_message in (True, "content", "reasoning_content")
    last = messages[-1]
    if asked and parsed.add_generation_prompt is not False:
        raise invalid_request("Cannot set both add_generation_prompt and "
                              "continue_final_message to true: send add_generation_prompt "
                              "false to continue the last message.")
    begun = last["role"] == "assistant" and (asked or parsed.continue_final_message is None)
    if begun and not asked and len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise invalid_request("Cannot have 2 or more assistant messages at the end of the "
                              "list: join them, or end with the user's message.")
    if begun and last.get("tool_calls"):
        raise invalid_request("Cannot continue an assistant message that contains tool "
                              "calls: send their results as tool messages.")
    raw = parsed.messages[-1].content
    if begun and isinstance(raw, list):
        # the begun answer's text parts, as llama-server continues them: a blank line apart
        last["content"] = "\n\n".join(str(getattr(p, "text", "") or "") for p in raw)
    return begun


def convert_tools(raw: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    out = [chatreq.function_tool(t.function.name, t.function.description, t.function.parameters)
           for t in raw or []]
    return out or None


def decode(body: dict[str, Any], config: Any) -> TurnRequest:
    """The turn a chat body asks for (400 invalid_request naming the field otherwise)."""
    return read_chat(body, config)[0]


def read_chat(body: dict[str, Any], config: Any) -> tuple[TurnRequest, ChatBody]:
    """The turn a chat body asks for, and the body as checked (what the answer's shape
    reads: `stream`, `n`, `logprobs`...): it is parsed once."""
    values = config.values
    parsed = wire.parse(ChatBody, body)
    messages, images = convert_messages(parsed.messages)
    tools = convert_tools(parsed.tools)
    raw = parsed.tool_choice
    choice, named = chatreq.tool_choice(raw if isinstance(raw, str) else None,
                                        None if raw is None or isinstance(raw, str)
                                        else raw.function.name, tools)
    kwargs = parsed.chat_template_kwargs.variables() if parsed.chat_template_kwargs else {}
    think = chatreq.thinking(values, config.user_keys, think=parsed.think,
                             enable_thinking=kwargs.get("enable_thinking"),
                             effort=parsed.reasoning_effort)
    limit = parsed.max_completion_tokens
    budget = chatreq.budget(parsed.max_tokens if limit is None else limit, "max_tokens", values)
    schema = chatreq.response_format_schema(parsed.response_format, parsed.json_schema)
    choices.read_n(body)                  # n choices: `handle` runs them (choices.py)
    req = TurnRequest(messages=messages, tools=tools, tool_choice=choice, named_tool=named,
                      max_tokens=budget, think=think, schema=schema,
                      grammar=parsed.grammar or None,
                      parallel_calls=bool(parsed.parallel_tool_calls), images=images,
                      template_kwargs={**kwargs, **families.effort_kwargs(parsed.reasoning_effort)},
                      progress=bool(parsed.return_progress),
                      continue_final=continuation(parsed, messages),
                      generation_prompt=parsed.add_generation_prompt is not False)
    return chatreq.checked(req, "(`tool_choice` \"required\" or a named function)"), parsed



# -- response -----------------------------------------------------------------

def _usage(fin: Finished) -> dict[str, Any]:
    return {"prompt_tokens": fin.n_prompt, "completion_tokens": fin.n_output,
            "total_tokens": fin.n_prompt + fin.n_output,
            "prompt_tokens_details": {"cached_tokens": fin.n_cached}}


def _finish_reason(fin: Finished) -> str:
    if fin.finish == "stop" and fin.view.tool_calls:
        return "tool_calls"
    return fin.finish


class ChatEncoder:
    """Turn events → `chat.completion` JSON or `chat.completion.chunk` SSE (sans-I/O)."""

    shape: Shape = "revisable"
    headers: list[tuple[str, str]] = []

    def __init__(self, include_usage: bool = False, new_call_id: Callable[[], str] | None = None,
                 created: int | None = None) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time()) if created is None else created
        self.model = ""
        self.include_usage = include_usage
        self._new_id = new_call_id or random_call_ids()
        self.index = 0                              # this choice's index (n above 1)
        self.last = True                            # ... whether its end ends the stream
        self.tally: choices.Tally | None = None     # the usage of all n choices
        self.top_logprobs: int | None = None        # `logprobs` asked: the top ids a token
        self._probs: list[dict[str, Any]] = []      # every token's entry (the whole answer)
        self._pending: list[dict[str, Any]] = []    # ... not yet sent with a content delta
        self.show_progress = False                  # `return_progress`: prefill chunks
        self.with_timings = False                   # `timings_per_token`: the last chunks'
        self.verbose = False                        # `verbose`: the prompt in `__verbose`
        self.timings = RunningTimings()             # ... so far, for timings_per_token

    def new_call_id(self) -> str:
        return self._new_id()

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, fin: Finished) -> dict[str, Any]:
        self.model = fin.model
        view = fin.view
        ids = list(fin.call_ids)
        calls = [{"id": ids[i] if i < len(ids) else self.new_call_id(), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments_text or "{}"}}
                 for i, c in enumerate(view.tool_calls)]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": view.content if (view.content or not calls) else None}
        if view.reasoning:
            message["reasoning_content"] = view.reasoning
        if calls:
            message["tool_calls"] = calls
        body = self.envelope("chat.completion")
        body["choices"] = [{"index": self.index, "message": message,
                            "logprobs": self._logprobs(self._probs),
                            "finish_reason": _finish_reason(fin)}]
        body["usage"] = self._usage(fin)
        body["bmoe"] = {"summary": fin.summary}
        if self.verbose:                    # llama-server's `verbose`: what the model read
            body["__verbose"] = {"prompt": fin.prompt_text, "content": view.content}
        return body

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": entries, "refusal": None}

    def _take_probs(self, ev: RawTokens) -> None:
        k = self.top_logprobs or 0
        for t in ev.tokens:
            if t.logprob is None:
                continue
            top = [{"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}
                   for _, lp, b in (t.top or [])[:k]]
            entry = {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                     "top_logprobs": top}
            self._probs.append(entry)
            self._pending.append(entry)

    def chunk(self, delta: dict[str, Any], finish: str | None = None,
              extra: dict[str, Any] | None = None) -> bytes:
        body = self.envelope("chat.completion.chunk")
        probs = None
        if self._pending and delta.get("content"):   # the tokens this content came from
            probs, self._pending = self._logprobs(self._pending), []
        body["choices"] = [{"index": self.index, "delta": delta, "logprobs": probs,
                            "finish_reason": finish}]
        if self.with_timings and finish is None and any(
                delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
            # llama-server's timings_per_token: on every delta of the answer
            body["timings"] = self.timings.body()
        if extra:
            body.update(extra)
        return sse_event(None, body)

    def encode(self, ev: TurnEvent) -> bytes:
        match ev:
            case Waiting():
                return sse_comment("waiting for a turn")
            case Ping():
                return sse_comment("ping")
            case Started(model=model):
                self.model = model
                return self.chunk({"role": "assistant", "content": None})   # as llama-server
            case RawTokens():
                self._take_probs(ev)
                return b""
            case Decoded():
                self.timings.take(ev)
                return b""
            case Progress():
                self.timings.take(ev)
                if not self.show_progress:
                    return b""
                body = self.envelope("chat.completion.chunk")
                body["choices"] = []
                body["prompt_progress"] = ev.body()
                return sse_event(None, body)
            case TextDelta(text=text):
                return self.chunk({"content": text})
            case ReasoningDelta(text=text):
                return self.chunk({"reasoning_content": text})
            case Reset(content=content, reasoning=reasoning):
                return self.chunk({"content": content, "reasoning_content": reasoning},
                                  extra={"bmoe": {"reset": True}})
            case ToolCallStart(index=index, call_id=call_id, name=name):
                return self.chunk({"tool_calls": [{"index": index, "id": call_id,
                                                   "type": "function",
                                                   "function": {"name": name, "arguments": ""}}]})
            case ToolArgsDelta(index=index, text=text):
                return self.chunk({"tool_calls": [{"index": index,
                                                   "function": {"arguments": text}}]})
            case Finished():
                return self._finished(ev)
            case Failed(error=EngineError() as e):
                return self._error(engine_error(None, e))   # the server's own shape
            case Failed(error=HTTPError() as e):
                return self._error(e)
        return b""

    def _error(self, err: HTTPError) -> bytes:
        if self.tally is not None:
            self.tally.failed = True
        return sse_event(None, {"error": {"message": err.message, "code": err.code}}) + sse_done()

    error_bytes = _error

    def _usage(self, fin: Finished) -> dict[str, Any]:
        if self.tally is None:
            return _usage(fin)
        return {**self.tally.usage(),
                "prompt_tokens_details": {"cached_tokens": self.tally.cached_tokens}}

    def _finished(self, fin: Finished) -> bytes:
        if self.tally is not None:
            self.tally.count(fin)
        extra: dict[str, Any] = {"bmoe": {"summary": fin.summary}}
        timings = generation_timings(fin.generation) \
            if self.with_timings and fin.generation is not None else None
        if timings is not None:
            extra["timings"] = timings
        out = self.chunk({}, _finish_reason(fin), extra)
        if not self.last:
            return out
        if self.include_usage:
            body = self.envelope("chat.completion.chunk")
            body["choices"] = []
            body["usage"] = self._usage(fin)
            if timings is not None:
                body["timings"] = timings
            out += sse_event(None, body)
        return out + sse_done()


async def handle(state: Runtime, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req, parsed = read_chat(body, state.config)
    await read_images(req.images)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    n = choices.read_n(body)
    top = read_logprobs(parsed)
    flags = {"show_progress": bool(parsed.return_progress),
             "with_timings": bool(parsed.timings_per_token),
             "verbose": body.get("verbose") is True or llama_options(state).verbose}
    streaming = bool(parsed.stream)
    if n > 1 or top is not None:
        return await serve_choices(state, req, n, include_usage, streaming, top, flags)
    encoder = ChatEncoder(include_usage)
    vars(encoder).update(flags)
    return await serving.serve(state, [req], [encoder], streaming=streaming)


def session_sampling(state: Runtime) -> Sampling:
    """The server's own sampling settings (`temp`, `top-k`, `top-p`, `seed`) as a value,
    so that choice i of n can take the seed plus i."""
    values = state.session.values if state.session is not None else state.config.values
    return Sampling(temperature=float(values.get("temp") or 0.0),
                    top_k=int(values.get("top-k", 40)), top_p=float(values.get("top-p", 0.95)),
                    min_p=0.0, seed=int(values.get("seed", SEED_RANDOM)))


def read_logprobs(parsed: ChatBody) -> int | None:
    """`logprobs` / `top_logprobs` (OpenAI's): the top ids each token lists, or None when
    no log-probabilities are asked (the wire checked the types and the range)."""
    top = parsed.top_logprobs
    if not parsed.logprobs:
        if top:
            raise invalid_request("`top_logprobs` needs `logprobs: true`.")
        return None
    return int(top or 0)


async def serve_choices(state: Runtime, req: TurnRequest, n: int, include_usage: bool,
                        streaming: bool, top_logprobs: int | None = None,
                        flags: dict[str, bool] | None = None) -> Response | StreamResponse:
    """n choices, one after another (choices.py); the whole answer lists them all. With
    `top_logprobs`, each token's log-probability and its most likely alternatives."""
    sampling = session_sampling(state)
    if top_logprobs is not None:
        sampling = replace(sampling, n_probs=max(1, top_logprobs))
    reqs = choices.seeded(req, n, sampling)
    tally = choices.Tally()
    encoders = [ChatEncoder(include_usage) for _ in reqs]
    for i, encoder in enumerate(encoders):
        encoder.id, encoder.created = encoders[0].id, encoders[0].created
        encoder.index, encoder.last, encoder.tally = i, i == n - 1, tally
        encoder.top_logprobs = top_logprobs
        vars(encoder).update(flags or {})

    def merge(bodies: list[dict[str, Any]]) -> dict[str, Any]:
        merged = dict(bodies[-1])
        merged["choices"] = [b["choices"][0] for b in bodies]
        merged["bmoe"] = bodies[0]["bmoe"]
        return merged

    return await serving.serve(state, reqs, encoders, streaming=streaming, merge=merge,
                               collect=True, failed=lambda: tally.failed)
