"""GLM-4.5 / 4.6 / 4.7: ``<think>`` reasoning and calls with tagged arguments::

    <tool_call>NAME
    <arg_key>k</arg_key>
    <arg_value>v</arg_value>
    </tool_call>

A value is raw text, typed by the tool's schema (a string stays a string, anything else
is read as JSON when it parses), as llama.cpp reads it. The newlines are optional (4.7
writes none). A partial call shows only the pairs whose value has closed.
"""

from __future__ import annotations

import json
import re

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ..coder_calls import coerce_parameter, schema_types, tool_parameters
from ._text import settled, split_reasoning

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE,
                                      starts_in_reasoning, [CALL_OPEN])
    at = rest.find(CALL_OPEN)
    if at < 0:
        content = settled(rest, partial, [CALL_OPEN, THINK_OPEN, THINK_CLOSE])
        return ParseView(reasoning.strip(), content.replace(THINK_CLOSE, "").strip())
    params = tool_parameters(tools)
    calls = []
    for chunk in rest[at:].split(CALL_OPEN)[1:]:
        view = _call(chunk, partial, params)
        if view is not None:
            calls.append(view)
    return ParseView(reasoning.strip(), rest[:at].strip(), tuple(calls))


def _call(chunk: str, partial: bool, params: dict[str, JsonObject]) -> ToolCallView | None:
    end = chunk.find(CALL_CLOSE)
    closed = end >= 0 or not partial
    body = chunk[:end] if end >= 0 else chunk
    name_end = min((i for i in (body.find(KEY_OPEN), body.find("\n")) if i >= 0), default=-1)
    if name_end < 0:
        if not closed:
            return None                      # the name may still grow
        name_end = len(body)
    name = body[:name_end].strip()
    if not name:
        return None
    properties = (params.get(name) or {}).get("properties") or {}
    pieces = []
    for key, value in _PAIR.findall(body):
        key = key.strip()
        types = schema_types(properties.get(key)) if isinstance(properties, dict) else frozenset()
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {coerce_parameter(value, types)}")
    args = "{" + ", ".join(pieces) + ("}" if closed else "")
    if not pieces and not closed:
        args = ""
    return ToolCallView(name, args, closed)
