"""Unknown templates: llama.cpp's generic JSON answer, ``{"tool_calls": [{"name": ...,
"arguments": {...}}]}`` (or ``{"tool_call": {...}}``), or ``{"response": "..."}``.
Any other text is content. A JSON answer is held until it is whole."""

from __future__ import annotations

import json

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ._text import json_end, split_reasoning


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE,
                                      starts_in_reasoning, [])
    body = rest.strip()
    if not body.startswith("{"):
        return ParseView(reasoning.strip(), body)
    end = json_end(body, 0)
    if end is None:
        return ParseView(reasoning.strip(), "" if partial else body)
    try:
        obj = json.loads(body[:end])
    except ValueError:
        return ParseView(reasoning.strip(), body)
    if not isinstance(obj, dict):
        return ParseView(reasoning.strip(), body)
    items = obj.get("tool_calls", [obj["tool_call"]] if isinstance(obj.get("tool_call"), dict) else None)
    if isinstance(items, list):
        calls = tuple(ToolCallView(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False),
                                   True, i["id"] if isinstance(i.get("id"), str) else "")
                      for i in items if isinstance(i, dict) and isinstance(i.get("name"), str))
        return ParseView(reasoning.strip(), "", calls)
    if isinstance(obj.get("response"), str):
        return ParseView(reasoning.strip(), obj["response"].strip())
    return ParseView(reasoning.strip(), body)
