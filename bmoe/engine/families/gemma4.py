"""Gemma 4: reasoning on a ``thought`` channel and calls in Gemma's own object syntax::

    <|channel>thought
    REASONING<channel|>CONTENT<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>

Keys are bare, strings sit between ``<|"|>`` marks (raw, never escaped), numbers,
``true`` / ``false`` / ``null``, ``[...]`` and nested ``{...}`` are as in JSON. Several
``thought`` blocks may come (all reasoning); a stray ``<|channel>`` or ``<channel|>`` is
dropped, as llama.cpp drops it. A partial call shows its arguments once its object closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..chatmarkup import JsonObject
from ..chatparse import ParseView, ToolCallView
from ._text import settled

TURN = "<|turn>model\n"
CHANNEL, CHANNEL_END, THOUGHT = "<|channel>", "<channel|>", "thought"
CALL, CALL_END, PREFIX = "<|tool_call>", "<tool_call|>", "call:"
QUOTE = '<|"|>'
MARKERS = (CHANNEL, CHANNEL_END, CALL, "<|turn>", "<turn|>")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    if text.startswith(TURN):
        text = text[len(TURN):]
    at = text.find(CALL)
    head = text if at < 0 else text[:at]
    reasoning, content = _channels(head, partial and at < 0, starts_in_reasoning)
    calls = _calls(text[at:], partial) if at >= 0 else []
    return ParseView("\n\n".join(r for r in reasoning if r), "".join(content).strip(),
                     tuple(calls))


def _channels(text: str, partial: bool, inside: bool) -> tuple[list[str], list[str]]:
    """The text's thought blocks and the content between them."""
    reasoning: list[str] = []
    content: list[str] = []
    while text:
        if inside:
            end = text.find(CHANNEL_END)
            if end < 0:
                reasoning.append(settled(text, partial, [CHANNEL_END]).strip())
                return reasoning, content
            reasoning.append(text[:end].strip())
            text, inside = text[end + len(CHANNEL_END):], False
            continue
        at = text.find(CHANNEL)
        piece = text if at < 0 else text[:at]
        if at < 0:
            piece = settled(piece, partial, MARKERS)
        content.append(piece.replace(CHANNEL_END, "").replace("<turn|>", ""))
        if at < 0:
            return reasoning, content
        text = text[at + len(CHANNEL):]
        while text.startswith(CHANNEL):                 # empty channels, consumed
            text = text[len(CHANNEL):]
        if text.startswith(THOUGHT):
            text, inside = text[len(THOUGHT):], True
        elif partial and THOUGHT.startswith(text):
            return reasoning, content                   # the channel's name still arriving
    return reasoning, content


def _calls(text: str, partial: bool) -> list[ToolCallView]:
    calls = []
    chunks = text.split(CALL)[1:]
    for n, chunk in enumerate(chunks):
        open_ = partial and n == len(chunks) - 1
        body = chunk.split(CALL_END)[0]
        if not body.startswith(PREFIX) and not (open_ and PREFIX.startswith(body)):
            continue
        brace = body.find("{")
        if brace < 0:
            if not open_ and body[len(PREFIX):].strip():
                calls.append(ToolCallView(body[len(PREFIX):].strip(), "{}", True))
            continue
        name = body[len(PREFIX):brace].strip()
        try:
            read = read_value(body, brace)
        except RecursionError:                          # nested past Python's stack
            read = None
        if read is None:
            if not open_:
                calls.append(ToolCallView(name, "{}", True))
            continue
        calls.append(ToolCallView(name, json.dumps(read[0], ensure_ascii=False), True))
    return calls


def read_value(text: str, pos: int) -> tuple[Any, int] | None:
    """The Gemma value starting at ``text[pos]`` and where it ends; None while it is
    still open or when it is not one."""
    pos = _skip(text, pos)
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        return None if end < 0 else (text[pos + len(QUOTE):end], end + len(QUOTE))
    if text.startswith("{", pos):
        return _read_dict(text, pos + 1)
    if text.startswith("[", pos):
        return _read_list(text, pos + 1)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if text.startswith(word, pos):
            return value, pos + len(word)
    number = _NUMBER.match(text, pos)
    if number is None or number.end() == len(text):
        return None                                      # a number may still grow
    return json.loads(number.group()), number.end()


def _read_dict(text: str, pos: int) -> tuple[Any, int] | None:
    out: dict[str, Any] = {}
    pos = _skip(text, pos)
    while pos < len(text):
        if text[pos] == "}":
            return out, pos + 1
        if text[pos] == ",":
            pos = _skip(text, pos + 1)
            continue
        colon = text.find(":", pos)
        if colon < 0 or "}" in text[pos:colon]:
            return None
        key = text[pos:colon].strip()
        if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
            key = key[len(QUOTE):-len(QUOTE)]
        read = read_value(text, colon + 1)
        if read is None:
            return None
        out[key], pos = read[0], _skip(text, read[1])
    return None


def _read_list(text: str, pos: int) -> tuple[Any, int] | None:
    out: list[Any] = []
    pos = _skip(text, pos)
    while pos < len(text):
        if text[pos] == "]":
            return out, pos + 1
        if text[pos] == ",":
            pos = _skip(text, pos + 1)
            continue
        read = read_value(text, pos)
        if read is None:
            return None
        out.append(read[0])
        pos = _skip(text, read[1])
    return None


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def write_value(value: Any) -> str:
    """A JSON value in Gemma's syntax (as the template's ``format_argument`` writes it)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return json.dumps(value)
