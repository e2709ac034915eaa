"""DeepSeek V3.2 and V4: ``<think>`` reasoning and DSML calls::

    <｜DSML｜function_calls>                     (V4: <｜DSML｜tool_calls>)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="k" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="n" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"`` keeps the value as text, ``"false"`` reads it as JSON (a value that is
not JSON stays text). The thinking prompt leaves ``<think>`` open; the reasoning ends at
``</think>`` or where the calls begin. A partial call shows the parameters that closed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ..coder_calls import coerce_parameter, schema_types, tool_parameters
from ._text import settled, split_reasoning

DSML = "｜DSML｜"
INVOKE, INVOKE_END = f"<{DSML}invoke name=", f"</{DSML}invoke>"
PARAM_END = f"</{DSML}parameter>"
_NAME = re.compile(r'^\s*"([^"]*)"\s*>')
_PARAM = re.compile(f'<{DSML}parameter name="([^"]*)"(?:\\s+string="(true|false)")?\\s*>(.*?)'
                    f'{PARAM_END}', re.S)


def block(v4: bool) -> tuple[str, str]:
    name = "tool_calls" if v4 else "function_calls"
    return f"<{DSML}{name}>", f"</{DSML}{name}>"


def parser(v4: bool) -> Callable[[str, bool, "list[JsonObject] | None", bool], ParseView]:
    section = block(v4)[0]

    def parse(text: str, partial: bool, tools: list[JsonObject] | None,
              starts_in_reasoning: bool) -> ParseView:
        reasoning, rest = _reasoning(text, partial, starts_in_reasoning, section)
        at = rest.find(section)
        if at < 0:
            content = settled(rest, partial, [section, THINK_OPEN, THINK_CLOSE])
            return ParseView(reasoning.strip(), content.strip())
        params = tool_parameters(tools)
        chunks = rest[at:].split(INVOKE)[1:]
        calls = []
        for n, chunk in enumerate(chunks):
            view = _invoke(chunk, partial and n == len(chunks) - 1, params)
            if view is not None:
                calls.append(view)
        return ParseView(reasoning.strip(), rest[:at].strip(), tuple(calls))
    return parse


def _reasoning(text: str, partial: bool, starts: bool, section: str) -> tuple[str, str]:
    """As `split_reasoning`, but an open span also ends where the calls begin (the
    forced-call grammar may start them without ``</think>``)."""
    body = text.lstrip()
    inside = starts or body.startswith(THINK_OPEN)
    call_at = text.find(section)
    close_at = text.find(THINK_CLOSE)
    if inside and call_at >= 0 and (close_at < 0 or call_at < close_at):
        head = text.lstrip()[len(THINK_OPEN):] if not starts else text
        return head[:head.find(section)], head[head.find(section):]
    return split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE, starts, [section])


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
    for key, is_string, value in _PARAM.findall(body):
        if is_string == "true":
            text = json.dumps(value, ensure_ascii=False)
        elif is_string == "false":
            text = coerce_parameter(value, frozenset())
        else:
            types = schema_types(properties.get(key)) if isinstance(properties, dict) \
                else frozenset()
            text = coerce_parameter(value, types)
        pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {text}")
    if not pieces and not closed:
        return ToolCallView(name, "", False)
    return ToolCallView(name, "{" + ", ".join(pieces) + ("}" if closed else ""), closed)
