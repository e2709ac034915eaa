"""The markup of a chat model's output: reasoning tags and the two tool-call framings.

Shared by the output parser (`chatparse`), the call parsers (`hermes_calls`,
`coder_calls`) and the grammar builder (`grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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
