"""LFM2 / LFM2.5: optional ``<think>`` reasoning, content, then Python-style calls::

    <|tool_call_start|>[get_time(city="Paris"), Calendar.add(n=1, ok=True)]<|tool_call_end|>

Arguments are Python literals (``True`` / ``None``, and JSON's ``true`` / ``null`` too),
read by Python's own parser, never evaluated. Calls show once their list closes.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ._text import settled, split_reasoning

SECTION, SECTION_END = "<|tool_call_start|>", "<|tool_call_end|>"
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False,
          "null": None}


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE,
                                      starts_in_reasoning, [SECTION])
    at = rest.find(SECTION)
    if at < 0:
        content = settled(rest, partial, [SECTION, THINK_OPEN, THINK_CLOSE])
        return ParseView(reasoning.strip(), content.strip())
    calls: list[ToolCallView] = []
    for chunk in rest[at:].split(SECTION)[1:]:
        end = chunk.find(SECTION_END)
        if end < 0 and partial:
            break
        calls += read_calls(chunk[:end] if end >= 0 else chunk)
    return ParseView(reasoning.strip(), rest[:at].strip(), tuple(calls))


def read_calls(text: str) -> list[ToolCallView]:
    """``[f(a=1), g()]`` (or one call without brackets) as calls; [] when it is not."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    items = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args:
            return []
        name = _dotted(item.func)
        try:
            args = {kw.arg: _literal(kw.value) for kw in item.keywords if kw.arg is not None}
        except ValueError:
            return []
        if name is None:
            return []
        calls.append(ToolCallView(name, json.dumps(args, ensure_ascii=False), True))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                raise ValueError("a ** in a call's arguments")
            out[str(_literal(k))] = _literal(v)
        return out
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def write_value(value: Any) -> str:
    """A JSON value as a Python literal the model would write."""
    return json.dumps(value, ensure_ascii=False)
