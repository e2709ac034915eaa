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
parser (``_HermesCall`` or ``_CoderCall``) consumes the text and exposes the call's
name and the arguments as JSON text that only ever grows, so a stream can send it
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

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Literal

JsonObject = dict[str, Any]

HERMES = "hermes"
QWEN3_CODER = "qwen3_coder"
FRAMINGS = (HERMES, QWEN3_CODER)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"


# ---------------------------------------------------------------------------
# Views


@dataclass(frozen=True)
class ToolCallView:
    name: str
    arguments_text: str       # JSON text; later views only ever append to it
    complete: bool


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
# Text helpers


def _find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, marker)
    return best


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _json_escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# ---------------------------------------------------------------------------
# Tool schemas: the types a qwen3_coder parameter value is read as

def tool_parameters(tools: list[JsonObject] | None) -> dict[str, JsonObject]:
    """Map each function tool's name to its parameters schema (``{}`` if none)."""
    out: dict[str, JsonObject] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "object" if isinstance(value, dict) else "array"


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a schema allows; empty when it does not say."""
    if not isinstance(schema, dict):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset([declared])
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return _union_types(schema[key])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(_json_type(v) for v in schema["enum"])
    if "const" in schema:
        return frozenset([_json_type(schema["const"])])
    if "properties" in schema:
        return frozenset(["object"])
    return frozenset(["array"]) if "items" in schema else frozenset()


def _union_types(branches: list[Any]) -> frozenset[str]:
    out: set[str] = set()
    for branch in branches:
        types = schema_types(branch)
        if not types:
            return frozenset()
        out |= types
    return frozenset(out)


def _fits(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    return not types or kind in types or (kind == "integer" and "number" in types)


def coerce_parameter(raw: str, types: frozenset[str]) -> str:
    """JSON text for a raw qwen3_coder parameter value, as llama.cpp's parser reads it.

    A schema that allows only strings keeps the text as a string. Otherwise the text
    is taken as JSON when it parses to a non-string value the schema allows (or any
    value when the schema gives no type), and as a string when it does not.
    """
    if types == {"string"}:
        return json.dumps(raw, ensure_ascii=False)
    text = raw.strip()
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
    if isinstance(value, str) or not _fits(value, types):
        return json.dumps(raw, ensure_ascii=False)
    return text


# ---------------------------------------------------------------------------
# Call parsers. Each consumes text from the outer parser and says how much it took;
# text it leaves is held for the next piece (a partial marker) or, once the call is
# done, belongs to the outer parser.


class _HermesCall:
    """``{"name": ..., "arguments": ...}`` scanned one character at a time."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.done = False
        self._body = ""
        self._state = "start"
        self._key = ""
        self._mark = 0            # start of the current key or value in _body
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._fallback_args: str | None = None

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done:
                return i
            if ch == "<" and not self._inside_string():
                rest = text[i:]
                if rest.startswith(CALL_CLOSE):
                    self.close("")
                    return i + len(CALL_CLOSE)
                if CALL_CLOSE.startswith(rest):
                    return i
            self._body += ch
            self._step(ch, len(self._body) - 1)
        return len(text)

    def close(self, tail: str) -> None:
        for ch in tail:
            self._body += ch
            self._step(ch, len(self._body) - 1)
        if self._state == "scalar":
            self._value_end(len(self._body))
        if self.name is None or self._args_start is None:
            self._read_whole_body()
        self.done = True

    def arguments_text(self) -> str:
        if self._fallback_args is not None:
            return self._fallback_args
        if self._args_start is None:
            return "{}" if self.done else ""
        if self._args_end is not None:
            return self._body[self._args_start:self._args_end]
        if self.done or self._body[self._args_start] in "{[":
            return self._body[self._args_start:]
        return ""

    def _inside_string(self) -> bool:
        return self._state in ("key", "string") or (self._state == "nested" and self._in_string)

    def _read_whole_body(self) -> None:
        try:
            obj = json.loads(self._body)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and self.name is None:
            self.name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            self._fallback_args = json.dumps(args, ensure_ascii=False)

    def _step(self, ch: str, pos: int) -> None:
        getattr(self, "_on_" + self._state)(ch, pos)

    def _on_start(self, ch: str, pos: int) -> None:
        if not ch.isspace():
            self._state = "key_or_end" if ch == "{" else "failed"

    def _on_key_or_end(self, ch: str, pos: int) -> None:
        if ch == '"':
            self._state, self._mark, self._escaped = "key", pos, False
        elif ch == "}":
            self._state = "finished"
            self.done = True
        elif not ch.isspace():
            self._state = "failed"

    def _on_key(self, ch: str, pos: int) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            try:
                self._key = json.loads(self._body[self._mark:pos + 1])
            except ValueError:
                self._key = ""
            self._state = "colon"

    def _on_colon(self, ch: str, pos: int) -> None:
        if ch == ":":
            self._state = "value"
        elif not ch.isspace():
            self._state = "failed"

    def _on_value(self, ch: str, pos: int) -> None:
        if ch.isspace():
            return
        self._mark = pos
        if self._key in ("arguments", "parameters") and self._args_start is None:
            self._args_start = pos
        if ch in "{[":
            self._state, self._depth, self._in_string = "nested", 1, False
        elif ch == '"':
            self._state, self._escaped = "string", False
        else:
            self._state = "scalar"

    def _on_nested(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string, self._escaped = True, False
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._value_end(pos + 1)

    def _on_string(self, ch: str, pos: int) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._value_end(pos + 1)

    def _on_scalar(self, ch: str, pos: int) -> None:
        if ch in ",}" or ch.isspace():
            self._value_end(pos)
            self._on_after(ch, pos)

    def _on_after(self, ch: str, pos: int) -> None:
        if ch == ",":
            self._state = "key_or_end"
        elif ch == "}":
            self._state = "finished"
            self.done = True
        elif not ch.isspace():
            self._state = "failed"

    def _on_finished(self, ch: str, pos: int) -> None:
        pass

    def _on_failed(self, ch: str, pos: int) -> None:
        pass

    def _value_end(self, end: int) -> None:
        self._state = "after"
        value_text = self._body[self._mark:end]
        if self._key == "name" and self.name is None and value_text.startswith('"'):
            try:
                name = json.loads(value_text)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        if self._mark == self._args_start:
            self._args_end = end


class _CoderCall:
    """``<function=NAME>`` then ``<parameter=K>`` blocks, built into JSON as they come."""

    _BETWEEN_MARKS = (PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE)
    _VALUE_ENDS = (PARAM_CLOSE, CALL_CLOSE)

    def __init__(self, functions: dict[str, JsonObject]) -> None:
        self.name: str | None = None
        self.done = False
        self._functions = functions
        self._state = "function"
        self._args = ""            # JSON text committed so far
        self._count = 0
        self._types: frozenset[str] = frozenset()
        self._raw = ""             # the open parameter's value as written
        self._escaped_source = ""  # the part of the value escaped so far, and its escape
        self._escaped = ""

    def feed(self, text: str) -> int:
        i = 0
        while i < len(text) and not self.done:
            taken = getattr(self, "_in_" + self._state)(text, i)
            if taken == i:
                return i
            i = taken
        return i

    def close(self, tail: str) -> None:
        if self._state == "value":
            self._raw += tail
        if not self.done:
            self._close_function()

    def arguments_text(self) -> str:
        if self._state == "value" and self._types == {"string"}:
            return self._args + self._escaped_value()
        return self._args

    def _escaped_value(self) -> str:
        """The open string value, escaped; only the part not escaped before is done now."""
        value = self._value()
        if not value.startswith(self._escaped_source):  # cannot happen: values only grow
            self._escaped_source, self._escaped = "", ""
        self._escaped += _json_escape(value[len(self._escaped_source):])
        self._escaped_source = value
        return self._escaped

    def _skip_space(self, text: str, i: int) -> int:
        while i < len(text) and text[i].isspace():
            i += 1
        return i

    def _in_function(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        rest = text[i:]
        if rest.startswith(FUNCTION_OPEN):
            end = rest.find(">")
            if end < 0:
                return i
            self.name = rest[len(FUNCTION_OPEN):end].strip()
            self._args, self._state = "{", "between"
            return i + end + 1
        if rest.startswith(CALL_CLOSE):
            self.done = True
            return i + len(CALL_CLOSE)
        if not rest or FUNCTION_OPEN.startswith(rest) or CALL_CLOSE.startswith(rest):
            return i
        self._state = "failed"
        return self._in_failed(text, i)

    def _in_between(self, text: str, i: int) -> int:
        i = self._skip_space(text, i)
        rest = text[i:]
        if rest.startswith(PARAM_OPEN):
            end = rest.find(">")
            if end < 0:
                return i
            self._open_parameter(rest[len(PARAM_OPEN):end].strip())
            return i + end + 1
        for marker in (FUNCTION_CLOSE, CALL_CLOSE):
            if rest.startswith(marker):
                self._close_function()
                return i + len(marker)
        if not rest or any(m.startswith(rest) for m in self._BETWEEN_MARKS):
            return i
        return i + 1  # stray text between parameters is not part of the call

    def _in_value(self, text: str, i: int) -> int:
        rest = text[i:]
        hit = _find_first(rest, self._VALUE_ENDS)
        if hit is None:
            keep = _held_tail(rest, self._VALUE_ENDS)
            self._raw += rest[:len(rest) - keep]
            return len(text) - keep
        at, marker = hit
        self._raw += rest[:at]
        self._close_parameter()
        if marker == CALL_CLOSE:
            self._close_function()
        return i + at + len(marker)

    def _in_failed(self, text: str, i: int) -> int:
        rest = text[i:]
        at = rest.find(CALL_CLOSE)
        if at >= 0:
            self.done = True
            return i + at + len(CALL_CLOSE)
        return len(text) - _held_tail(rest, [CALL_CLOSE])

    def _open_parameter(self, key: str) -> None:
        params = self._functions.get(self.name or "", {})
        properties = params.get("properties") if isinstance(params, dict) else None
        prop = properties.get(key) if isinstance(properties, dict) else None
        self._types = schema_types(prop)
        self._args += (", " if self._count else "") + json.dumps(key, ensure_ascii=False) + ": "
        self._count += 1
        if self._types == {"string"}:
            self._args += '"'
        self._raw, self._state = "", "value"
        self._escaped_source, self._escaped = "", ""

    def _value(self) -> str:
        """The value without the newline after the tag and the one before the close."""
        value = self._raw[1:] if self._raw.startswith("\n") else self._raw
        return value[:-1] if value.endswith("\n") else value

    def _close_parameter(self) -> None:
        if self._types == {"string"}:
            self._args += _json_escape(self._value()) + '"'
        else:
            self._args += coerce_parameter(self._value(), self._types)
        self._state = "between"

    def _close_function(self) -> None:
        if self._state == "value":
            self._close_parameter()
        if self._args:
            self._args += "}"
        self._state = "closed"
        self.done = True


_Call = _HermesCall | _CoderCall


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
            self._calls.append(_HermesCall())
        else:
            self._calls.append(_CoderCall(self._functions))
            if marker != CALL_OPEN:  # <function=NAME> without <tool_call>
                self._pending = marker + self._pending
        self._mode = _CALL


# ---------------------------------------------------------------------------
# Delta producers


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

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self._new_id = new_id or random_call_ids()
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
                out.append(self._open_call(index, call.name))
            piece = _extension(self._call_args[index], call.arguments_text)
            if piece:
                self._call_args[index] = call.arguments_text
                out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return out

    def _open_call(self, index: int, name: str) -> dict[str, Any]:
        call_id = self._new_id()
        self._call_ids.append(call_id)
        self._call_args.append("")
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}


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

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self._new_id = new_id or random_call_ids()
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
            call_id = self._new_id()
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
