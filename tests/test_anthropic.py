"""`/v1/messages` end to end: a real bmoe-server, the real engine, the official anthropic SDK.

The tiny model has random weights: these tests check shapes, event sequences, counts
and token accounting, never prose.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest
from _protocol_support import keyed_server_at, open_stream, sse, think_server_at, wait_generating
from conftest import ServerProcess, start_server

from bmoe.http.errors import HTTPError
from bmoe.server import wire
from bmoe.server.protocols import anthropic as messages_api

NO_THINK = {"type": "disabled"}
KEY = "test-key-anthropic"
WEATHER = {"name": "get_weather", "description": "The weather where the user is.",
           "input_schema": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                            "required": ["unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time.",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                         "required": ["zone"], "additionalProperties": False}}
ANSWER = {"type": "json_schema", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False}}
# An answer given with thinking off follows an empty think span the template writes in the
# generation prompt only: a resent conversation matches the KV up to those few tokens.
THINK_SPAN = 8
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 1200   # far beyond 2048 tokens


OPEN_CLIENTS: list[Any] = []


def client(server: ServerProcess, key: str | None = None) -> anthropic.Anthropic:
    c = anthropic.Anthropic(base_url=server.url, api_key=key or server.key or "none",
                            _strict_response_validation=True, max_retries=0, timeout=120)
    OPEN_CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Each test's SDK clients are closed after it, their pooled sockets with them."""
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from think_server_at(tmp_path_factory.mktemp("anthropic-think"))


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path
                 ) -> Iterator[ServerProcess]:
    yield from keyed_server_at(tmp_path_factory.mktemp("anthropic-keyed"), tiny_moe, KEY)


# -- request translation (no server) -------------------------------------------------------------

def test_a_request_becomes_template_messages() -> None:
    body = {"system": [_billing("a5145"), {"type": "text", "text": "A", "cache_control": {}},
                       {"type": "text", "text": "B"}],
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "t", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "ans"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "note"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                        {"type": "text", "text": "r"},
                        {"type": "tool_reference", "tool_name": "g"}]}]},
                {"role": "system", "content": "later"},
                {"role": "user", "content": "Q2"}]}
    messages, images = messages_api.convert_messages(wire.parse(messages_api.MessagesBody, body))
    assert len(images) == 0
    assert messages == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "ans", "reasoning_content": "t", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "r\nTool loaded: g"},
        {"role": "user", "content": "note"},
        {"role": "user", "content": "later"},
        {"role": "user", "content": "Q2"}]


def tools_of(tools: list[dict[str, Any]]) -> Any:
    return wire.parse(messages_api.MessagesBody, {"messages": user("x"), "tools": tools}).tools


def test_tools_deferred_custom_and_server() -> None:
    tools = messages_api.convert_tools(tools_of([WEATHER, {**TIME, "defer_loading": True},
                                                 {**TIME, "name": "t2", "type": "custom"}]))
    assert [t["function"]["name"] for t in tools or []] == ["get_weather", "t2"]
    assert (tools or [])[0]["function"]["parameters"] == WEATHER["input_schema"]
    with pytest.raises(HTTPError):
        messages_api.convert_tools(tools_of([{"type": "bash_20250124", "name": "bash"}]))


# -- answers ----------------------------------------------------------------------------------

def test_create_answers_a_text_message(server: ServerProcess, tiny_moe: Path) -> None:
    msg = client(server).messages.create(model="any", max_tokens=16, messages=user("Hello."),
                                         thinking=NO_THINK)
    assert msg.id.startswith("msg_") and msg.model == tiny_moe.name
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 16
    assert msg.usage.input_tokens >= 1 and msg.usage.cache_read_input_tokens is not None
    summary = msg.model_extra["bmoe"]["summary"]
    assert summary["tokens"] == 16 and summary["n_prompt"] == msg.usage.input_tokens


