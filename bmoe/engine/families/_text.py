"""Pieces every family's parser shares: held-back tails, reasoning spans, JSON extents."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..chatmarkup import _find_first, _held_tail
from ..chatparse import ToolCallView


def settled(text: str, partial: bool, markers: Sequence[str]) -> str:
    """``text`` without a tail that could still grow into one of ``markers``."""
    if not partial:
        return text
    return text[:len(text) - _held_tail(text, markers)]


def split_reasoning(text: str, partial: bool, opener: str, closer: str,
                    starts_inside: bool, stops: Sequence[str]) -> tuple[str, str]:
    """(reasoning, the rest). A span opens at the start (or the prompt left it open); a
    closer with no opener before any of ``stops`` makes everything before it reasoning."""
    body = text.lstrip()
    if not starts_inside and body.startswith(opener):
        starts_inside, text = True, body[len(opener):]
    at = text.find(closer)
    first_stop = _find_first(text, stops)
    if not starts_inside and (at < 0 or (first_stop is not None and first_stop[0] < at)):
        if partial and body and opener.startswith(body):
            return "", ""                    # maybe an opener still arriving
        return "", text
    if at < 0:
        return settled(text, partial, [closer, *stops]), ""
    return text[:at], text[at + len(closer):]


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``text[start]`` ends (after its last
    bracket), or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def json_args(text: str, partial: bool, stops: Sequence[str]) -> tuple[str, int, bool]:
    """A call's JSON arguments at the start of ``text``: (arguments text, where they end,
    complete). Partial arguments are the text so far (JSON text only grows)."""
    lead = len(text) - len(text.lstrip())
    if lead == len(text) or text[lead] not in "{[":
        hit = _find_first(text, stops)
        end = hit[0] if hit is not None else len(text)
        if partial and hit is None:
            return "", len(text), False
        return "{}", end, True
    closed = json_end(text, lead)
    if closed is None:
        if partial:
            return text[lead:], len(text), False
        hit = _find_first(text, stops)
        return text[lead:hit[0] if hit else len(text)].rstrip(), len(text), True
    return text[lead:closed], closed, True


def call(name: str, args: str, complete: bool) -> ToolCallView:
    return ToolCallView(name, args, complete)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
