"""`/v1/responses` end to end: a real bmoe-server, the real engine, the official openai SDK.

The tiny model has random weights: these tests check shapes, event sequences, counts
and token accounting, never prose.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from _protocol_support import keyed_server_at, open_stream, sse, think_server_at, wait_generating
from conftest import ServerProcess, start_server

from bmoe.server import wire
from bmoe.server.protocols import responses as responses_api

NO_THINK = {"effort": "none"}
KEY = "test-key-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather here.",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                          "required": ["unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The time.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"], "additionalProperties": False}}
ANSWER = {"format": {"type": "json_schema", "name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False}}}
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 1200   # far beyond 2048 tokens
THINK_SPAN = 8   # see test_anthropic.py: the generation prompt's empty think span


OPEN_CLIENTS: list[Any] = []


def client(server: ServerProcess, key: str | None = None) -> openai.OpenAI:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key or server.key or "none",
                      _strict_response_validation=True, max_retries=0, timeout=120)
    OPEN_CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Each test's SDK clients are closed after it, their pooled sockets with them."""
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from think_server_at(tmp_path_factory.mktemp("responses-think"))


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path
                 ) -> Iterator[ServerProcess]:
    yield from keyed_server_at(tmp_path_factory.mktemp("responses-keyed"), tiny_moe, KEY)


def as_input(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


# -- request translation (no server) -------------------------------------------------------------

ONE_TURN: Any = [
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
     "content": [{"type": "reasoning_text", "text": "Let me check."}],
     "encrypted_content": "opaque"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"unit\": \"c\"}"},
    {"type": "function_call", "call_id": "call_2", "name": "get_time",
     "arguments": "{\"zone\": \"utc\"}"}]
OUTPUTS: Any = [
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "12:00"}]}]


def test_input_items_become_template_messages() -> None:
    body = {"instructions": "I", "input": [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        *ONE_TURN, *OUTPUTS,
        {"type": "message", "role": "system", "content": "later"},
        {"role": "user", "content": "Q2"}]}
    messages, images = responses_api.convert_input(wire.parse(responses_api.ResponsesBody, body))
    assert len(images) == 0
    assert messages == [
        {"role": "system", "content": "I\n\nD"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Let me check.",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"unit": "c"}}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "user", "content": "later"},
        {"role": "user", "content": "Q2"}]


def test_only_function_tools_are_described() -> None:
    tools = responses_api.convert_tools(wire.parse(responses_api.ResponsesBody, {"input": "x", "tools": [
        {"type": "web_search"}, WEATHER, {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "mcp"}]}).tools)
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather here.",
        "parameters": WEATHER["parameters"]}}]


# -- answers ----------------------------------------------------------------------------------

def test_create_answers_a_message(server: ServerProcess, tiny_moe: Path) -> None:
    r = client(server).responses.create(model="any", input="Hello.", max_output_tokens=16,
                                        reasoning=NO_THINK, store=False)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == tiny_moe.name
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    message: Any = r.output[0]
    assert [part.type for part in message.content] == ["output_text"]
    assert r.output_text
    usage = r.usage
    assert usage is not None and usage.output_tokens == 16
    assert usage.total_tokens == usage.input_tokens + 16
    assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert r.model_extra is not None and r.model_extra["bmoe"]["summary"]["tokens"] == 16


def test_stream_with_get_final_response(server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": "x", "input": "Is water wet?", "reasoning": NO_THINK,
                            "text": ANSWER}
    full = c.responses.create(**args)
    assert full.status == "completed" and full.incomplete_details is None
    with c.responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert final.status == "completed" and final.output_text == full.output_text
    assert isinstance(json.loads(final.output_text)["ok"], bool)
    assert final.usage is not None and full.usage is not None
    assert final.usage.output_tokens == full.usage.output_tokens


def test_events_are_named_typed_and_numbered(server: ServerProcess) -> None:
    conn, resp = open_stream(server, "/v1/responses", {
        "input": "Hi.", "max_output_tokens": 8, "stream": True, "reasoning": NO_THINK})
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = sse(resp.read())
    conn.close()
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.incomplete"
    last = events[-1][1]["response"]
    assert last["status"] == "incomplete"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == 8 and last["bmoe"]["summary"]["tokens"] == 8
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert last["output"][0]["content"][0]["text"] == text


# -- function calls ------------------------------------------------------------------------------

def _calls(r: Any) -> list[Any]:
    return [item for item in r.output if item.type == "function_call"]


