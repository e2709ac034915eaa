"""gpt-oss's Harmony format: messages on channels, calls addressed to a recipient.

After the prompt's ``<|start|>assistant`` the model writes messages::

    [ to=functions.NAME]<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY<|end|>
    <|start|>assistant ...                       (the next message)

``analysis`` is reasoning, ``final`` (and ``commentary`` with no recipient) is content,
a recipient ``functions.NAME`` makes the body a call's JSON arguments (ended by
``<|call|>``). Messages to other recipients (built-in tools such as ``python``) are
dropped, as llama.cpp drops them.
"""

from __future__ import annotations

import re

from ..chatmarkup import JsonObject
from ..chatparse import ParseView, ToolCallView
from ._text import json_args, settled

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def parse(text: str, partial: bool, tools: list[JsonObject] | None,
          starts_in_reasoning: bool) -> ParseView:
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCallView] = []
    segments = text.split(START)
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment.startswith("assistant"):
            segment = segment[len("assistant"):]
        at = segment.find(MESSAGE)
        if at < 0:
            if not (partial and last) and CHANNEL not in segment and n == 0:
                content.append(segment.strip())      # plain text, no Harmony header
            continue
        header, body = segment[:at], segment[at + len(MESSAGE):]
        _read_message(header, body, partial and last, reasoning, content, calls)
    return ParseView("\n\n".join(r for r in reasoning if r),
                     "\n\n".join(c for c in content if c), tuple(calls))


def _read_message(header: str, body: str, partial: bool, reasoning: list[str],
                  content: list[str], calls: list[ToolCallView]) -> None:
    channels = _CHANNEL.findall(header)
    channel = channels[-1] if channels else "final"
    recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
    end = min((i for i in (body.find(m) for m in ENDS) if i >= 0), default=-1)
    closed = end >= 0
    body = body[:end] if closed else settled(body, partial, MARKERS)
    if recipients:
        if recipients[-1].startswith("functions."):
            args, _, complete = json_args(body, partial and not closed, ENDS)
            calls.append(ToolCallView(recipients[-1][len("functions."):], args,
                                      complete or closed or not partial))
        return
    (reasoning if channel == "analysis" else content).append(body.strip())
