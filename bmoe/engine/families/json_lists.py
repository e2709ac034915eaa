"""Families that write their calls as one JSON list between markers: Apertus and
Command R7B.

* Apertus: ``<|inner_prefix|>`` reasoning ``<|inner_suffix|>``, then
  ``<|tools_prefix|>[{"NAME": {args}}, ...]<|tools_suffix|>``.
* Command R7B: ``<|START_THINKING|>`` reasoning ``<|END_THINKING|>``, content between
  ``<|START_RESPONSE|>`` and ``<|END_RESPONSE|>``, calls as
  ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "NAME", "parameters": {...}}]
  <|END_ACTION|>``.

Each object of the list is a call once it closes (a partial list shows the closed ones).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..chatparse import ParseView, ToolCallView
from ..chatmarkup import JsonObject
from ._text import json_end, settled, split_reasoning

APERTUS_THINK = ("<|inner_prefix|>", "<|inner_suffix|>")
APERTUS_CALLS, APERTUS_END = "<|tools_prefix|>", "<|tools_suffix|>"
R7B_THINK = ("<|START_THINKING|>", "<|END_THINKING|>")
R7B_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
R7B_CALLS, R7B_END = "<|START_ACTION|>", "<|END_ACTION|>"

Read = Callable[[Any], "ToolCallView | None"]


def _apertus_call(obj: Any) -> ToolCallView | None:
    if isinstance(obj, dict) and len(obj) == 1:
        ((name, args),) = obj.items()
        return ToolCallView(name, json.dumps(args, ensure_ascii=False), True)
    return None


def _r7b_call(obj: Any) -> ToolCallView | None:
    if isinstance(obj, dict) and isinstance(obj.get("tool_name"), str):
        own = obj.get("tool_call_id")
        return ToolCallView(obj["tool_name"], json.dumps(obj.get("parameters", {}),
                                                         ensure_ascii=False), True,
                            own if isinstance(own, str) else "")
    return None


def _list_items(text: str) -> list[Any]:
    """The JSON objects of a list that have closed (the list itself may still be open)."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    items: list[Any] = []
    pos = 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body) or body[pos] != "{":
            return items
        end = json_end(body, pos)
        if end is None:
            return items
        try:
            items.append(json.loads(body[pos:end]))
        except ValueError:
            return items
        pos = end


def _parse(text: str, partial: bool, starts: bool, think: tuple[str, str], section: str,
           read: Read, drop: Sequence[str] = ()) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, *think, starts, [section])
    at = rest.find(section)
    head = rest if at < 0 else rest[:at]
    if at < 0:
        head = settled(head, partial, [section, *think, *drop])
    for marker in drop:
        head = head.replace(marker, "")
    calls = []
    if at >= 0:
        for obj in _list_items(rest[at + len(section):]):
            view = read(obj)
            if view is not None:
                calls.append(view)
    return ParseView(reasoning.strip(), head.strip(), tuple(calls))


def parse_apertus(text: str, partial: bool, tools: list[JsonObject] | None,
                  starts_in_reasoning: bool) -> ParseView:
    return _parse(text, partial, starts_in_reasoning, APERTUS_THINK, APERTUS_CALLS, _apertus_call)


def parse_command_r7b(text: str, partial: bool, tools: list[JsonObject] | None,
                      starts_in_reasoning: bool) -> ParseView:
    return _parse(text, partial, starts_in_reasoning, R7B_THINK, R7B_CALLS, _r7b_call,
                  R7B_RESPONSE)