def test_forced_function_call_round_trip(server: ServerProcess) -> None:
    c = client(server)
    question = [{"role": "user", "content": "What is the weather?"}]
    first = c.responses.create(model="x", input=question,  # type: ignore[arg-type]
                               tools=[WEATHER, TIME], tool_choice="required",
                               reasoning=NO_THINK, max_output_tokens=120)
    calls = _calls(first)
    assert calls and all(item.type == "function_call" for item in first.output)
    assert {item.name for item in calls} <= {"get_weather", "get_time"}
    assert json.loads(calls[0].arguments) in ({"unit": "c"}, {"unit": "f"}, {"zone": "utc"},
                                              {"zone": "cet"})
    assert all(item.call_id.startswith("call_") for item in calls)
    assert [t.name for t in first.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    outputs = [{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny."}
               for item in calls]
    second = c.responses.create(model="x", input=[*question, *as_input(first.output), *outputs],
                                tools=[WEATHER, TIME], reasoning=NO_THINK, text=ANSWER)
    assert second.status == "completed"
    assert [item.type for item in second.output] == ["message"]
    json.loads(second.output_text)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - THINK_SPAN


def test_named_function_streams_as_a_function_call_item(server: ServerProcess) -> None:
    c = client(server)
    with c.responses.stream(model="x", input="What time is it?", tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "name": "get_time"},
                            reasoning=NO_THINK, max_output_tokens=120) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added and all(item.type == "function_call" and item.name == "get_time"
                         for item in added)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    for index, item in enumerate(done):
        pieces = "".join(e.delta for e in events if e.type ==
                         "response.function_call_arguments.delta" and e.output_index == index)
        assert item.arguments == pieces and item.call_id == added[index].call_id
    assert json.loads(done[0].arguments) in ({"zone": "utc"}, {"zone": "cet"})
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.call_id for item in final.output] == [item.call_id for item in done]


def test_other_tool_types_are_dropped(server: ServerProcess) -> None:
    r = client(server).responses.create(
        model="x", input="Hi.", reasoning=NO_THINK, max_output_tokens=2,
        tools=[{"type": "web_search"}, WEATHER,  # type: ignore[list-item]
               {"type": "custom", "name": "apply_patch", "description": "Edit files."}])
    assert [t.type for t in r.tools] == ["function"]


# -- input items ----------------------------------------------------------------------------------

def test_instructions_and_system_items_keep_the_prefix(server: ServerProcess) -> None:
    c = client(server)
    question: Any = [{"role": "developer", "content": "Answer briefly."},
                     {"role": "user", "content": [{"type": "input_text", "text": "Rivers?"}]}]
    a = c.responses.create(model="x", instructions="You are terse.", input=question,
                           reasoning=NO_THINK, max_output_tokens=6)
    later: Any = [*question, *as_input(a.output),
                  {"role": "system", "content": "Reminder: be terse."},
                  {"type": "message", "role": "user", "content": "And lakes?"}]
    b = c.responses.create(model="x", instructions="You are terse.", input=later,
                           reasoning=NO_THINK, max_output_tokens=2)
    assert a.usage is not None and b.usage is not None
    assert b.usage.input_tokens_details.cached_tokens >= a.usage.input_tokens - THINK_SPAN


def test_a_model_turn_sent_back_is_accepted(server: ServerProcess) -> None:
    r = client(server).responses.create(
        model="x", input=[{"role": "user", "content": "Weather and time?"}, *ONE_TURN, *OUTPUTS],
        tools=[WEATHER, TIME], reasoning=NO_THINK, max_output_tokens=3)
    assert r.usage is not None and r.usage.output_tokens == 3


# -- thinking ---------------------------------------------------------------------------------

def test_reasoning_on_and_off(think_server: ServerProcess) -> None:
    c = client(think_server)
    on = c.responses.create(model="x", input="Think.", reasoning={"effort": "high"},
                            max_output_tokens=20)
    assert on.output[0].type == "reasoning"
    content = on.output[0].content  # type: ignore[union-attr]
    assert content and content[0].type == "reasoning_text" and content[0].text
    assert on.usage is not None and on.usage.output_tokens_details.reasoning_tokens > 0
    off = c.responses.create(model="x", input="Think.", reasoning=NO_THINK, max_output_tokens=20)
    assert off.output and all(item.type != "reasoning" for item in off.output)
    assert off.usage is not None and off.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_streams_as_a_reasoning_item(think_server: ServerProcess) -> None:
    c = client(think_server)
    with c.responses.stream(model="x", input="Think.", reasoning={"effort": "low"},
                            max_output_tokens=20) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == ["response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"][0]
    assert done.type == "reasoning" and done.content[0].text == deltas  # type: ignore[union-attr]
    # The reasoning item goes back in the next request as it came.
    again = c.responses.create(model="x", input=[{"role": "user", "content": "Think."},
                                                 *as_input([done]),
                                                 {"role": "user", "content": "More."}],
                               reasoning=NO_THINK, max_output_tokens=2)
    assert again.usage is not None and again.usage.output_tokens == 2


# -- refusals and errors -------------------------------------------------------------------------

