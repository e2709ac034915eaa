"""The protocols' encoders and decoders, sans-I/O: events in, bytes out; bodies in, turns
out. No model, no socket: each test feeds events by hand."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from bmoe.engine.chatparse import BlockAppend, BlockClose, BlockOpen, ParseView, ToolCallView
from bmoe.engine.errors import EngineError, context_full
from bmoe.http.errors import HTTPError
from bmoe.runtime.turnevents import (
    Failed,
    Finished,
    Opened,
    Ping,
    ReasoningDelta,
    Reset,
    Started,
    Stopped,
    TextDelta,
    ToolArgsDelta,
    ToolCallStart,
    Waiting,
)
from bmoe.server import shapes, wire
from bmoe.server.protocols import anthropic, openai_chat, responses


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=lambda: {"n-predict": 0, "think": True})
    user_keys: list[str] = field(default_factory=list)


def finished(view: ParseView, finish: str = "stop", **kw: Any) -> Finished:
    return Finished(model="tiny.gguf", view=view, finish=finish, n_prompt=10, n_prefilled=4,
                    n_cached=6, n_output=5, reasoning_tokens=2, summary={"tokens": 5}, **kw)


def sse(data: bytes) -> list[tuple[str | None, Any]]:
    """The events of an SSE byte string: (event name or None, decoded data or comment)."""
    out: list[tuple[str | None, Any]] = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        name, payload = None, None
        for line in block.split("\n"):
            if line.startswith(":"):
                out.append((None, line[1:].strip()))
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = line[6:]
        if payload is not None:
            out.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return out


CALL = ToolCallView(name="get_weather", arguments_text='{"city": "Paris"}', complete=True)


# -- OpenAI chat ---------------------------------------------------------------------------

def test_chat_stream_bytes() -> None:
    enc = openai_chat.ChatEncoder(include_usage=True, created=7)
    out = b"".join(enc.encode(ev) for ev in [
        Opened(""), Waiting(), Started("tiny.gguf"), ReasoningDelta("hm"), TextDelta("Hi"),
        Reset("Hi!", "hm"), ToolCallStart(0, "call_1", "get_weather"),
        ToolArgsDelta(0, '{"city": "Paris"}'), Stopped("stop"),
        finished(ParseView(content="Hi!", tool_calls=(CALL,)))])
    events = sse(out)
    assert events[0] == (None, "waiting for a turn")
    chunks = [data for _, data in events[1:-1]]
    assert all(c["model"] == "tiny.gguf" and c["created"] == 7 for c in chunks)
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas[:3] == [{"role": "assistant", "content": None}, {"reasoning_content": "hm"},
                          {"content": "Hi"}]
    assert chunks[3]["bmoe"] == {"reset": True} and deltas[3]["content"] == "Hi!"
    assert deltas[4]["tool_calls"][0]["id"] == "call_1"
    assert deltas[5]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert chunks[6]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[7]["usage"]["prompt_tokens_details"]["cached_tokens"] == 6
    assert events[-1] == (None, "[DONE]")


def test_chat_whole_and_error() -> None:
    enc = openai_chat.ChatEncoder()
    body = enc.whole(finished(ParseView(reasoning="r", tool_calls=(CALL,)), call_ids=("c9",)))
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] == "r"
    assert msg["tool_calls"][0]["id"] == "c9"
    assert body["usage"]["total_tokens"] == 15
    err = sse(enc.encode(Failed(context_full(5000, 4096))))
    assert err[0][1]["error"]["code"] == "context_full"
    assert "Context" in err[0][1]["error"]["message"]        # the label, not {ctx-size}
    assert err[-1] == (None, "[DONE]")


# -- Anthropic Messages -----------------------------------------------------------------------

def test_messages_stream_bytes() -> None:
    enc = anthropic.MessagesEncoder()
    out = b"".join(enc.encode(ev) for ev in [
        Opened(""), Waiting(), Started("tiny.gguf"),
        BlockOpen(0, "reasoning"), BlockAppend(0, "reasoning", "hm"),
        BlockClose(0, "reasoning", "hm"),
        BlockOpen(1, "tool_call", "toolu_1", "get_weather"),
        BlockAppend(1, "tool_call", "{}"), BlockClose(1, "tool_call", "{}"), Ping(),
        Stopped("stop"), finished(ParseView(reasoning="hm", tool_calls=(CALL,)))])
    names = [name for name, _ in sse(out)]
    assert names == ["ping", "message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "ping", "message_delta",
                     "message_stop"]
    delta = sse(out)[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 6,
                              "cache_creation_input_tokens": 0, "output_tokens": 5}


def test_messages_full_context_is_prompt_too_long() -> None:
    err = shapes.anthropic_engine_error(context_full(5000, 4096))
    assert err.message.startswith("prompt is too long: 5000 tokens > 4096 maximum.")
    name, data = sse(anthropic.MessagesEncoder().encode(Failed(context_full(5000, 4096))))[0]
    assert name == "error" and data["error"]["type"] == "invalid_request_error"


def test_messages_whole() -> None:
    body = anthropic.MessagesEncoder().whole(finished(ParseView(content="ok"), finish="length"))
    assert body["content"] == [{"type": "text", "text": "ok"}]
    assert body["stop_reason"] == "max_tokens" and body["model"] == "tiny.gguf"


# -- Responses ---------------------------------------------------------------------------------

def test_responses_stream_numbers_every_event() -> None:
    enc = responses.ResponsesEncoder({"store": False}, created=3)
    out = b"".join(enc.encode(ev) for ev in [
        Opened("tiny.gguf"), Started("tiny.gguf"), BlockOpen(0, "text"),
        BlockAppend(0, "text", "Hel"), Stopped("length"), BlockAppend(0, "text", "lo"),
        BlockClose(0, "text", "Hello"), finished(ParseView(content="Hello"), finish="length")])
    events = sse(out)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.incomplete"
    done = [d for n, d in events if n == "response.output_item.done"][0]
    assert done["item"]["status"] == "incomplete"            # closed after the stop
    usage = events[-1][1]["response"]["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 2


def test_responses_failed_and_context_code() -> None:
    enc = responses.ResponsesEncoder({})
    events = sse(enc.encode(Failed(context_full(9, 8))))
    assert [n for n, _ in events] == ["response.created", "response.failed"]
    assert events[1][1]["response"]["error"]["code"] == "context_length_exceeded"
    busy = sse(responses.ResponsesEncoder({}).encode(Failed(HTTPError(503, "busy", "Busy."))))
    assert busy[1][1]["response"]["error"]["code"] == "server_error"


# -- decoders and wire models ------------------------------------------------------------------

def test_chat_decode_builds_the_turn() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    req = openai_chat.decode({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                              "tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}},
                              "unknown_field": 1}, Config())
    assert req.tool_choice == "required" and req.named_tool == "get_weather"


@pytest.mark.parametrize("body,path", [
    ({"messages": "hi"}, "`messages` must be an array"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "`stream` must be true"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": 3},
     "`tool_choice` must be one of \"auto\", \"none\" or \"required\", or an object"),
    ({}, "`messages` is required"),
])
def test_chat_wire_errors_name_the_field(body: dict[str, Any], path: str) -> None:
    with pytest.raises(HTTPError) as info:
        openai_chat.decode(body, Config())
    assert info.value.status == 400 and info.value.code == "invalid_request"
    assert info.value.message.startswith(path)


def test_schema_and_required_call_conflict() -> None:
    tools = [{"name": "t", "input_schema": {"type": "object"}}]
    with pytest.raises(HTTPError, match="cannot be combined"):
        anthropic.decode({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                          "tool_choice": {"type": "any"},
                          "output_config": {"format": {"type": "json_schema",
                                                       "schema": {"type": "object"}}}},
                         Config())


def test_decide_body_paths() -> None:
    with pytest.raises(HTTPError, match=r"`choices\[1\]` must be a string"):
        wire.parse(wire.DecideBody, {"choices": ["a", 3]})
    with pytest.raises(HTTPError, match="`choices` is empty"):
        wire.parse(wire.DecideBody, {"choices": []})
    assert wire.parse(wire.DecideBody, {"choices": ["a"], "extra": True}).choices == ["a"]


def test_engine_error_carries_its_numbers() -> None:
    e = context_full(5000, 4096)
    assert (e.code, e.param, e.n_prompt, e.n_ctx) == ("context_full", "ctx-size", 5000, 4096)
    assert isinstance(e, EngineError)
