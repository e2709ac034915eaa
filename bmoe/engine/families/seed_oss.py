"""ByteDance Seed-OSS: ``<seed:think>`` reasoning and Qwen3-Coder-shaped calls in
``<seed:tool_call>`` blocks::

    <seed:tool_call>
    <function=NAME>
    <parameter=k>value</parameter>
    </function>
    </seed:tool_call>

A value is raw text (kept whole: Seed writes no newline of its own around it), typed by
the tool's schema. A partial call shows the parameters that closed. The template's
``thinking_budget`` variable (``--chat-template-kwargs``) sets the budget it states.
"""

from __future__ import annotations

import json
import re

from ..chatmarkup import JsonObject
from ..chatparse import ParseView, ToolCallView
from ..coder_calls import coerce_parameter, schema_types, tool_parameters
from ._text import settled, split_reasoning

THINK = ("<seed:think>", "</seed:think>")
SECTION, SECTION_END = "<seed:tool_call>", "</seed:tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, *THINK, starts_in_reasoning, [SECTION])
    at = rest.find(SECTION)
    if at < 0:
        content = settled(rest, partial, [SECTION, *THINK])
        return ParseView(reasoning.strip(), content.strip())
    params = tool_parameters(tools)
    chunks = rest[at:].split(FUNCTION)[1:]
    calls = []
    for n, chunk in enumerate(chunks):
        view = _function(chunk, partial and n == len(chunks) - 1, params)
        if view is not None:
            calls.append(view)
    return ParseView(reasoning.strip(), rest[:at].strip(), tuple(calls))


def _function(chunk: str, partial: bool, params: dict[str, JsonObject]) -> ToolCallView | None:
    head = chunk.find(">")
    if head < 0:
        return None
    name = chunk[:head].strip()
    end = chunk.find(FUNCTION_END)
    closed = end >= 0 or not partial
    body = chunk[head + 1:end if end >= 0 else len(chunk)]
    properties = (params.get(name) or {}).get("properties") or {}
    pieces = []
    for key, value in _PARAM.findall(body):
        key = key.strip()
        types = schema_types(properties.get(key)) if isinstance(properties, dict) else frozenset()
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {coerce_parameter(value, types)}")
    if not pieces and not closed:
        return ToolCallView(name, "", False)
    return ToolCallView(name, "{" + ", ".join(pieces) + ("}" if closed else ""), closed)
