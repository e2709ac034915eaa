"""Chat fidelity on the real engine: tool calls, structured output, thinking, the line.

Random weights cannot choose to call a tool or to write JSON, but a grammar can make
them: these tests force structure and check what the server and the SDK make of it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from bmoe.modelmaker import make_model
from conftest import ServerProcess, start_server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none",
                         _strict_response_validation=True, max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def framed(request: pytest.FixtureRequest, model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_model(model_dir / f"tiny-{request.param}.gguf", template=request.param)
    srv = start_server(tmp_path_factory.mktemp(f"srv-{request.param}"), "-m", str(model),
                       "-c", "4096")
    yield srv
    srv.stop()


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _stream_calls(c: openai.OpenAI, **kw: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not entry["id"], "a call's id is sent once, in its first delta"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            assert not ch.delta.content, "a call's text never appears in content"
            if ch.finish_reason:
                finish = ch.finish_reason
    return calls, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_streams_and_parses(framed: ServerProcess, choice: str) -> None:
    c = _client(framed)
    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    kw = dict(model="x", messages=_user("What is the weather?"), tools=[WEATHER, CLOCK],
              tool_choice=tool_choice, max_tokens=200, extra_body=NO_THINK)
    full = c.chat.completions.create(**kw)
    choice0 = full.choices[0]
    assert choice0.finish_reason == "tool_calls"
    assert choice0.message.content is None
    calls = choice0.message.tool_calls
    assert calls, "a required call was made"
    by_name = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in calls:
        assert call.type == "function"
        if choice == "named":
            assert call.function.name == "get_weather"
        schema = by_name[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)

    streamed, finish = _stream_calls(c, **kw)
    assert finish == "tool_calls"
    assert [streamed[i]["name"] for i in sorted(streamed)] == [x.function.name for x in calls]
    for i, call in enumerate(calls):
        assert streamed[i]["id"].startswith("call_")
        assert json.loads(streamed[i]["arguments"]) == json.loads(call.function.arguments)
        assert streamed[i]["arguments"] == call.function.arguments


def test_tool_result_round_trip(framed: ServerProcess) -> None:
    c = _client(framed)
    first = c.chat.completions.create(model="x", messages=_user("Weather?"), tools=[WEATHER],
                                      tool_choice="required", max_tokens=200, extra_body=NO_THINK)
    call = first.choices[0].message.tool_calls[0]
    messages = _user("Weather?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = c.chat.completions.create(model="x", messages=messages, tools=[WEATHER],
                                       max_tokens=8, extra_body=NO_THINK)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_json_schema_answer_parses_and_validates(server: ServerProcess) -> None:
    schema = {"type": "object",
              "properties": {"city": {"type": "string", "maxLength": 16},
                             "rank": {"type": "integer"}},
              "required": ["city", "rank"], "additionalProperties": False}
    c = _client(server)
    resp = c.chat.completions.create(
        model="x", messages=_user("Capital?"), max_tokens=300, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)

    pieces = []
    for chunk in c.chat.completions.create(
            model="x", messages=_user("Capital?"), max_tokens=300, stream=True,
            extra_body=NO_THINK,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}):
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
    jsonschema.validate(json.loads("".join(pieces)), schema)


def test_json_object_and_top_level_schema(server: ServerProcess) -> None:
    c = _client(server)
    resp = c.chat.completions.create(model="x", messages=_user("JSON please"), max_tokens=300,
                                     extra_body=NO_THINK, response_format={"type": "json_object"})
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    schema = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": _user("list"), "max_tokens": 200, "json_schema": schema, **NO_THINK})
    assert status == 200, body
    if body["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("body,code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
     "invalid_request"),
    ({"json_schema": False}, "invalid_request"),
    ({"response_format": {"type": "xml"}}, "invalid_request"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER],
      "tool_choice": "required"}, "invalid_request"),
    ({"tools": [{"type": "web_search"}]}, "invalid_request"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "invalid_request"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "invalid_request"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "invalid_request"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
         "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}}]}]},
     "no_vision"),
    ({"max_completion_tokens": 1.5}, "invalid_request"),
    ({"think": "yes"}, "invalid_request"),
])
def test_refusals(server: ServerProcess, body: dict[str, Any], code: str) -> None:
    payload = {"messages": _user("hi"), **body}
    status, _, answer = server.request("POST", "/v1/chat/completions", payload)
    assert status == 400, answer
    assert answer["code"] == code


def test_thinking_span_lands_in_reasoning(server: ServerProcess) -> None:
    # The model opens and closes a reasoning span (forced by a grammar, llama.cpp's field).
    grammar = 'root ::= "<think>" [a-z ]{8,20} "</think>" [a-z ]{4,12}'
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": _user("Think first."), "max_tokens": 80, "grammar": grammar, "think": True})
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] and "<think>" not in msg["reasoning_content"]
    assert msg["content"] and "</think>" not in msg["content"]


def _sse_chunks(srv: ServerProcess, payload: dict[str, Any]) -> list[Any]:
    host, port = srv.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**payload, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out: list[Any] = []
    for line in resp:
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            out.append(json.loads(line[6:]))
        elif line.startswith(b":"):
            out.append(line.decode().strip())
    conn.close()
    return out


def test_closing_think_tag_without_opening_sends_a_reset(server: ServerProcess) -> None:
    grammar = 'root ::= [a-z]{6,10} " " [a-z]{6,10} "</think>" [a-z ]{4,10}'
    chunks = _sse_chunks(server, {"messages": _user("x"), "max_tokens": 60, "grammar": grammar,
                                  "think": True})
    data = [c for c in chunks if isinstance(c, dict)]
    resets = [c for c in data if c.get("bmoe", {}).get("reset")]
    assert len(resets) == 1
    reset = resets[0]["choices"][0]["delta"]
    # Before the reset, the text went out as content; the reset moves it to reasoning.
    before = "".join(c["choices"][0]["delta"].get("content") or "" for c in data[:data.index(resets[0])])
    assert before.strip()
    assert reset["reasoning_content"] and reset["reasoning_content"].startswith(before.strip()[:6])
    after = "".join(c["choices"][0]["delta"].get("content") or ""
                    for c in data[data.index(resets[0]) + 1:] if c["choices"])
    final_content = (reset.get("content") or "") + after
    assert "</think>" not in final_content and "</think>" not in reset["reasoning_content"]


def test_prefilled_think_template_starts_in_reasoning(model_dir: Path,
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    model = make_model(model_dir / "tiny-prefill.gguf", think_prefill=True)
    srv = start_server(tmp_path_factory.mktemp("srv-prefill"), "-m", str(model), "-c", "2048")
    try:
        grammar = 'root ::= [a-z ]{8,20} "</think>" [a-z ]{4,12}'
        status, _, body = srv.request("POST", "/v1/chat/completions", {
            "messages": _user("hm"), "max_tokens": 60, "grammar": grammar})
        assert status == 200, body
        msg = body["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["content"]
        chunks = _sse_chunks(srv, {"messages": _user("hm"), "max_tokens": 60, "grammar": grammar})
        assert not [c for c in chunks if isinstance(c, dict) and c.get("bmoe", {}).get("reset")]
    finally:
        srv.stop()


def test_context_full_is_refused_and_advised(model_dir: Path, tiny_moe: Path,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = start_server(tmp_path_factory.mktemp("srv-small"), "-m", str(tiny_moe), "-c", "256")
    try:
        assert srv.info()["model"]["ctx_advice"]["warn"] is False
        status, _, body = srv.request("POST", "/v1/chat/completions", {
            "messages": _user("word " * 400), "max_tokens": 10})
        assert status == 400
        assert body["code"] == "context_full"
        assert "Context" in body["error"] and "{ctx-size}" not in body["error"]
        advice = srv.info()["model"]["ctx_advice"]
        assert advice["refused"] is True and advice["warn"] is True
        # A prompt that fits gets what the context has left, and stops with length.
        status, _, body = srv.request("POST", "/v1/chat/completions", {
            "messages": _user("word " * 60), "max_tokens": 0, **NO_THINK})
        assert status == 200
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["total_tokens"] <= 256
    finally:
        srv.stop()


def test_waiting_stream_gets_comments_and_its_disconnect_disturbs_nobody(
        server: ServerProcess) -> None:
    host, port = server.url.split("//")[1].rsplit(":", 1)
    long = json.dumps({"messages": _user("Long."), "max_tokens": 3000, "stream": True, **NO_THINK})
    running = http.client.HTTPConnection(host, int(port), timeout=60)
    running.request("POST", "/v1/chat/completions", body=long,
                    headers={"Content-Type": "application/json"})
    r1 = running.getresponse()
    assert r1.readline().startswith(b"data: ")
    waiting = http.client.HTTPConnection(host, int(port), timeout=60)
    waiting.request("POST", "/v1/chat/completions", body=long,
                    headers={"Content-Type": "application/json"})
    r2 = waiting.getresponse()
    assert r2.status == 200
    assert r2.readline() == b": waiting for a turn\n"
    waiting.sock.close()
    waiting.close()
    # The running answer goes on after the waiter left.
    time.sleep(0.3)
    assert server.info()["generating"]
    seen = 0
    for line in r1:
        if line.startswith(b"data: {"):
            seen += 1
        if seen > 20:
            break
    assert seen > 20
    server.request("POST", "/api/cancel")
    for line in r1:
        if line.startswith(b"data: [DONE]"):
            break
    running.close()
    deadline = time.monotonic() + 5
    while server.info()["generating"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_turns_run_in_arrival_order(server: ServerProcess) -> None:
    order: list[int] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        status, _, body = server.request("POST", "/v1/chat/completions", {
            "messages": _user(f"request {i}"), "max_tokens": 400, **NO_THINK})
        assert status == 200
        with lock:
            order.append(i)

    threads = []
    for i in range(4):
        t = threading.Thread(target=ask, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.3)  # arrive one after another
    for t in threads:
        t.join(60)
    assert order == [0, 1, 2, 3]


def test_auto_tools_the_grammar_cannot_express_still_answer(server: ServerProcess) -> None:
    # llama.cpp's converter refuses this pattern; with tool_choice auto the turn must
    # still run (the calls are then not held to a grammar), not be refused.
    odd = {"type": "function", "function": {"name": "fetch", "parameters": {
        "type": "object", "properties": {"url": {"type": "string", "pattern": "^https?://"}},
        "required": ["url"]}}}
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": _user("Fetch it."), "tools": [odd, WEATHER], "max_tokens": 8, **NO_THINK})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": _user("Fetch it."), "tools": [odd], "tool_choice": "required",
        "max_tokens": 8, **NO_THINK})
    assert status == 400 and body["code"] == "invalid_request" and "fetch" in body["error"]
