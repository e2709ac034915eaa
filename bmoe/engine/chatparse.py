"""Reading a chat model's output: reasoning, content and tool calls, token by token.

Theory of operation
-------------------
The model writes one stream of text. Its chat template decides the markup: a
reasoning span between ``<think>`` and ``</think>``, and tool calls in one of two
framings (``detect_framing`` finds which by rendering a sample call through the
template, never by the model's name):

* ``hermes`` (Qwen3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
* ``qwen3_coder``: ``<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>``, the values raw text typed by the tool's JSON schema.

``OutputParser`` is a small state machine over four modes::

    reasoning --</think>--> content --<tool_call>--> call --done--> after-call
        ^                     |  ^                                      |
        +------<think>--------+  +--- </think> with no opening tag:     +--<tool_call>--> call
                                      everything so far was reasoning

Text is fed as decoded strings (the session decodes a token's bytes incrementally, so a
split UTF-8 character arrives whole).
Each mode looks for its markers; a tail that could still grow into a marker (``<thi``,
``<tool_``) is held back until the next piece decides it, so markup never shows as
content. Text after a tool call opens is never content. Inside a call a framing
parser (``hermes_calls.HermesCall`` or ``coder_calls.CoderCall``) consumes the text
and exposes the call's name and the arguments as JSON text that only ever grows, so a
stream can send it
in appended pieces.

``snapshot()`` returns a frozen ``ParseView``: the parser's current reading. It only
ever extends the previous one, except when a ``</think>`` without an opening tag
turns the content so far into reasoning. Two delta producers turn successive views
into wire-neutral deltas: ``ChatDeltaStream`` (OpenAI chat; a reclassification
becomes a ``reset`` delta carrying the full texts) and ``AppendOnlyStream``
(Anthropic Messages and Responses; sequential blocks, nothing taken back).
Everything here is pure: no I/O, no model.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any, Literal


from .chatmarkup import (CALL_CLOSE, CALL_OPEN, FRAMINGS, FUNCTION_CLOSE, FUNCTION_OPEN, HERMES,
                         PARAM_CLOSE, PARAM_OPEN, QWEN3_CODER, THINK_CLOSE, THINK_OPEN,
                         JsonObject, _find_first, _held_tail)
from .coder_calls import CoderCall, coerce_parameter, schema_types, tool_parameters
from .hermes_calls import HermesCall

_Call = HermesCall | CoderCall

__all__ = ["CALL_CLOSE", "CALL_OPEN", "FRAMINGS", "FUNCTION_CLOSE", "FUNCTION_OPEN", "HERMES",
           "PARAM_CLOSE", "PARAM_OPEN", "QWEN3_CODER", "THINK_CLOSE", "THINK_OPEN", "JsonObject",
           "ToolCallView", "ParseView", "detect_framing", "OutputParser", "coerce_parameter",
           "schema_types", "tool_parameters", "random_call_ids", "sequential_call_ids",
           "choose_call_id", "conversation_call_ids",
           "ChatDeltaStream", "BlockOpen", "BlockAppend", "BlockClose", "BlockEvent",
           "AppendOnlyStream"]



# ---------------------------------------------------------------------------
# Views


@dataclass(frozen=True)
class ToolCallView:
    name: str
    arguments_text: str       # JSON text; later views only ever append to it
    complete: bool
    id: str = ""              # the id the model wrote, in formats that carry one (Kimi K2's
    #                           functions.NAME:0, Mistral's [CALL_ID]); else the server's


@dataclass(frozen=True)
class ParseView:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallView, ...] = ()
    fallback_raw: bool = False  # nothing parsed: content is the raw generated text


# ---------------------------------------------------------------------------
# Framing detection

_PROBE_NAME = "bmoe_probe_function"
_PROBE_ARG = "bmoe_probe_argument"


def _probe_conversation(with_tool_result: bool) -> tuple[list[JsonObject], list[JsonObject]]:
    tools = [{"type": "function", "function": {
        "name": _PROBE_NAME, "description": "probe",
        "parameters": {"type": "object", "properties": {_PROBE_ARG: {"type": "string"}},
                       "required": [_PROBE_ARG]}}}]
    call = {"id": "call_probe", "type": "function",
            "function": {"name": _PROBE_NAME, "arguments": {_PROBE_ARG: "probe value"}}}
    messages: list[JsonObject] = [{"role": "user", "content": "probe"},
                            {"role": "assistant", "content": "", "tool_calls": [call]}]
    if with_tool_result:
        messages.append({"role": "tool", "tool_call_id": "call_probe", "content": "ok"})
    return messages, tools


_CODER_MARK = re.compile(r"<tool_call>\s*<function=\s*" + _PROBE_NAME + r"\s*>")
_HERMES_MARK = re.compile(
    r"<tool_call>\s*\{(?:(?!</tool_call>).)*\"name\"\s*:\s*\"" + _PROBE_NAME + "\"", re.S)


def detect_framing(render: Callable[[list[JsonObject], list[JsonObject]], str]) -> str | None:
    """Which tool-call framing the template writes, from a rendered sample call.

    ``render(messages, tools)`` renders through the model's own template. The sample
    call's arguments are an object, as llama.cpp hands them to templates. The probe's
    unusual names keep the template's own instructions (which show example calls) from
    being mistaken for the call.
    """
    for with_result in (True, False):
        try:
            text = render(*_probe_conversation(with_result))
        except Exception:  # a template may refuse either shape; try the other
            continue
        if _CODER_MARK.search(text):
            return QWEN3_CODER
        if _HERMES_MARK.search(text):
            return HERMES
        return None
    return None


# ---------------------------------------------------------------------------
# The output parser

_REASONING, _CONTENT, _CALL, _AFTER_CALL = "reasoning", "content", "call", "after_call"


class OutputParser:
    """Incremental reader of one generation; see the module docstring.

    ``framing`` None reads no tool calls. ``tools`` (OpenAI function tools) give the
    qwen3_coder parameter types, and their names let a qwen3_coder call that omits
    ``<tool_call>`` start at ``<function=NAME>``, as llama.cpp allows.
    """

    def __init__(self, framing: str | None, starts_in_reasoning: bool = False,
                 tools: list[JsonObject] | None = None) -> None:
        if framing is not None and framing not in FRAMINGS:
            raise ValueError(f"unknown tool-call framing {framing!r}")
        self._framing = framing
        self._functions = tool_parameters(tools)
        self._mode = _REASONING if starts_in_reasoning else _CONTENT
        self._think_closed = False
        self._pending = ""
        self._raw = ""
        self._reasoning = ""
        self._content = ""
        self._calls: list[_Call] = []
        self._final: ParseView | None = None
        self._markers = self._build_markers()

    def _build_markers(self) -> dict[str, tuple[str, ...]]:
        openers: tuple[str, ...] = ()
        if self._framing is not None:
            openers = (CALL_OPEN,)
        if self._framing == QWEN3_CODER:
            openers += tuple(f"{FUNCTION_OPEN}{name}>" for name in self._functions)
        return {
            _REASONING: (THINK_CLOSE, *openers[:1]),
            _CONTENT: (THINK_OPEN, THINK_CLOSE, *openers),
            _AFTER_CALL: openers,
        }

    def feed(self, text: str) -> None:
        if self._final is not None:
            raise RuntimeError("feed() after finish()")
        self._raw += text
        self._pending += text
        self._advance()

    def snapshot(self) -> ParseView:
        if self._final is not None:
            return self._final
        calls = tuple(ToolCallView(c.name, c.arguments_text(), c.done)
                      for c in self._calls if c.name is not None)
        return ParseView(self._reasoning.strip(), self._content.strip(), calls)

    def finish(self) -> ParseView:
        """The final view: held-back text is flushed and an open call is closed.

        When nothing parsed (no reasoning, content or call) but the model wrote more
        than an empty reasoning span, the raw text is the content (``fallback_raw``).
        """
        if self._final is None:
            self._flush()
            view = self.snapshot()
            if not (view.reasoning or view.content or view.tool_calls) and self._dropped_text():
                view = ParseView(content=self._raw.strip(), fallback_raw=True)
            self._final = view
        return self._final

    def _dropped_text(self) -> bool:
        """Whether the raw text held more than an empty reasoning span."""
        return bool(self._raw.replace(THINK_OPEN, "").replace(THINK_CLOSE, "").strip())

    def _flush(self) -> None:
        tail, self._pending = self._pending, ""
        if self._mode == _CALL:
            self._calls[-1].close(tail)
        else:
            self._emit(tail)
        for call in self._calls:
            if not call.done:
                call.close("")

    def _advance(self) -> None:
        while self._pending:
            if self._mode == _CALL:
                if not self._advance_call():
                    return
                continue
            markers = self._markers[self._mode]
            hit = _find_first(self._pending, markers)
            if hit is None:
                keep = _held_tail(self._pending, markers)
                self._emit(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return
            at, marker = hit
            self._emit(self._pending[:at])
            self._pending = self._pending[at + len(marker):]
            self._on_marker(marker)

    def _advance_call(self) -> bool:
        """Feed the open call; False when it waits for more text."""
        call = self._calls[-1]
        taken = call.feed(self._pending)
        self._pending = self._pending[taken:]
        if call.done:
            self._mode = _AFTER_CALL
            return True
        return False

    def _emit(self, text: str) -> None:
        if self._mode == _REASONING:
            self._reasoning += text
        elif self._mode == _CONTENT:
            self._content += text

    def _on_marker(self, marker: str) -> None:
        if marker == THINK_OPEN:
            self._mode = _REASONING
        elif marker == THINK_CLOSE:
            self._on_think_close()
        else:
            self._open_call(marker)

    def _on_think_close(self) -> None:
        if self._mode == _CONTENT and not self._think_closed and not self._calls:
            # No opening tag was seen: the prompt left a reasoning span open.
            self._reasoning += self._content
            self._content = ""
        self._think_closed = True
        self._mode = _CONTENT

    def _open_call(self, marker: str) -> None:
        self._think_closed = True
        if self._framing == HERMES:
            self._calls.append(HermesCall())
        else:
            self._calls.append(CoderCall(self._functions))
            if marker != CALL_OPEN:  # <function=NAME> without <tool_call>
                self._pending = marker + self._pending
        self._mode = _CALL


# ---------------------------------------------------------------------------
# Delta producers


# a model's own call id is kept when it is visible ASCII, of a reasonable length, and not
# an id the conversation (or this answer) already holds
_MODEL_ID = re.compile(r"[\x21-\x7e]{1,64}")


def conversation_call_ids(messages: list[dict[str, Any]]) -> set[str]:
    """The call ids a conversation already holds (calls and the results that name them)."""
    taken = set()
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        if isinstance(msg.get("tool_call_id"), str):
            taken.add(msg["tool_call_id"])
        for call in msg.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                taken.add(call["id"])
    return taken


def choose_call_id(call: ToolCallView, taken: set[str], new_id: Callable[[], str]) -> str:
    """The model's own id for `call` when its format carries a usable one, else a new
    one; either way it joins `taken`."""
    call_id = call.id if _MODEL_ID.fullmatch(call.id) and call.id not in taken else new_id()
    taken.add(call_id)
    return call_id


def random_call_ids(prefix: str = "call_") -> Callable[[], str]:
    return lambda: prefix + secrets.token_hex(12)


def sequential_call_ids(prefix: str = "call_") -> Callable[[], str]:
    counter = count()
    return lambda: f"{prefix}{next(counter)}"


def _extension(sent: str, now: str) -> str | None:
    """What ``now`` adds to ``sent``; None when it does not extend it."""
    return now[len(sent):] if now.startswith(sent) else None


class ChatDeltaStream:
    """OpenAI chat deltas from successive views.

    Deltas: ``{"reasoning_content": piece}``, ``{"content": piece}``, ``{"reset": True,
    "content": FULL, "reasoning_content": FULL}`` when a view does not extend what was
    sent, and ``{"tool_calls": [...]}`` with one call entry: first ``{"index", "id",
    "type": "function", "function": {"name", "arguments": ""}}``, then ``{"index",
    "function": {"arguments": piece}}``.
    """

    def __init__(self, new_id: Callable[[], str] | None = None,
                 taken: set[str] | None = None) -> None:
        self._new_id = new_id or random_call_ids()
        self._taken = set(taken or ())          # ids a model's own id must not repeat
        self._reasoning = ""
        self._content = ""
        self._call_ids: list[str] = []
        self._call_args: list[str] = []

    @property
    def call_ids(self) -> list[str]:
        return list(self._call_ids)

    def update(self, view: ParseView) -> list[dict[str, Any]]:
        return self._text_deltas(view) + self._call_deltas(view, final=False)

    def finish(self, view: ParseView) -> list[dict[str, Any]]:
        """Like update, and calls no earlier view showed are sent whole."""
        return self._text_deltas(view) + self._call_deltas(view, final=True)

    def _text_deltas(self, view: ParseView) -> list[dict[str, Any]]:
        more_reasoning = _extension(self._reasoning, view.reasoning)
        more_content = _extension(self._content, view.content)
        self._reasoning, self._content = view.reasoning, view.content
        if more_reasoning is None or more_content is None:
            return [{"reset": True, "content": view.content,
                     "reasoning_content": view.reasoning}]
        out: list[dict[str, Any]] = []
        if more_reasoning:
            out.append({"reasoning_content": more_reasoning})
        if more_content:
            out.append({"content": more_content})
        return out

    def _call_deltas(self, view: ParseView, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, call in enumerate(view.tool_calls):
            if index == len(self._call_ids):
                if not (call.arguments_text or call.complete or final):
                    break
                out.append(self._open_call(index, call))
            piece = _extension(self._call_args[index], call.arguments_text)
            if piece:
                self._call_args[index] = call.arguments_text
                out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return out

    def _open_call(self, index: int, call: ToolCallView) -> dict[str, Any]:
        call_id = choose_call_id(call, self._taken, self._new_id)
        self._call_ids.append(call_id)
        self._call_args.append("")
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}


BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(frozen=True)
class BlockOpen:
    index: int                  # the block's position in the answer (0, 1, ...)
    kind: BlockKind
    call_id: str | None = None  # tool_call blocks
    name: str | None = None     # tool_call blocks


@dataclass(frozen=True)
class BlockAppend:
    index: int
    kind: BlockKind
    text: str                   # reasoning, text, or a piece of the arguments JSON


@dataclass(frozen=True)
class BlockClose:
    index: int
    kind: BlockKind
    text: str                   # everything the block carried, for ``.done`` events


BlockEvent = BlockOpen | BlockAppend | BlockClose


@dataclass
class _OpenBlock:
    index: int
    kind: BlockKind
    call: int = -1
    text: str = ""


class AppendOnlyStream:
    """Sequential open/append/close block events for protocols that cannot take back.

    Reasoning and text are sent only as far as a view extends what was sent; a view
    that reclassifies is skipped until a later one extends it again. One block is open
    at a time: opening another closes it, and while a tool call is open and not
    complete, new reasoning and text wait.
    """

    def __init__(self, new_id: Callable[[], str] | None = None,
                 taken: set[str] | None = None) -> None:
        self._new_id = new_id or random_call_ids()
        self._taken = set(taken or ())          # ids a model's own id must not repeat
        self._reasoning = ""
        self._text = ""
        self._call_ids: list[str] = []
        self._call_args: list[str] = []
        self._open: _OpenBlock | None = None
        self._next_index = 0

    @property
    def call_ids(self) -> list[str]:
        return list(self._call_ids)

    def update(self, view: ParseView) -> list[BlockEvent]:
        return self._advance(view, final=False)

    def finish(self, view: ParseView) -> list[BlockEvent]:
        """Send what the final view adds, calls no view showed whole, and close."""
        return self._advance(view, final=True) + self._close()

    def _advance(self, view: ParseView, final: bool) -> list[BlockEvent]:
        out = self._continue_call(view, final)
        if self._open is not None and self._open.kind == "tool_call":
            return out
        out += self._write("reasoning", view.reasoning)
        out += self._write("text", view.content)
        out += self._new_calls(view, final)
        return out

    def _write(self, kind: BlockKind, now: str) -> list[BlockEvent]:
        sent = self._reasoning if kind == "reasoning" else self._text
        piece = _extension(sent, now)
        if not piece:
            return []
        if kind == "reasoning":
            self._reasoning = now
        else:
            self._text = now
        out = self._ensure_open(kind)
        return out + self._append(piece)

    def _continue_call(self, view: ParseView, final: bool) -> list[BlockEvent]:
        block = self._open
        if block is None or block.kind != "tool_call" or block.call >= len(view.tool_calls):
            return []
        call = view.tool_calls[block.call]
        out = self._append_args(block.call, call.arguments_text)
        if call.complete or final:
            out += self._close()
        return out

    def _new_calls(self, view: ParseView, final: bool) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for index in range(len(self._call_ids), len(view.tool_calls)):
            call = view.tool_calls[index]
            if not (call.arguments_text or call.complete or final):
                break
            out += self._close()
            call_id = choose_call_id(call, self._taken, self._new_id)
            self._call_ids.append(call_id)
            self._call_args.append("")
            out.append(self._start(_OpenBlock(self._next_index, "tool_call", index),
                                   call_id, call.name))
            out += self._append_args(index, call.arguments_text)
            if not (call.complete or final):
                break
            out += self._close()
        return out

    def _append_args(self, index: int, now: str) -> list[BlockEvent]:
        piece = _extension(self._call_args[index], now)
        if not piece:
            return []
        self._call_args[index] = now
        return self._append(piece)

    def _ensure_open(self, kind: BlockKind) -> list[BlockEvent]:
        if self._open is not None and self._open.kind == kind:
            return []
        out = self._close()
        out.append(self._start(_OpenBlock(self._next_index, kind)))
        return out

    def _start(self, block: _OpenBlock, call_id: str | None = None,
               name: str | None = None) -> BlockOpen:
        self._open = block
        self._next_index += 1
        return BlockOpen(block.index, block.kind, call_id, name)

    def _append(self, piece: str) -> list[BlockEvent]:
        assert self._open is not None
        self._open.text += piece
        return [BlockAppend(self._open.index, self._open.kind, piece)]

    def _close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockClose(block.index, block.kind, block.text)]
