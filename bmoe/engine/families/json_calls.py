"""Families whose calls carry JSON arguments between markers: Llama 3.x, Mistral,
DeepSeek R1 / V3.1, Kimi K2.

Each reads ``<think>`` (Mistral: ``[THINK]``) reasoning, content up to the first call
marker, then the calls: a name between markers and a JSON object (partial arguments are
the JSON text so far, which only grows). Text after the calls begin is never content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from ..chatmarkup import THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import ParseView, ToolCallView
from ._text import json_args, json_end, settled, split_reasoning

Fix = Callable[[str], str]


def _calls_between(text: str, partial: bool, begin: str, sep: str, ends: Sequence[str],
                   fix_name: Fix = str.strip, skip: Fix = lambda s: s,
                   call_id: Fix = lambda s: "") -> list[ToolCallView]:
    calls = []
    chunks = text.split(begin)[1:]
    for n, chunk in enumerate(chunks):
        open_ = partial and n == len(chunks) - 1
        at = chunk.find(sep)
        if at < 0:
            if not open_ and fix_name(chunk):
                calls.append(ToolCallView(fix_name(chunk), "{}", True))
            continue
        name = fix_name(chunk[:at])
        args, _, complete = json_args(skip(chunk[at + len(sep):]), open_, ends)
        if name:
            calls.append(ToolCallView(name, args, complete or not open_, call_id(chunk[:at])))
    return calls


def _sectioned(text: str, partial: bool, starts: bool, section: str,
               read_calls: Callable[[str, bool], list[ToolCallView]],
               think: tuple[str, str] = (THINK_OPEN, THINK_CLOSE),
               markers: Sequence[str] = ()) -> ParseView:
    reasoning, rest = split_reasoning(text, partial, *think, starts, [section])
    at = rest.find(section)
    if at < 0:
        content = settled(rest, partial, [section, *think, *markers])
        return ParseView(reasoning.strip(), content.strip())
    return ParseView(reasoning.strip(), rest[:at].strip(),
                     tuple(read_calls(rest[at + len(section):], partial)))


# -- DeepSeek ---------------------------------------------------------------

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def parse_deepseek_v31(text: str, partial: bool, tools: list[JsonObject] | None,
                       starts_in_reasoning: bool) -> ParseView:
    return _sectioned(text, partial, starts_in_reasoning, DS_CALLS, lambda rest, p: _calls_between(
        rest, p, DS_CALL, DS_SEP, [DS_CALL_END, DS_CALLS_END]))


def _r1_args(text: str) -> str:
    return re.sub(r"^\s*```(?:json)?\s*", "", text)


def parse_deepseek_r1(text: str, partial: bool, tools: list[JsonObject] | None,
                      starts_in_reasoning: bool) -> ParseView:
    """R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``."""
    def read(rest: str, p: bool) -> list[ToolCallView]:
        calls = []
        chunks = rest.split(DS_CALL)[1:]
        for n, chunk in enumerate(chunks):
            open_ = p and n == len(chunks) - 1
            head, _, tail = chunk.partition(DS_SEP)
            name, newline, body = tail.partition("\n")
            if not newline:
                continue
            args, _, complete = json_args(_r1_args(body), open_, ["```", DS_CALL_END])
            calls.append(ToolCallView(name.strip(), args, complete or not open_))
        return calls
    return _sectioned(text, partial, starts_in_reasoning, DS_CALLS, read)


# -- Kimi K2 ----------------------------------------------------------------

KIMI_SECTION, KIMI_CALL = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
KIMI_ARGS, KIMI_END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _kimi_name(raw: str) -> str:
    """``functions.NAME:0`` is the call's id; the name sits between."""
    name = raw.strip()
    name = name[len("functions."):] if name.startswith("functions.") else name
    return re.sub(r":\d+$", "", name)


def parse_kimi(text: str, partial: bool, tools: list[JsonObject] | None,
               starts_in_reasoning: bool) -> ParseView:
    return _sectioned(text, partial, starts_in_reasoning, KIMI_SECTION, lambda rest, p: _calls_between(
        rest, p, KIMI_CALL, KIMI_ARGS, [KIMI_END], _kimi_name, call_id=str.strip))


# -- Mistral / Devstral / Magistral -------------------------------------------

M_CALLS, M_ARGS, M_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
M_THINK = ("[THINK]", "[/THINK]")


def _mistral_calls(rest: str, partial: bool) -> list[ToolCallView]:
    calls: list[ToolCallView] = []
    chunks = rest.split(M_CALLS)
    for n, chunk in enumerate(chunks):
        open_ = partial and n == len(chunks) - 1
        body = chunk.lstrip()
        if body.startswith("["):                       # [{"name": ..., "arguments": ...}, ...]
            calls += _json_list(body, open_)
        elif M_ARGS in chunk:
            name, _, call_id = chunk[:chunk.find(M_ARGS)].partition(M_CALL_ID)
            args, _, complete = json_args(chunk[chunk.find(M_ARGS) + len(M_ARGS):], open_,
                                          [M_CALLS, "</s>"])
            calls.append(ToolCallView(name.strip(), args, complete or not open_,
                                      call_id.strip()))
    return calls


def _json_list(body: str, partial: bool) -> list[ToolCallView]:
    end = json_end(body, 0)
    if end is None:
        return []
    try:
        items = json.loads(body[:end])
    except ValueError:
        return []
    return [ToolCallView(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False), True,
                         _own_id(i))
            for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]


def _own_id(item: dict, key: str = "id") -> str:
    """A JSON call's own id (Mistral Nemo's ``"id"``), when it wrote one."""
    value = item.get(key)
    return value if isinstance(value, str) else ""


def parse_mistral(text: str, partial: bool, tools: list[JsonObject] | None,
                  starts_in_reasoning: bool) -> ParseView:
    return _sectioned(text, partial, starts_in_reasoning, M_CALLS, _mistral_calls, M_THINK)


# -- Llama 3.x ----------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str, partial: bool, tools: list[JsonObject] | None,
                 starts_in_reasoning: bool) -> ParseView:
    """``{"name": ..., "parameters": ...}`` as the whole answer, after an optional
    ``<|python_tag|>``; several may follow each other (``;`` between them)."""
    reasoning, rest = split_reasoning(text, partial, THINK_OPEN, THINK_CLOSE,
                                      starts_in_reasoning, [PYTHON_TAG])
    at = rest.find(PYTHON_TAG)
    head, body = (rest[:at], rest[at + len(PYTHON_TAG):]) if at >= 0 else ("", rest)
    stripped = body.lstrip()
    if not stripped.startswith("{"):
        if partial and (at >= 0 or stripped) and '{"name"'.startswith(stripped[:7]):
            return ParseView(reasoning.strip())
        return ParseView(reasoning.strip(), settled(rest, partial, [PYTHON_TAG]).strip())
    calls, pos = [], len(body) - len(stripped)
    while pos < len(body):
        end = json_end(body, pos)
        if end is None:
            if partial:
                break
            return ParseView(reasoning.strip(), rest.strip())
        try:
            obj = json.loads(body[pos:end])
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return ParseView(reasoning.strip(), settled(rest, partial, []).strip())
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append(ToolCallView(obj["name"], json.dumps(args, ensure_ascii=False), True))
        nxt = re.match(r"[\s;]*", body[end:])
        pos = end + (nxt.end() if nxt else 0)
    return ParseView(reasoning.strip(), head.strip(), tuple(calls))