def test_stream_sends_the_event_sequence_and_agrees_with_create(server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": "x", "max_tokens": 12, "thinking": NO_THINK,
                            "messages": user("Write three words about the sea.")}
    full = c.messages.create(**args)
    events = list(c.messages.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.stop_reason is None and start.content == []
    delta = events[-2]
    # the start says the whole prompt; the end how much of it the KV already held
    assert start.usage.output_tokens == 0 and start.usage.input_tokens > 0
    assert start.usage.input_tokens == \
        delta.usage.input_tokens + (delta.usage.cache_read_input_tokens or 0)
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 12
    assert delta.model_extra["bmoe"]["summary"]["tokens"] == 12
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == full.content[0].text

    with c.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == full.content[0].text
    assert final.usage.output_tokens == 12 and final.stop_reason == "max_tokens"


def test_every_event_is_named_as_its_type(server: ServerProcess) -> None:
    conn, resp = open_stream(server, "/v1/messages", key_header="X-Api-Key", body={
        "model": "x", "max_tokens": 8, "stream": True, "thinking": NO_THINK,
        "messages": user("Hi.")})
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = sse(resp.read())
    conn.close()
    assert all(name == data["type"] for name, data in events)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"


def test_an_output_schema_ends_the_turn(server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": "x", "max_tokens": 200, "thinking": NO_THINK,
                            "messages": user("Is water wet?"), "output_config": {"format": ANSWER}}
    msg = c.messages.create(**args)
    assert msg.stop_reason == "end_turn"
    assert isinstance(json.loads(msg.content[0].text)["ok"], bool)
    with c.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == msg.content[0].text


# -- tools --------------------------------------------------------------------------------------

def _tool_uses(msg: Any) -> list[Any]:
    return [b for b in msg.content if b.type == "tool_use"]


def test_forced_tool_use_create_and_stream(server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": "x", "max_tokens": 120, "thinking": NO_THINK,
                            "messages": user("What is the weather?"), "tools": [WEATHER, TIME],
                            "tool_choice": {"type": "any"}}
    msg = c.messages.create(**args)
    calls = _tool_uses(msg)
    assert calls and msg.stop_reason in ("tool_use", "max_tokens")
    assert all(b.type == "tool_use" for b in msg.content)
    assert {b.name for b in calls} <= {"get_weather", "get_time"}
    assert calls[0].input in ({"unit": "c"}, {"unit": "f"}, {"zone": "utc"}, {"zone": "cet"})
    assert all(b.id.startswith("toolu_") for b in calls)
    assert len({b.id for b in calls}) == len(calls)

    events = list(c.messages.create(stream=True, **args))
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts and all(e.content_block.type == "tool_use" for e in starts)
    pieces = [e.delta for e in events if e.type == "content_block_delta"]
    assert pieces and all(d.type == "input_json_delta" for d in pieces)
    first = "".join(e.delta.partial_json for e in events
                    if e.type == "content_block_delta" and e.index == 0)
    assert json.loads(first) == calls[0].input
    assert events[-2].delta.stop_reason == msg.stop_reason

    with c.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.input for b in _tool_uses(final)][0] == calls[0].input


def test_tool_choice_tool_forces_that_tool(server: ServerProcess) -> None:
    msg = client(server).messages.create(
        model="x", max_tokens=120, thinking=NO_THINK, messages=user("What time is it?"),
        tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    calls = _tool_uses(msg)
    assert calls and {b.name for b in calls} == {"get_time"}


def test_tool_result_round_trip(server: ServerProcess) -> None:
    c = client(server)
    first_turn = user("What is the weather?")
    first = c.messages.create(model="x", max_tokens=80, thinking=NO_THINK, messages=first_turn,
                              tools=[WEATHER], tool_choice={"type": "any"})
    calls = _tool_uses(first)
    assert calls
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "Sunny, 21 degrees."}
               for b in calls]
    messages = first_turn + [first.to_param(), {"role": "user", "content": results}]
    second = c.messages.create(model="x", max_tokens=200, thinking=NO_THINK, messages=messages,
                               tools=[WEATHER], output_config={"format": ANSWER})
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"]
    json.loads(second.content[0].text)
    # The conversation before the assistant turn was already in the KV.
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= first_prompt - THINK_SPAN


