"""Grammar-forced calls in a family's own syntax through the real engine and server.

The tiny model the project makes is served with the real gpt-oss, GLM-4.6, Gemma 4,
DeepSeek V3.2, Seed-OSS, LFM2.5, Apertus and Command R7B templates of the pinned sdist
(``--chat-template-file``): `tool_choice` required on /v1/chat/completions and "any" on
/v1/messages must come back as structured calls. The maker's vocabulary carries Qwen's
special tokens only, so the other families' markup is spelled in byte tokens the grammar
forces (their lazy triggers, single tokens in the real models, are not exercised here).
The DeepSeek V3.2 server is started with ``--chat-template-kwargs '{"enable_thinking":
false}'``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from _llama_templates import templates_dir
from conftest import ServerProcess, start_server

TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string",
                                                          "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}
FAMILIES = {"gpt_oss": "openai-gpt-oss-120b.jinja", "glm45": "GLM-4.6.jinja",
            "gemma4": "google-gemma-4-31B-it.jinja",
            "deepseek_v32": "deepseek-ai-DeepSeek-V3.2.jinja", "seed_oss": "ByteDance-Seed-OSS.jinja",
            "lfm2": "LFM2.5-8B-A1B.jinja", "apertus": "Apertus-8B-Instruct.jinja",
            "command_r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"}
EXTRA = {"deepseek_v32": ["--chat-template-kwargs", '{"enable_thinking": false}']}
# a replayed call get_weather(city="Rome") as each template writes it
REPLAYED = {
    "glm45": ["<tool_call>get_weather", "<arg_value>Rome</arg_value>"],
    "gemma4": ['<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>',
               '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'],
    "deepseek_v32": ['<｜DSML｜invoke name="get_weather">',
                     '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>'],
    "seed_oss": ["<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>"],
    "lfm2": ["<think>Look it up.</think><|tool_call_start|>[get_weather(city='Rome')]"],
    "apertus": ['<|tools_prefix|>[{"get_weather": {"city": "Rome"}}]<|tools_suffix|>'],
    "command_r7b": ['"tool_name": "get_weather", "parameters": {"city": "Rome"}'],
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  tiny_moe: Path) -> Iterator[tuple[str, ServerProcess]]:
    framing = request.param
    data = tmp_path_factory.mktemp(f"family-{framing}")
    template = templates_dir() / FAMILIES[framing]
    srv = start_server(data, "-m", str(tiny_moe), "-c", "4096",
                       "--chat-template-file", str(template), *EXTRA.get(framing, []))
    assert srv.info()["state"] == "ready", srv.info()
    yield framing, srv
    srv.stop()


def test_the_format_is_reported(family_server: tuple[str, ServerProcess]) -> None:
    framing, srv = family_server
    assert srv.info()["model"]["chat_format"] == framing
    status, _, props = srv.request("GET", "/props")
    assert status == 200 and props["chat_format"] == framing


def test_required_call_on_chat_completions(family_server: tuple[str, ServerProcess]) -> None:
    _, srv = family_server
    status, _, body = srv.request("POST", "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 400,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": TOOL_PARAMS}}],
        "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls", msg
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert not msg.get("content")


def test_any_call_on_messages(family_server: tuple[str, ServerProcess]) -> None:
    _, srv = family_server
    status, _, body = srv.request("POST", "/v1/messages", {
        "model": "x", "max_tokens": 400, "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "input_schema": TOOL_PARAMS}],
        "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}})
    assert status == 200, body
    uses = [b for b in body["content"] if b["type"] == "tool_use"]
    assert body["stop_reason"] == "tool_use", body
    assert len(uses) == 1 and uses[0]["name"] == "get_weather"
    assert uses[0]["input"]["city"] in ("Paris", "Rome")
    assert not [b for b in body["content"] if b["type"] == "text" and b["text"].strip()]


def _events(payload: bytes) -> list[dict]:
    out = []
    for line in payload.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


MARKUP = ["<|", "|>", "<tool_call>", "<arg_", "</", "to=functions", "｜DSML｜", "<channel|>",
          "call:"]


def test_streamed_required_call_and_free_text(family_server: tuple[str, ServerProcess]) -> None:
    """Streamed: the call comes as tool_call deltas whose pieces join to the arguments, and
    a free answer (auto, no tools) shows no markup in any content or reasoning delta."""
    _, srv = family_server
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_PARAMS}}]
    status, _, payload = srv.request("POST", "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 400,
        "stream": True, "tools": tools, "tool_choice": "required",
        "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in _events(payload) if c.get("choices")]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    args = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    status, _, payload = srv.request("POST", "/v1/chat/completions", {
        "model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
        "stream": True})
    assert status == 200
    for d in (c["choices"][0]["delta"] for c in _events(payload) if c.get("choices")):
        for piece in (d.get("content") or "", d.get("reasoning_content") or ""):
            assert not [m for m in MARKUP if m in piece], piece


def test_reasoning_effort_and_replayed_reasoning_reach_the_template(
        family_server: tuple[str, ServerProcess]) -> None:
    framing, srv = family_server
    status, _, body = srv.request("POST", "/apply-template", {
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
                      "tool_calls": [{"id": "call00000", "type": "function", "function": {
                          "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                     {"role": "tool", "tool_call_id": "call00000", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": TOOL_PARAMS}}],
        "reasoning_effort": "high"})
    assert status == 200, body
    prompt = body["prompt"]
    if framing == "gpt_oss":
        assert "Reasoning: high" in prompt
        assert "<|channel|>analysis<|message|>Look it up.<|end|>" in prompt
        assert "to=functions.get_weather" in prompt
    else:
        assert all(piece in prompt for piece in REPLAYED[framing]), prompt[-800:]
    if framing == "deepseek_v32":                # the setting's enable_thinking false
        assert prompt.endswith("<think></think>"), prompt[-200:]   # not an open <think>
