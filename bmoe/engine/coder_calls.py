"""The ``qwen3_coder`` tool-call framing: ``<tool_call>\\n<function=f>\\n<parameter=k>\\n
value\\n</parameter>\\n</function>\\n</tool_call>``, the values raw text typed by the
tool's JSON schema.

`CoderCall` consumes the text inside one call from the outer parser (`chatparse.OutputParser`)
and says how much it took; it exposes the call's name and the arguments as JSON text that
only ever grows (each value coerced to the type its parameter's schema gives it).
"""

from __future__ import annotations

import json
from typing import Any

from .chatmarkup import (CALL_CLOSE, FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN,
                         JsonObject, _find_first, _held_tail, _json_escape, _reject_constant)


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
    except (ValueError, RecursionError):     # nested past the parser's depth: text
        return json.dumps(raw, ensure_ascii=False)
    if isinstance(value, str) or not _fits(value, types):
        return json.dumps(raw, ensure_ascii=False)
    return text


class CoderCall:
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