def test_tool_result_blocks_and_tool_reference_are_read(server: ServerProcess) -> None:
    messages = [
        {"role": "user", "content": "Find a tool."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Searching."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False, "content": [
                {"type": "text", "text": "found"},
                {"type": "tool_reference", "tool_name": "get_time"}]},
            {"type": "text", "text": "Go on."}]}]
    msg = client(server).messages.create(model="x", max_tokens=4, thinking=NO_THINK,
                                         messages=messages, tools=[WEATHER])
    assert msg.usage.output_tokens == 4


def test_deferred_tools_are_not_described(server: ServerProcess) -> None:
    c = client(server)

    def prompt_size(tools: list[dict[str, Any]]) -> int:
        msg = c.messages.create(model="x", max_tokens=1, thinking=NO_THINK,
                                messages=user("Which tools?"), tools=tools)
        return msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)

    deferred = {**TIME, "defer_loading": True}
    assert prompt_size([WEATHER, deferred]) == prompt_size([WEATHER])
    assert prompt_size([WEATHER, TIME]) > prompt_size([WEATHER])


# -- system prompt and KV reuse ----------------------------------------------------------------

def _billing(cch: str) -> dict[str, Any]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; "
                                    f"cc_entrypoint=cli; cch={cch};"}


def test_billing_header_is_dropped_so_the_kv_is_reused(server: ServerProcess) -> None:
    c = client(server)
    system = [{"type": "text", "text": "You are a coding agent. Be brief."}]
    a = c.messages.create(model="x", max_tokens=2, thinking=NO_THINK, messages=user("Hi."),
                          system=[_billing("a5145"), *system])
    b = c.messages.create(model="x", max_tokens=2, thinking=NO_THINK, messages=user("Hi."),
                          system=[_billing("9f3e2"), *system])
    whole = a.usage.input_tokens + (a.usage.cache_read_input_tokens or 0)
    assert b.usage.input_tokens + (b.usage.cache_read_input_tokens or 0) == whole
    assert b.usage.input_tokens <= 2   # the engine re-reads at most the last prompt token


def test_a_later_system_message_keeps_the_prefix(server: ServerProcess) -> None:
    c = client(server)
    first = [{"role": "user", "content": "Tell me about rivers."}]
    a = c.messages.create(model="x", max_tokens=6, thinking=NO_THINK, messages=first,
                          system="You are terse.")
    later: Any = [*first, {"role": "assistant", "content": a.content[0].text},
                  {"role": "system", "content": "Reminder: be terse."},
                  {"role": "user", "content": "And lakes?"}]
    b = c.messages.create(model="x", max_tokens=2, thinking=NO_THINK, messages=later,
                          system="You are terse.")
    whole = a.usage.input_tokens + (a.usage.cache_read_input_tokens or 0)
    assert (b.usage.cache_read_input_tokens or 0) >= whole - THINK_SPAN


# -- thinking --------------------------------------------------------------------------------------

