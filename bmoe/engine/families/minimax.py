"""MiniMax-M2: ``<think>`` reasoning (the prompt leaves it open) and XML calls::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="k">v</parameter>
    </invoke>
    </minimax:tool_call>

Values are raw text typed by the tool's schema, as GLM's; a partial call shows only the
parameters that have closed.
"""

from __future__ import annotations

import json
import re

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ..coder_calls import coerce_parameter, schema_types, tool_parameters
from ._text import settled, split_reasoning

SECTION, SECTION_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
_NAME = re.compile(r'^\s*"([^"]*)"\s*>')
_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE,
                                      starts_in_reasoning, [SECTION])
    at = rest.find(SECTION)
    if at < 0:
        content = settled(rest, partial, [SECTION, THINK_OPEN, THINK_CLOSE])
        return ParseView(reasoning.strip(), content.strip())
    params = tool_parameters(tools)
    chunks = rest[at:].split(INVOKE)[1:]
    calls = []
    for n, chunk in enumerate(chunks):
        view = _invoke(chunk, partial and n == len(chunks) - 1, params)
        if view is not None:
            calls.append(view)
    return ParseView(reasoning.strip(), rest[:at].strip(), tuple(calls))


def _invoke(chunk: str, partial: bool, params: dict[str, JsonObject]) -> ToolCallView | None:
    head = _NAME.match(chunk)
    if head is None:
        return None
    name = head.group(1)
    end = chunk.find(INVOKE_END)
    closed = end >= 0 or not partial
    body = chunk[head.end():end if end >= 0 else len(chunk)]
    properties = (params.get(name) or {}).get("properties") or {}
    pieces = []
    for key, value in _PARAM.findall(body):
        types = schema_types(properties.get(key)) if isinstance(properties, dict) else frozenset()
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {coerce_parameter(value, types)}")
    if not pieces and not closed:
        return ToolCallView(name, "", False)
    return ToolCallView(name, "{" + ", ".join(pieces) + ("}" if closed else ""), closed)
