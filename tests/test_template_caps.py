"""What a template does with a system message and a call's arguments, probed once, and
the conversation adapted to it as llama.cpp's workarounds do (real templates of the
pinned sdist)."""

from __future__ import annotations

import json

import pytest

from _llama_templates import templates_dir
from bmoe.engine.templating import ChatTemplate, TemplateError

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def template(name: str) -> ChatTemplate:
    return ChatTemplate((templates_dir() / name).read_text())


def test_gemma_2_takes_a_system_message_folded_into_the_first_turn() -> None:
    t = template("google-gemma-2-2b-it.jinja")
    assert t.caps.system_role is False
    out = t.render([{"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "Hello"}])
    assert "<start_of_turn>user\nAnswer in French.\nHello<end_of_turn>" in out
    assert out.endswith("<start_of_turn>model\n")


def test_a_template_with_a_system_role_keeps_it() -> None:
    t = template("Qwen-Qwen3-0.6B.jinja")
    assert t.caps.system_role is True and t.caps.string_arguments is False
    out = t.render([{"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "Hello"}])
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in out


def test_functionary_reads_the_arguments_as_json_text() -> None:
    """Functionary v3.2 concatenates the arguments to a string: handed an object it
    refused the conversation (TypeError); now it gets the JSON text."""
    t = template("meetkai-functionary-medium-v3.2.jinja")
    assert t.caps.string_arguments is True
    out = t.render([{"role": "user", "content": "Weather in Rome?"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                     "content": "sunny"}], tools=TOOLS)
    assert ">>>get_weather\n" + json.dumps({"city": "Rome"}) in out


def test_a_template_that_reads_the_object_gets_the_object() -> None:
    t = template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    assert t.caps.string_arguments is False
    out = t.render([{"role": "user", "content": "Weather in Rome?"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]}],
                   tools=TOOLS, add_generation_prompt=False)
    assert '"city": "Rome"' in out and "'city'" not in out


def test_the_callers_messages_are_not_changed() -> None:
    t = template("meetkai-functionary-medium-v3.2.jinja")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [json.loads(json.dumps(CALL))]}]
    t.render(messages, tools=TOOLS)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}


def test_gemma_2_still_refuses_a_tool_turn() -> None:
    """Gemma 2 has no tool role: llama.cpp's server refuses the conversation too."""
    t = template("google-gemma-2-2b-it.jinja")
    with pytest.raises(TemplateError, match="alternate"):
        t.render([{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