def test_thinking_on_and_off(think_server: ServerProcess) -> None:
    c = client(think_server)
    on = c.messages.create(model="x", max_tokens=20, messages=user("Think."),
                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.content[0].type == "thinking"
    assert on.content[0].thinking and on.content[0].signature == ""
    adaptive = c.messages.create(model="x", max_tokens=20, messages=user("Think."),
                                 thinking={"type": "adaptive"})
    assert adaptive.content[0].type == "thinking"
    off = c.messages.create(model="x", max_tokens=20, messages=user("Think."), thinking=NO_THINK)
    assert off.content and all(b.type != "thinking" for b in off.content)


def test_thinking_streams_and_closes_with_an_empty_signature(think_server: ServerProcess) -> None:
    c = client(think_server)
    args: dict[str, Any] = {"model": "x", "max_tokens": 20, "messages": user("Think."),
                            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    events = list(c.messages.create(stream=True, **args))
    assert events[1].type == "content_block_start"
    assert events[1].content_block.type == "thinking"
    block0 = [e for e in events if getattr(e, "index", None) == 0]
    deltas = [e.delta for e in block0 if e.type == "content_block_delta"]
    assert deltas[-1].type == "signature_delta" and deltas[-1].signature == ""
    assert all(d.type == "thinking_delta" for d in deltas[:-1])
    assert block0[-1].type == "content_block_stop"
    with c.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature == ""
    thinking = "".join(d.thinking for d in deltas[:-1])
    assert final.content[0].thinking == thinking


def test_thinking_sent_back_is_accepted(think_server: ServerProcess) -> None:
    c = client(think_server)
    first = c.messages.create(model="x", max_tokens=10, messages=user("Think."),
                              thinking={"type": "enabled", "budget_tokens": 1024})
    assistant = first.to_param()
    assistant["content"] = [*assistant["content"],  # type: ignore[index]
                            {"type": "redacted_thinking", "data": "opaque"},
                            {"type": "text", "text": "Done."}]
    second = c.messages.create(model="x", max_tokens=4, thinking=NO_THINK,
                               messages=[*user("Think."), assistant, *user("Again.")])
    assert second.usage.output_tokens == 4


# -- count_tokens ---------------------------------------------------------------------------------

def test_count_tokens_estimates_from_length(server: ServerProcess) -> None:
    c = client(server)
    short = c.messages.count_tokens(model="x", messages=user("Hi."))
    text = "x" * 3000
    long = c.messages.count_tokens(model="x", messages=user(text), tools=[WEATHER],
                                   system="You are terse.")
    assert 0 < short.input_tokens < 20
    assert long.input_tokens >= 1000 and long.input_tokens < 1300


def test_count_tokens_needs_no_model(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "data", wait_ready=False)   # state "empty"
    try:
        c = client(srv)
        assert c.messages.count_tokens(model="x", messages=user("Hello.")).input_tokens > 0
        with pytest.raises(anthropic.InternalServerError) as info:
            c.messages.create(model="x", max_tokens=4, messages=user("Hello."))
        assert info.value.status_code == 503
        assert info.value.body["type"] == "error"  # type: ignore[index]
        assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    finally:
        srv.stop()


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_full_context_is_prompt_too_long(keyed_server: ServerProcess, stream: bool) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client(keyed_server).messages.create(model="x", max_tokens=8, messages=user(LONG_TEXT),
                                             stream=stream)
    body = info.value.body
    assert body["type"] == "error"  # type: ignore[index]
    assert body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    message = body["error"]["message"]  # type: ignore[index]
    assert message.startswith("prompt is too long: ")
    assert "tokens > 2048 maximum" in message and "Context" in message


def test_error_inside_a_stream_is_an_error_event(keyed_server: ServerProcess) -> None:
    """A request that waited in line gets pings, then its refusal as `event: error`."""
    hold: dict[str, Any] = {}

    def long_turn() -> None:
        hold["resp"] = keyed_server.request("POST", "/v1/messages", {
            "model": "x", "max_tokens": 3000, "thinking": NO_THINK, "messages": user("Go on.")})

    t = threading.Thread(target=long_turn)
    t.start()
    wait_generating(keyed_server, True, 20)
    conn, resp = open_stream(keyed_server, "/v1/messages", key_header="X-Api-Key", body={
        "model": "x", "max_tokens": 8, "stream": True, "messages": user(LONG_TEXT)})
    assert resp.status == 200
    head = resp.readline()
    assert head == b"event: ping\n"    # waiting in line
    keyed_server.request("POST", "/api/cancel")
    events = sse(head + resp.read())
    conn.close()
    t.join(30)
    assert hold["resp"][2]["stop_reason"] == "end_turn"   # cancelled
    names = [name for name, _ in events]
    assert names[-1] == "error" and set(names[:-1]) == {"ping"}
    assert all(name == data["type"] for name, data in events)
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("prompt is too long: ")


def test_access_refusals_take_the_messages_shape(keyed_server: ServerProcess) -> None:
    with pytest.raises(anthropic.AuthenticationError) as info:
        client(keyed_server, key="wrong").messages.create(model="x", max_tokens=2,
                                                          messages=user("Hi."))
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    msg = client(keyed_server).messages.create(model="x", max_tokens=2, thinking=NO_THINK,
                                               messages=user("Hi."))
    assert msg.usage.output_tokens == 2


@pytest.mark.parametrize("body,why", [
    ({"messages": user("x"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool"),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]},
     "an assistant's tool call last, without its result"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]}, "image by URL"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "a file"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png",
        "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}}]}]},
     "an image on a model without a projector"),
    ({"messages": user("x"), "tool_choice": {"type": "any"}}, "tool_choice any without tools"),
    ({"messages": user("x"), "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice names an unknown tool"),
    ({"messages": user("x"), "thinking": {"type": "sometimes"}}, "unknown thinking type"),
    ({"messages": user("x"), "max_tokens": -1}, "negative budget"),
    ({"messages": [{"role": "user", "content": 5}]}, "content a number"),
])
def test_bad_requests_are_typed_bad_request_errors(server: ServerProcess, body: dict[str, Any],
                                                   why: str) -> None:
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as info:
        c.post("/v1/messages", cast_to=object, body={"model": "x", "max_tokens": 4, **body})
    assert info.value.body["error"]["type"] == "invalid_request_error", why  # type: ignore[index]
    assert info.value.body["error"]["message"], why  # type: ignore[index]


def test_an_empty_conversation_is_answered_as_llama_server_answers_it(
        server: ServerProcess) -> None:
    """No messages: the template's generation prompt alone (llama-server's permissive
    reading, which its own suite checks), answered as a whole message the SDK parses."""
    c = client(server)
    msg = c.messages.create(model="x", max_tokens=4, messages=[])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="x", max_tokens=4, system="only a system text",
                          messages=[{"role": "assistant", "content": [
                              {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}])


def test_a_prefill_is_the_answer_begun(server: ServerProcess) -> None:
    """An assistant message last is the beginning of the answer, as Anthropic's API reads
    it: the prompt is the conversation before it, its generation prompt, then its text (no
    end of turn); the answer goes on from there (its text is not repeated)."""
    c = client(server)
    plain = c.messages.create(model="x", max_tokens=1, messages=user("Say something."),
                              thinking=NO_THINK)
    begun = c.messages.create(model="x", max_tokens=3, thinking=NO_THINK, messages=[
        *user("Say something."), {"role": "assistant", "content": "The answer is"}])
    status, _, prompt = server.request("POST", "/apply-template", {"think": False, "messages": [
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": "The answer is"}]})
    assert status == 200 and prompt["prompt"].endswith("The answer is"), prompt
    n = len(server.request("POST", "/tokenize", {"content": prompt["prompt"],
                                                 "add_special": True})[2]["tokens"])

    def read(u: Any) -> int:
        return int(u.input_tokens + (u.cache_read_input_tokens or 0))

    assert read(begun.usage) == n > read(plain.usage)
    assert begun.stop_reason in ("max_tokens", "end_turn")
    assert not begun.content or not begun.content[0].text.startswith("The answer is")


def test_a_body_that_is_not_json_is_refused_in_the_messages_shape(server: ServerProcess) -> None:
    status, _, body = server.request("POST", "/v1/messages", raw=b"{nope")
    assert status == 400
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


# -- disconnects -----------------------------------------------------------------------------------

def test_disconnect_cancels_that_turn_only(server: ServerProcess) -> None:
    conn, resp = open_stream(server, "/v1/messages", key_header="X-Api-Key", body={
        "model": "x", "max_tokens": 3500, "stream": True, "thinking": NO_THINK,
        "messages": user("Talk for a long time.")})
    assert resp.status == 200
    assert resp.readline() == b"event: message_start\n"
    assert server.info()["generating"]
    waiting: dict[str, Any] = {}

    def next_turn() -> None:
        waiting["msg"] = client(server).messages.create(model="x", max_tokens=20,
                                                        thinking=NO_THINK, messages=user("Next."))

    t = threading.Thread(target=next_turn)
    t.start()
    time.sleep(0.2)   # the next request takes its place in line behind the stream
    conn.sock.close()  # the streaming client goes away mid-answer
    conn.close()
    gone = time.monotonic()
    t.join(30)
    # The waiting turn ran whole, at once: the abandoned one (3500 tokens) was stopped.
    assert time.monotonic() - gone < 2.0
    assert waiting["msg"].stop_reason == "max_tokens" and waiting["msg"].usage.output_tokens == 20
    wait_generating(server, False, 1.5)