@pytest.mark.parametrize("extra,why", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
])
def test_stateful_fields_are_refused(server: ServerProcess, extra: dict[str, Any],
                                     why: str) -> None:
    args: dict[str, Any] = {"model": "x", "input": "Hi.", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client(server).responses.create(**args)
    assert info.value.code == "invalid_request", why
    assert info.value.body["type"] == "invalid_request_error", why  # type: ignore[index]
    assert "param" in info.value.body, why  # type: ignore[operator]


@pytest.mark.parametrize("body,why", [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f1"}]}]},
     "a file part"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f1"}]}]},
     "an image by file id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://example.com/a.png"}]}]},
     "an image by URL"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "an unknown item"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The"}]},
     "ends with the assistant"),
    ({"input": "x", "tool_choice": "required"}, "required without tools"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "unknown named function"),
    ({"input": "x", "max_output_tokens": -3}, "negative budget"),
    ({"input": 5}, "input a number"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "unknown text format"),
])
def test_bad_requests_are_400_in_the_responses_shape(server: ServerProcess, body: dict[str, Any],
                                                     why: str) -> None:
    status, _, answer = server.request("POST", "/v1/responses", {"model": "x", **body})
    assert status == 400, why
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, why
    assert error["type"] == "invalid_request_error" and error["message"], why


@pytest.mark.parametrize("stream", [False, True])
def test_full_context_is_context_length_exceeded(keyed_server: ServerProcess,
                                                 stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(keyed_server).responses.create(model="x", input=LONG_TEXT, stream=stream)
    assert info.value.code == "context_length_exceeded"
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_failure_inside_a_stream_is_response_failed(keyed_server: ServerProcess) -> None:
    """A request that waited in line gets comments, then its refusal as `response.failed`."""
    hold: dict[str, Any] = {}

    def long_turn() -> None:
        hold["resp"] = keyed_server.request("POST", "/v1/responses", {
            "input": "Go on.", "max_output_tokens": 3000, "reasoning": NO_THINK})

    t = threading.Thread(target=long_turn)
    t.start()
    wait_generating(keyed_server, True, 20)
    conn, resp = open_stream(keyed_server, "/v1/responses", {"input": LONG_TEXT, "stream": True})
    assert resp.status == 200
    head = resp.readline()
    assert head == b"event: response.created\n"
    keyed_server.request("POST", "/api/cancel")
    events = sse(head + resp.read())
    conn.close()
    t.join(30)
    cancelled = hold["resp"][2]
    assert cancelled["status"] == "incomplete"
    assert cancelled["incomplete_details"] == {"reason": "cancelled"}
    named = [(n, d) for n, d in events if n != "comment"]
    assert ("comment", "waiting for a turn") in events
    assert [n for n, _ in named] == ["response.created", "response.failed"]
    assert all(n == d["type"] for n, d in named)
    assert [d["sequence_number"] for _, d in named] == [0, 1]
    failed = named[1][1]["response"]
    assert failed["status"] == "failed" and failed["id"] == named[0][1]["response"]["id"]
    assert failed["error"]["code"] == "context_length_exceeded"


def test_access_refusals_take_the_responses_shape(keyed_server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(keyed_server, key="wrong").responses.create(model="x", input="Hi.")
    assert set(info.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    r = client(keyed_server).responses.create(model="x", input="Hi.", reasoning=NO_THINK,
                                              max_output_tokens=2)
    assert r.usage is not None and r.usage.output_tokens == 2


def test_no_model_is_503_in_the_responses_shape(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "data", wait_ready=False)   # state "empty"
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client(srv).responses.create(model="x", input="Hi.")
        assert info.value.status_code == 503 and info.value.code == "no_model"
    finally:
        srv.stop()


# -- disconnects ------------------------------------------------------------------------------

def test_disconnect_cancels_that_turn_only(server: ServerProcess) -> None:
    conn, resp = open_stream(server, "/v1/responses", {
        "input": "Talk for a long time.", "stream": True, "max_output_tokens": 3500,
        "reasoning": NO_THINK})
    assert resp.status == 200
    assert resp.readline() == b"event: response.created\n"
    wait_generating(server, True, 20)
    waiting: dict[str, Any] = {}

    def next_turn() -> None:
        waiting["r"] = client(server).responses.create(model="x", input="Next.",
                                                       reasoning=NO_THINK, max_output_tokens=20)

    t = threading.Thread(target=next_turn)
    t.start()
    time.sleep(0.2)   # the next request takes its place in line behind the stream
    conn.sock.close()  # the streaming client goes away mid-answer
    conn.close()
    gone = time.monotonic()
    t.join(30)
    # The waiting turn ran whole, at once: the abandoned one (3500 tokens) was stopped.
    assert time.monotonic() - gone < 2.0
    r = waiting["r"]
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 20
    wait_generating(server, False, 1.5)
