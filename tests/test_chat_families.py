"""The chat-format families against llama.cpp's own templates and expected parses.

Templates: the pinned llama-cpp-python sdist's ``models/templates`` (`_llama_templates`).
Cases: representative expected parses of llama.cpp's ``tests/test-chat.cpp``, as data.
Fuzz: each case and generated outputs split at random boundaries parse the same streamed
and whole, with no markup in any streamed piece of content or reasoning.
"""

from __future__ import annotations

import json
import random

import pytest
from _llama_templates import read_template

from bmoe.engine import families
from bmoe.engine.families.grammar_calls import tool_call_grammar
from bmoe.engine.chatparse import ChatDeltaStream, detect_framing
from bmoe.engine.families import output_parser
from bmoe.engine.grammar_guard import check_grammar
from bmoe.engine.templating import ChatTemplate

DETECTED = {
    "openai-gpt-oss-120b.jinja": "gpt_oss",
    "GLM-4.6.jinja": "glm45",
    "GLM-4.7-Flash.jinja": "glm45",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v31",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_r1",
    "llama-cpp-deepseek-r1.jinja": "deepseek_r1",
    "moonshotai-Kimi-K2.jinja": "kimi_k2",
    "Kimi-K2-Instruct.jinja": "kimi_k2",
    "Kimi-K2-Thinking.jinja": "kimi_k2",
    "MiniMax-M2.jinja": "minimax_m2",
    "MiniMax-M3.jinja": None,
    "google-gemma-4-31B-it.jinja": "gemma4",
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_v32",
    "deepseek-ai-DeepSeek-V4.jinja": "deepseek_v4",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "deepseek_v4",
    "LFM2-8B-A1B.jinja": "lfm2",
    "LFM2.5-8B-A1B.jinja": "lfm2",
    "LFM2.5-Instruct.jinja": "lfm2",
    "ByteDance-Seed-OSS.jinja": "seed_oss",
    "Apertus-8B-Instruct.jinja": "apertus",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "command_r7b",
    "Cohere2MoE.jinja": None,
    # Qwen's two are told apart by a rendered call (chatparse.detect_framing)
    "Qwen-Qwen3-0.6B.jinja": None,
    "Qwen3-Coder.jinja": None,
    "ibm-granite-granite-4.0.jinja": None,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": None,
    "Qwen3.5-4B.jinja": None,
}

# the templates the rendered sample call decides (the session's fallback after `detect`)
PROBED = {
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_coder",
    "ibm-granite-granite-4.0.jinja": "hermes",
    "ibm-granite-granite-4.1.jinja": "hermes",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "qwen3_coder",
    "Qwen3.5-4B.jinja": "qwen3_coder",
}


@pytest.mark.parametrize("name,framing", sorted(DETECTED.items()))
def test_detected_from_the_real_template(name: str, framing: str | None) -> None:
    assert families.detect(read_template(name)) == framing


@pytest.mark.parametrize("name,framing", sorted(PROBED.items()))
def test_probed_from_a_rendered_call(name: str, framing: str) -> None:
    """Granite 4 writes Hermes calls, Nemotron 3 Nano and Qwen3.5 Qwen3-Coder's XML (as
    llama.cpp's chat.cpp routes them): no name of their own, the sample call decides."""
    text = read_template(name)
    tmpl = ChatTemplate(text, bos_token="<s>", eos_token="</s>")
    assert families.detect(text) is None
    assert detect_framing(lambda m, t: tmpl.render(m, tools=t, add_generation_prompt=False)) \
        == framing


TOOLS = [{"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                   "required": ["arg1"]}}}]
CALL = {"id": "call00000", "type": "function",
        "function": {"name": "special_function", "arguments": {"arg1": 1}}}


def _conversation(reasoning_key: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "", reasoning_key: "I should call it.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00000", "name": "special_function", "content": "42"},
        {"role": "assistant", "content": "It said 42.", reasoning_key: "It answered."},
        {"role": "user", "content": "Thanks."},
    ]


RENDERED_CALL = {
    "google-gemma-4-31B-it.jinja": "<|tool_call>call:special_function{arg1:1}<tool_call|>",
    "deepseek-ai-DeepSeek-V3.2.jinja": '<｜DSML｜invoke name="special_function">\n<｜DSML｜'
                                       'parameter name="arg1" string="false">1</｜DSML｜parameter>',
    "deepseek-ai-DeepSeek-V4.jinja": "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"special_function\">",
    "ByteDance-Seed-OSS.jinja": "<seed:tool_call>\n<function=special_function>",
    "Apertus-8B-Instruct.jinja": '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>',
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": '"tool_name": "special_function"',
}


@pytest.mark.parametrize("name", sorted(RENDERED_CALL))
def test_a_replayed_call_renders_in_the_familys_syntax(name: str) -> None:
    tmpl = ChatTemplate(read_template(name), bos_token="<s>", eos_token="</s>")
    out = tmpl.render(_conversation("reasoning_content"), tools=TOOLS)
    assert RENDERED_CALL[name] in out, out[-1500:]


def test_seed_oss_thinking_budget_is_a_template_variable() -> None:
    """Seed-OSS's knob is its template's ``thinking_budget`` (``--chat-template-kwargs``)."""
    from bmoe.engine.params import template_kwargs
    tmpl = ChatTemplate(read_template("ByteDance-Seed-OSS.jinja"), bos_token="<seed:bos>",
                        eos_token="<seed:eos>")
    messages = [{"role": "user", "content": "Hi"}]
    out = tmpl.render(messages, extra=template_kwargs('{"thinking_budget": 512}'))
    assert "thinking budget, which is 512" in out
    assert "thinking budget" not in tmpl.render(messages)


def test_gemma4_opens_the_model_turn_after_tool_results() -> None:
    """As llama.cpp (PR 21760): a call with content, then its result, then the prompt:
    the template closes the turn and writes no new one, so the family opens it."""
    tmpl = ChatTemplate(read_template("google-gemma-4-31B-it.jinja"), bos_token="<bos>")
    messages = [{"role": "user", "content": "Call it."},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call00000", "content": '{"r":"ok"}'}]
    out = families.finish_prompt("gemma4", tmpl.render(messages, tools=TOOLS))
    assert out.endswith("<turn|>\n<|turn>model\n")
    bare = tmpl.render(messages, tools=TOOLS, add_generation_prompt=False)
    assert not families.finish_prompt("gemma4", bare, add_generation_prompt=False) \
        .endswith("<|turn>model\n")


def test_gpt_oss_replays_reasoning_from_reasoning_content() -> None:
    tmpl = ChatTemplate(read_template("openai-gpt-oss-120b.jinja"))
    # mid-loop (the last message a tool result): the call's reasoning is replayed
    messages = families.template_messages("gpt_oss", _conversation("reasoning_content")[:4])
    out = tmpl.render(messages, tools=TOOLS)
    assert "<|channel|>analysis<|message|>I should call it.<|end|>" in out
    assert "to=functions.special_function" in out


RENDER = ["openai-gpt-oss-120b.jinja", "GLM-4.6.jinja", "GLM-4.7-Flash.jinja",
          "meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.3-70B-Instruct.jinja",
          "mistralai-Mistral-Nemo-Instruct-2407.jinja", "unsloth-mistral-Devstral-Small-2507.jinja",
          "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
          "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "moonshotai-Kimi-K2.jinja",
          "Kimi-K2-Thinking.jinja", "MiniMax-M2.jinja", "google-gemma-4-31B-it.jinja",
          "google-gemma-4-31B-it-interleaved.jinja", "deepseek-ai-DeepSeek-V3.2.jinja",
          "deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
          "ibm-granite-granite-4.0.jinja", "ibm-granite-granite-4.1.jinja",
          "LFM2.5-8B-A1B.jinja", "ByteDance-Seed-OSS.jinja", "Apertus-8B-Instruct.jinja",
          "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
          "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "Qwen3.5-4B.jinja"]


@pytest.mark.parametrize("name", RENDER)
def test_renders_tools_results_and_reasoning(name: str) -> None:
    text = read_template(name)
    tmpl = ChatTemplate(text, bos_token="<s>", eos_token="</s>")
    key = "thinking" if families.detect(text) == "gpt_oss" else "reasoning_content"
    out = tmpl.render(_conversation(key), tools=TOOLS, extra={"reasoning_effort": "high"})
    assert "special_function" in out and "42" in out and "Thanks." in out
    if name.startswith("openai-gpt-oss"):
        assert "Reasoning: high" in out
        assert "to=functions.special_function" in out
        assert out.endswith("<|start|>assistant")


# (framing, output, starts_in_reasoning, reasoning, content, [(name, arguments)])
CASES = [
    # gpt-oss (test-chat.cpp "GPT-OSS format tests")
    ("gpt_oss", "<|channel|>final<|message|>Hello, world!\nWhat's up?", False, "",
     "Hello, world!\nWhat's up?", []),
    ("gpt_oss", "<|channel|>commentary<|message|>Hello, world!\nWhat's up?", False, "",
     "Hello, world!\nWhat's up?", []),
    ("gpt_oss", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>"
     "final<|message|>Hello, world!\nWhat's up?", False, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("gpt_oss", " to=functions.special_function<|channel|>analysis<|message|>{\"arg1\": 1}",
     False, "", "", [("special_function", {"arg1": 1})]),
    ("gpt_oss", "<|channel|>analysis to=functions.special_function<|message|>{\"arg1\": 1}",
     False, "", "", [("special_function", {"arg1": 1})]),
    ("gpt_oss", " to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>"
     "{\"arg1\": 1}", False, "", "", [("special_function", {"arg1": 1})]),
    ("gpt_oss", "<|channel|>commentary to=functions.special_function<|message|>{\"arg1\": 1}",
     False, "", "", [("special_function", {"arg1": 1})]),
    ("gpt_oss", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions."
     "special_function<|channel|>analysis<|message|>{\"arg1\": 1}", False, "I'm\nthinking", "",
     [("special_function", {"arg1": 1})]),
    ("gpt_oss", "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.edit <|constrain|>json<|message|>{\"oldString\": \"if "
     "(part < railCount - 1) {\", \"newString\": \"if (part < 4) {\", \"replaceAll\": false}"
     "<|call|>", False, "Thinking about edit...", "",
     [("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
                "replaceAll": False})]),
    ("gpt_oss", "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
     "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(1)'",
     False, "I will execute python to say hello", "", []),
    ("gpt_oss", "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking"
     "<|end|><|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?", False,
     "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("gpt_oss", "<|channel|>commentary to=functions.a<|constrain|>json<|message|>{\"x\": \"<|\"}"
     "<|call|><|start|>assistant<|channel|>commentary to=functions.b<|message|>{}<|call|>",
     False, "", "", [("a", {"x": "<|"}), ("b", {})]),
    # GLM-4.6 / 4.7-Flash
    ("glm45", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
     "</tool_call>", False, "", "", [("special_function", {"arg1": 1})]),
    ("glm45", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("glm45", "I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("glm45", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call>", False, "", "", [("special_function", {"arg1": 1})]),
    ("glm45", "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key><arg_value>1"
     "</arg_value></tool_call>", True, "I'm\nthinking", "", [("special_function", {"arg1": 1})]),
    ("glm45", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call><tool_call>special_function_with_opt<arg_key>arg1</arg_key><arg_value>1"
     "</arg_value><arg_key>arg2</arg_key><arg_value>2</arg_value></tool_call>", False, "", "",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ("glm45", "Let me read the diff content.</think><tool_call>read_file_diff_md</tool_call>",
     True, "Let me read the diff content.", "", [("read_file_diff_md", {})]),
    ("glm45", "<think>plan</think>Sure.<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>a.txt"
     "</arg_value>\n<arg_key>text</arg_key>\n<arg_value>x < y\n</arg_value>\n</tool_call>", False,
     "plan", "Sure.", [("write", {"path": "a.txt", "text": "x < y\n"})]),
    # Llama 3.x
    ("llama3", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("llama3", "{\"name\": \"special_function\", \"parameters\": {\"arg1\": 1}}", False, "", "",
     [("special_function", {"arg1": 1})]),
    ("llama3", "<|python_tag|>{\"name\": \"special_function\", \"parameters\": {\"arg1\": 1}}",
     False, "", "", [("special_function", {"arg1": 1})]),
    # Mistral / Devstral / Ministral
    ("mistral", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("mistral", "[TOOL_CALLS]special_function[ARGS]{\"arg1\": 1}", False, "", "",
     [("special_function", {"arg1": 1})]),
    ("mistral", "Hello, world!\nWhat's up?[TOOL_CALLS]special_function[ARGS]{\"arg1\": 1}", False,
     "", "Hello, world!\nWhat's up?", [("special_function", {"arg1": 1})]),
    ("mistral", "[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{\"arg1\": 1}[TOOL_CALLS]"
     "special_function_with_opt[CALL_ID]000000002[ARGS]{\"arg1\": 1, \"arg2\": 2}", False, "",
     "", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}, "
     "\"id\": \"123456789\"}]", False, "", "", [("special_function", {"arg1": 1})]),
    ("mistral", "[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?", False, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    # DeepSeek V3.1 / R1
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": "
     "\"XYZCITY\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", False, "", "",
     [("get_time", {"city": "XYZCITY"})]),
    ("deepseek_v31", "I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("deepseek_r1", "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", False,
     "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("deepseek_r1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function"
     "\n```json\n{\"arg1\": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", False, "", "",
     [("special_function", {"arg1": 1})]),
    # Kimi K2
    ("kimi_k2", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
     "<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|><|tool_calls_section_end|>",
     False, "", "", [("special_function", {"arg1": 1})]),
    ("kimi_k2", "<think>I'm\nthinking</think><|tool_calls_section_begin|><|tool_call_begin|>"
     "functions.special_function:0<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|>"
     "<|tool_call_begin|>functions.special_function:1<|tool_call_argument_begin|>{\"arg1\": 2}"
     "<|tool_call_end|><|tool_calls_section_end|>", False, "I'm\nthinking", "",
     [("special_function", {"arg1": 1}), ("special_function", {"arg1": 2})]),
    # MiniMax-M2 (the prompt leaves <think> open)
    ("minimax_m2", "\n</think>\n\nHello, world!\nWhat's up?", True, "",
     "Hello, world!\nWhat's up?", []),
    ("minimax_m2", "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("minimax_m2", "Let's call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name=\"empty_args\">"
     "\n</invoke>\n</minimax:tool_call>", True, "Let's call a tool:", "", [("empty_args", {})]),
    ("minimax_m2", "\n</think>\n\n<minimax:tool_call>\n<invoke name=\"special_function\">\n<parameter "
     "name=\"arg1\">1</parameter>\n</invoke>\n</minimax:tool_call>", True, "", "",
     [("special_function", {"arg1": 1})]),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"a\">\n<parameter name=\"x\">two\nlines"
     "</parameter>\n</invoke>\n<invoke name=\"b\">\n</invoke>\n</minimax:tool_call>", False, "", "",
     [("a", {"x": "two\nlines"}), ("b", {})]),
    # Gemma 4 (test-chat.cpp "google-gemma-4-31B-it")
    ("gemma4", "Hello, world!", False, "", "Hello, world!", []),
    ("gemma4", "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", False,
     "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("gemma4", "<|channel>thought<channel|>Hello, world!\nWhat's up?", False, "",
     "Hello, world!\nWhat's up?", []),
    ("gemma4", "<|tool_call>call:get_time{city:<|\"|>London<|\"|>}<tool_call|>", False, "", "",
     [("get_time", {"city": "London"})]),
    ("gemma4", "<|tool_call>call:get_time{city:<|\"|>San Francisco<|\"|>}<tool_call|>", False, "",
     "", [("get_time", {"city": "San Francisco"})]),
    ("gemma4", "<|tool_call>call:empty_args{}<tool_call|>", False, "", "", [("empty_args", {})]),
    ("gemma4", "Hello, world!\nWhat's up?<|tool_call>call:get_time{city:<|\"|>Paris<|\"|>}"
     "<tool_call|>", False, "", "Hello, world!\nWhat's up?", [("get_time", {"city": "Paris"})]),
    ("gemma4", "<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time{city:<|\"|>"
     "Paris<|\"|>}<tool_call|>", False, "I'm\nthinking", "", [("get_time", {"city": "Paris"})]),
    ("gemma4", "<|tool_call>call:get_time{city:<|\"|>London<|\"|>}<tool_call|><|tool_call>call:"
     "get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>", False, "", "",
     [("get_time", {"city": "London"}), ("get_weather", {"city": "Paris"})]),
    ("gemma4", "<|tool_call>call:special_function{arg1:42}<tool_call|>", False, "", "",
     [("special_function", {"arg1": 42})]),
    ("gemma4", "<|tool_call>call:special_function{arg1:-7}<tool_call|>", False, "", "",
     [("special_function", {"arg1": -7})]),
    ("gemma4", "<|tool_call>call:amount{orig:3.14}<tool_call|>", False, "", "",
     [("amount", {"orig": 3.14})]),
    ("gemma4", "<|tool_call>call:toggle{enabled:true}<tool_call|>", False, "", "",
     [("toggle", {"enabled": True})]),
    ("gemma4", "<|tool_call>call:toggle{enabled:false}<tool_call|>", False, "", "",
     [("toggle", {"enabled": False})]),
    ("gemma4", "<|tool_call>call:set_nullable{value:null}<tool_call|>", False, "", "",
     [("set_nullable", {"value": None})]),
    ("gemma4", "<|tool_call>call:todo_list{todos:[<|\"|>buy milk<|\"|>,<|\"|>walk dog<|\"|>]}"
     "<tool_call|>", False, "", "", [("todo_list", {"todos": ["buy milk", "walk dog"]})]),
    ("gemma4", "<|tool_call>call:set_config{config:{theme:<|\"|>dark<|\"|>,count:3}}<tool_call|>",
     False, "", "", [("set_config", {"config": {"theme": "dark", "count": 3}})]),
    ("gemma4", "<|tool_call>call:todo_list{todos:[]}<tool_call|>", False, "", "",
     [("todo_list", {"todos": []})]),
    ("gemma4", "<|tool_call>call:set_config{config:{}}<tool_call|>", False, "", "",
     [("set_config", {"config": {}})]),
    ("gemma4", "<|tool_call>call:amount{orig:1.5e10}<tool_call|>", False, "", "",
     [("amount", {"orig": 1.5e10})]),
    ("gemma4", "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<channel|>", False, "",
     "Hello, world!\nWhat's up?", []),
    ("gemma4", "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n"
     "<channel|>", False, "", "Hello, world!\nWhat's up?", []),
    ("gemma4", "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n"
     "<channel|><channel|>", False, "", "Hello, world!\nWhat's up?", []),
    ("gemma4", "<|channel><|channel>thought\n<channel|>Hello, world!\nWhat's up?", False, "",
     "Hello, world!\nWhat's up?", []),
    ("gemma4", " thinking<channel|>Hello, world!\nWhat's up?", True, "thinking",
     "Hello, world!\nWhat's up?", []),
    # DeepSeek V3.2 (DSML function_calls; the thinking prompt leaves <think> open)
    ("deepseek_v32", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("deepseek_v32", "I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("deepseek_v32", "Let me check the time</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke "
     "name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>"
     "\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", True, "Let me check the time", "",
     [("get_time", {"city": "Tokyo"})]),
    ("deepseek_v32", "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"special_function\">\n"
     "<｜DSML｜parameter name=\"arg1\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
     "</｜DSML｜function_calls>", False, "", "", [("special_function", {"arg1": 1})]),
    ("deepseek_v32", "Calling both</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\""
     "get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
     "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", True,
     "Calling both", "", [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    ("deepseek_v32", "Thinking about it</think>Let me call the function.\n\n<｜DSML｜function_calls>"
     "\n<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜parameter name=\"arg1\" string=\"false\">"
     "1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", True, "Thinking about it",
     "Let me call the function.", [("special_function", {"arg1": 1})]),
    ("deepseek_v32", "Test negative</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\""
     "magic_int\">\n<｜DSML｜parameter name=\"ref\" string=\"false\">-14</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>", True, "Test negative", "",
     [("magic_int", {"ref": -14})]),
    ("deepseek_v32", "Test decimal</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\""
     "amount\">\n<｜DSML｜parameter name=\"orig\" string=\"false\">3.14</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>", True, "Test decimal", "",
     [("amount", {"orig": 3.14})]),
    # DeepSeek V4 / V4-Flash (DSML tool_calls; non-thinking prompt ends with a bare </think>)
    ("deepseek_v4", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("deepseek_v4", "I'm\nthinking</think>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("deepseek_v4", "Let me check the time</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\""
     "get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜tool_calls>", True, "Let me check the time", "",
     [("get_time", {"city": "Tokyo"})]),
    ("deepseek_v4", "Multi-arg call</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"magic_int"
     "\">\n<｜DSML｜parameter name=\"ref\" string=\"false\">42</｜DSML｜parameter>\n<｜DSML｜parameter "
     "name=\"name\" string=\"true\">foo bar</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
     True, "Multi-arg call", "", [("magic_int", {"ref": 42, "name": "foo bar"})]),
    ("deepseek_v4", "Let me check the time\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">"
     "\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
     "</｜DSML｜tool_calls>", True, "Let me check the time", "", [("get_time", {"city": "Tokyo"})]),
    ("deepseek_v4", "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜"
     "parameter name=\"arg1\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜"
     "tool_calls>", False, "", "", [("special_function", {"arg1": 1})]),
    # Granite 4.0 / 4.1: Hermes calls (the rendered probe names them hermes)
    ("hermes", "<tool_call>\n{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}}\n"
     "</tool_call>", False, "", "", [("special_function", {"arg1": 1})]),
    # Nemotron 3 Nano and Qwen3.5: Qwen3-Coder XML after an open <think>
    ("qwen3_coder", "I'm\nthinking\n</think>\nHello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    ("qwen3_coder", "I'm\nthinking\n</think>\n<tool_call>\n<function=special_function>\n"
     "<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>\n", True, "I'm\nthinking", "",
     [("special_function", {"arg1": 1})]),
    ("qwen3_coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=special_function_with_opt>\n<parameter="
     "arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>", False,
     "", "", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    # LFM2 / LFM2.5 (Python-style calls)
    ("lfm2", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("lfm2", "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", False, "", "",
     [("special_function", {"arg1": 1})]),
    ("lfm2", "<|tool_call_start|>[get_time(city=\"XYZCITY\")]<|tool_call_end|>", False, "", "",
     [("get_time", {"city": "XYZCITY"})]),
    ("lfm2", "<|tool_call_start|>[toggle(enabled=True)]<|tool_call_end|>", False, "", "",
     [("toggle", {"enabled": True})]),
    ("lfm2", "<|tool_call_start|>[set_nullable(value=None)]<|tool_call_end|>", False, "", "",
     [("set_nullable", {"value": None})]),
    ("lfm2", "<|tool_call_start|>[set_config(config={\"enabled\": True, \"count\": 3})]"
     "<|tool_call_end|>", False, "", "", [("set_config", {"config": {"enabled": True, "count": 3}})]),
    ("lfm2", "<|tool_call_start|>[set_config(config={\"enabled\": true, \"note\": null})]"
     "<|tool_call_end|>", False, "", "", [("set_config", {"config": {"enabled": True, "note": None}})]),
    ("lfm2", "<|tool_call_start|>[Calendar.create_event(title=\"demo\", participants=[\"Alice\", "
     "\"Bob\"], metadata={\"priority\": \"high\", \"reminder\": true})]<|tool_call_end|>", False,
     "", "", [("Calendar.create_event", {"title": "demo", "participants": ["Alice", "Bob"],
                                         "metadata": {"priority": "high", "reminder": True}})]),
    ("lfm2", "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org).",
     False, "", "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org).",
     []),
    ("lfm2", "<|tool_call_start|>[python(code=\"def hello():\\n    print('hey')\")]<|tool_call_end|>",
     False, "", "", [("python", {"code": "def hello():\n    print('hey')"})]),
    ("lfm2", "<|tool_call_start|>[python(code=\"print(\\\"hi\\\")\")]<|tool_call_end|>", False, "",
     "", [("python", {"code": "print(\"hi\")"})]),
    ("lfm2", "Let me check the time.<|tool_call_start|>[get_time(city=\"Paris\")]<|tool_call_end|>",
     False, "", "Let me check the time.", [("get_time", {"city": "Paris"})]),
    ("lfm2", "<think>I'm\nthinking</think><|tool_call_start|>[special_function(arg1=1)]"
     "<|tool_call_end|>", False, "I'm\nthinking", "", [("special_function", {"arg1": 1})]),
    ("lfm2", "<think>Let me think about <|tool_call_start|>[special_function(arg1=1)]"
     "<|tool_call_end|> hmm</think><|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>",
     False, "Let me think about <|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|> hmm",
     "", [("special_function", {"arg1": 1})]),
    ("lfm2", "<|tool_call_start|>[get_time(city=\"Paris\"), get_weather(city=\"Paris\")]"
     "<|tool_call_end|>", False, "", "", [("get_time", {"city": "Paris"}),
                                          ("get_weather", {"city": "Paris"})]),
    # Seed-OSS
    ("seed_oss", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("seed_oss", "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!", False,
     "I'm thinking about the answer", "Hello, world!", []),
    ("seed_oss", "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
     "</function>\n</seed:tool_call>", False, "", "", [("special_function", {"arg1": 1})]),
    ("seed_oss", "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
     "</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=special_function_with_opt>\n"
     "<parameter=arg1>1</parameter>\n<parameter=arg2>2</parameter>\n</function>\n"
     "</seed:tool_call>", False, "", "",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ("seed_oss", "<seed:tool_call>\n<function=todo_list>\n<parameter=todos>[{\"item\": \"Check "
     "stuff\", \"selected\": false}, {\"item\": \"Prepare stuff\", \"selected\": true}]</parameter>"
     "\n</function>\n</seed:tool_call>", False, "", "",
     [("todo_list", {"todos": [{"item": "Check stuff", "selected": False},
                               {"item": "Prepare stuff", "selected": True}]})]),
    ("seed_oss", "<seed:tool_call>\n<function=edit>\n<parameter=filename>foo.cpp</parameter>\n"
     "<parameter=oldString>def foo(arg = \"14\"):\n    return arg + \"bar\"\n</parameter>\n"
     "<parameter=newString>def foo(arg = \"15\"):\n    pass\n</parameter>\n</function>\n"
     "</seed:tool_call>", False, "", "",
     [("edit", {"filename": "foo.cpp", "oldString": "def foo(arg = \"14\"):\n    return arg + "
                "\"bar\"\n", "newString": "def foo(arg = \"15\"):\n    pass\n"})]),
    ("seed_oss", " thinking</seed:think>\nHello, world!\nWhat's up?", True, "thinking",
     "Hello, world!\nWhat's up?", []),
    # Apertus
    ("apertus", "<|tools_prefix|>[{\"special_function\": {\"arg1\": 1}}]<|tools_suffix|>", False,
     "", "", [("special_function", {"arg1": 1})]),
    ("apertus", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
    ("apertus", "<|inner_prefix|>I'm\nthinking<|inner_suffix|>Sure.<|tools_prefix|>[{\"a\": {}}, "
     "{\"b\": {\"x\": 1}}]<|tools_suffix|>", False, "I'm\nthinking", "Sure.",
     [("a", {}), ("b", {"x": 1})]),
    # Command R7B
    ("command_r7b", "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>", False, "",
     "Hello, world!\nWhat's up?", []),
    ("command_r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!"
     "\nWhat's up?<|END_RESPONSE|>", False, "I'm\nthinking", "Hello, world!\nWhat's up?", []),
    ("command_r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n    "
     "{\"tool_call_id\": \"0\", \"tool_name\": \"special_function\", \"parameters\": {\"arg1\": 1}}"
     "\n]<|END_ACTION|>", False, "I'm\nthinking", "", [("special_function", {"arg1": 1})]),
    ("command_r7b", "<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": "
     "\"0\", \"tool_name\": \"special_function\", \"parameters\": {\"arg1\": 1}}\n]<|END_ACTION|>",
     False, "", "", [("special_function", {"arg1": 1})]),
    # generic JSON (unknown templates)
    ("generic", "{\"tool_calls\": [{\"name\": \"special_function\", \"arguments\": {\"arg1\": 1}}]}",
     False, "", "", [("special_function", {"arg1": 1})]),
    ("generic", "{\"response\": \"Hello, world!\\nWhat's up?\"}", False, "",
     "Hello, world!\nWhat's up?", []),
    ("generic", "Hello, world!\nWhat's up?", False, "", "Hello, world!\nWhat's up?", []),
]

MARKUP = {
    "gpt_oss": ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>",
                "to=functions"],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "<think>", "</think>"],
    "llama3": ["<|python_tag|>", '{"name"'],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]", "[CALL_ID]"],
    "deepseek_v31": ["<｜tool▁", "<think>", "</think>"],
    "deepseek_r1": ["<｜tool▁", "<think>", "</think>", "```json"],
    "kimi_k2": ["<|tool_call", "<think>", "</think>"],
    "minimax_m2": ["<minimax:", "<invoke", "<parameter", "</think>"],
    "generic": ['{"tool_calls"', '{"response"'],
    "gemma4": ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "call:", '<|"|>'],
    "deepseek_v32": ["｜DSML｜", "<think>", "</think>"],
    "deepseek_v4": ["｜DSML｜", "<think>", "</think>"],
    "lfm2": ["<|tool_call_start|>", "<|tool_call_end|>", "<think>", "</think>"],
    "seed_oss": ["<seed:", "</seed:", "<function=", "<parameter="],
    "apertus": ["<|tools_prefix|>", "<|tools_suffix|>", "<|inner_prefix|>", "<|inner_suffix|>"],
    "command_r7b": ["<|START_", "<|END_"],
    "hermes": ["<tool_call>", "</tool_call>"],
    "qwen3_coder": ["<tool_call>", "<function=", "<parameter=", "</think>"],
}
TOOLS_ANY = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("special_function", "special_function_with_opt", "edit", "a", "b",
                       "get_time", "read_file_diff_md", "write", "empty_args", "get_weather",
                       "amount", "toggle", "set_nullable", "todo_list", "set_config",
                       "magic_int", "python", "Calendar.create_event")]


def _whole(framing: str, text: str, starts: bool):
    parser = output_parser(framing, starts, TOOLS_ANY)
    parser.feed(text)
    return parser.finish()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_ported_case(case: tuple) -> None:
    framing, text, starts, reasoning, content, calls = case
    view = _whole(framing, text, starts)
    assert view.reasoning == reasoning
    assert view.content == content
    assert [(c.name, json.loads(c.arguments_text)) for c in view.tool_calls] == calls
    assert all(c.complete for c in view.tool_calls)


def _streamed(framing: str, text: str, starts: bool, rng: random.Random):
    parser = output_parser(framing, starts, TOOLS_ANY)
    deltas = ChatDeltaStream()
    sent: list[dict] = []
    i = 0
    while i < len(text):
        j = min(len(text), i + rng.choice([1, 1, 2, 3, 5, 8, 13]))
        parser.feed(text[i:j])
        sent += deltas.update(parser.snapshot())
        i = j
    view = parser.finish()
    sent += deltas.finish(view)
    return view, sent


def _outputs(framing: str, rng: random.Random) -> list[tuple[str, bool]]:
    """The family's cases, and each with content and a second call spliced around it."""
    out = [(c[1], c[2]) for c in CASES if c[0] == framing]
    return out


FUZZ_RUNS = 500
# cases whose reasoning quotes the family's markup (llama.cpp keeps it there, as text)
QUOTED_MARKUP = {c[1] for c in CASES if c[0] == "lfm2" and "<think>Let me think about" in c[1]}


@pytest.mark.parametrize("framing", sorted(MARKUP))
def test_streamed_equals_whole_and_no_markup_leaks(framing: str) -> None:
    rng = random.Random(framing)
    outputs = _outputs(framing, rng)
    for run in range(FUZZ_RUNS):
        text, starts = outputs[run % len(outputs)]
        whole = _whole(framing, text, starts)
        view, sent = _streamed(framing, text, starts, rng)
        assert view == whole
        assert not any(d.get("reset") for d in sent), (text, sent)
        content = "".join(d.get("content", "") for d in sent)
        reasoning = "".join(d.get("reasoning_content", "") for d in sent)
        assert content == whole.content and reasoning == whole.reasoning
        for piece in (content, reasoning):
            leaks = [m for m in MARKUP[framing] if m in piece and text not in QUOTED_MARKUP]
            assert not leaks, (framing, text, piece)
        args = {}
        for d in sent:
            for c in d.get("tool_calls", []):
                args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
        assert [args[i] for i in sorted(args)] == [c.arguments_text for c in whole.tool_calls]


NEW_FAMILIES = ["gemma4", "deepseek_v32", "deepseek_v4", "lfm2", "seed_oss", "apertus",
                "command_r7b"]


@pytest.mark.parametrize("framing", ["gpt_oss", "glm45", "llama3", "mistral", "deepseek_v31",
                                     "deepseek_r1", "kimi_k2", "minimax_m2", "generic",
                                     *NEW_FAMILIES])
@pytest.mark.parametrize("reasoning", [False, True])
def test_forced_call_grammar_is_valid_gbnf(framing: str, reasoning: bool) -> None:
    tools = TOOLS + [{"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["path"]}}}]
    text = tool_call_grammar(framing, tools, allow_reasoning=reasoning, parallel=True)
    check_grammar(text)
    assert "special_function" in text and "write" in text


WRITE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["path"]}}}]
# one call of each family as its model writes it: write(path="a.txt", n=3), get_weather(Rome)
FORCED = {
    "gemma4": ('<|tool_call>call:write{path:<|"|>a.txt<|"|>,n:3}<tool_call|>',
               '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>'),
    "deepseek_v32": ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="write">\n<｜DSML｜parameter '
                     'name="path" string="true">a.txt</｜DSML｜parameter>\n<｜DSML｜parameter '
                     'name="n" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                     '</｜DSML｜function_calls>',
                     '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜'
                     'parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜'
                     'invoke>\n</｜DSML｜function_calls>'),
    "seed_oss": ("<seed:tool_call>\n<function=write>\n<parameter=path>a.txt</parameter>\n"
                 "<parameter=n>3</parameter>\n</function>\n</seed:tool_call>",
                 "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n"
                 "</function>\n</seed:tool_call>"),
    "lfm2": ('<|tool_call_start|>[write(path="a.txt", n=3)]<|tool_call_end|>',
             '<|tool_call_start|>[get_weather(city="Rome")]<|tool_call_end|>'),
    "apertus": ('<|tools_prefix|>[{"write": {"path": "a.txt", "n": 3}}]<|tools_suffix|>',
                '<|tools_prefix|>[{"get_weather": {"city": "Rome"}}]<|tools_suffix|>'),
    "command_r7b": ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "write", "parameters": '
                    '{"path": "a.txt", "n": 3}}]<|END_ACTION|>',
                    '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                    '"parameters": {"city": "Rome"}}]<|END_ACTION|>'),
}
FORCED["deepseek_v4"] = tuple(t.replace("function_calls", "tool_calls")
                              for t in FORCED["deepseek_v32"])


@pytest.mark.parametrize("framing", NEW_FAMILIES)
def test_forced_call_grammar_takes_the_familys_own_call(framing: str) -> None:
    """The grammar accepts the family's call (and rejects a made-up tool), and what it
    accepts parses back to the call."""
    from test_grammar import Gbnf
    grammar = Gbnf(tool_call_grammar(framing, WRITE_TOOLS, allow_reasoning=False))
    first, second = FORCED[framing]
    assert grammar.matches(first) and grammar.matches(second)
    assert not grammar.matches(first.replace("write", "erase"))
    assert not grammar.matches(second.replace("Rome", "Oslo"))
    view = _whole(framing, first, False)
    assert [(c.name, json.loads(c.arguments_text)) for c in view.tool_calls] == \
        [("write", {"path": "a.txt", "n": 3})]
    opener, closer = families.reasoning_markers(framing)
    thinking = Gbnf(tool_call_grammar(framing, WRITE_TOOLS, allow_reasoning=True,
                                           parallel=True))
    assert thinking.matches(f"{opener}\nhmm{closer}{first}")
    if framing not in ("lfm2", "apertus", "command_r7b"):   # those list calls in one block
        assert thinking.matches(f"{first}\n{second}")
    view = _whole(framing, f"{opener}\nhmm{closer}{first}", False)
    assert view.reasoning == "hmm" and len(view.tool_calls) == 1


def test_lazy_triggers_are_the_familys_markers() -> None:
    from bmoe.engine.turn import _lazy_call_grammar
    lazy = _lazy_call_grammar("glm45", TOOLS)
    assert lazy is not None and lazy.triggers == ["<tool_call>"]
    lazy = _lazy_call_grammar("kimi_k2", TOOLS)
    assert lazy is not None and lazy.triggers == ["<|tool_calls_section_begin|>"]
    for framing, word in [("gemma4", "<|tool_call>"), ("deepseek_v32", "<｜DSML｜function_calls>"),
                          ("deepseek_v4", "<｜DSML｜tool_calls>"), ("lfm2", "<|tool_call_start|>"),
                          ("seed_oss", "<seed:tool_call>"), ("apertus", "<|tools_prefix|>"),
                          ("command_r7b", "<|START_ACTION|>")]:
        lazy = _lazy_call_grammar(framing, TOOLS)
        assert lazy is not None and lazy.triggers == [word], framing


# -- generated outputs: each family writes random reasoning, content and calls ----------

_ALPHABET = "ab x<|>{}\"\n:é[]/\\'"
FUZZ_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"k1": {"type": "string"}, "k2": {"type": "string"}}}}}
    for n in ("f", "g_2")]


def _text(rng: random.Random, lead: str = "a") -> str:
    body = "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(0, 24)))
    return (lead + body + "a").strip()


def _xml_pairs(args: dict, key_open: str, key_close: str, value_close: str) -> str:
    return "".join(f"{key_open}{k}{key_close}{v}{value_close}" for k, v in args.items())


def _write(framing: str, r: str, c: str, calls: list[tuple[str, dict]]) -> tuple[str, bool]:
    j = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    if framing == "gpt_oss":
        out = f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant" if r else ""
        if c and not calls:
            return out + f"<|channel|>final<|message|>{c}<|return|>", False
        if c:
            out += f"<|channel|>commentary<|message|>{c}<|end|><|start|>assistant"
        return out + "<|start|>assistant".join(
            f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{a}<|call|>"
            for n, a in j), False
    if framing == "glm45":
        return (f"{r}</think>{c}" + "".join(
            f"<tool_call>{n}\n" + _xml_pairs(a, "<arg_key>", "</arg_key>\n<arg_value>",
                                             "</arg_value>\n") + "</tool_call>"
            for n, a in calls)), True
    if framing == "minimax_m2":
        return (f"{r}\n</think>\n\n{c}" + ("<minimax:tool_call>\n" + "".join(
            f'<invoke name="{n}">\n' + _xml_pairs(a, '<parameter name="', '">', "</parameter>\n")
            + "</invoke>\n" for n, a in calls) + "</minimax:tool_call>" if calls else "")), True
    if framing == "mistral":
        return ((f"[THINK]{r}[/THINK]" if r else "") + c
                + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in j)), False
    if framing == "deepseek_v31":
        return (f"{r}</think>{c}" + ("<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in j)
            + "<｜tool▁calls▁end｜>" if calls else "")), True
    if framing == "deepseek_r1":
        return ((f"<think>{r}</think>" if r else "") + c + ("<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>"
            for n, a in j) + "<｜tool▁calls▁end｜>" if calls else "")), False
    if framing == "kimi_k2":
        return ((f"<think>{r}</think>" if r else "") + c + ("<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
            for i, (n, a) in enumerate(j)) + "<|tool_calls_section_end|>" if calls else "")), False
    if framing == "llama3":
        if calls:
            return "<|python_tag|>" + "; ".join(
                json.dumps({"name": n, "parameters": a}) for n, a in calls), False
        return c, False
    if framing == "gemma4":
        from bmoe.engine.families.gemma4 import write_value
        return ((f"<|channel>thought\n{r}<channel|>" if r else "") + c + "".join(
            f"<|tool_call>call:{n}{write_value(a)}<tool_call|>" for n, a in calls)), False
    if framing in ("deepseek_v32", "deepseek_v4"):
        block = "function_calls" if framing == "deepseek_v32" else "tool_calls"
        return (f"{r}</think>{c}" + (f"\n\n<｜DSML｜{block}>\n" + "".join(
            f'<｜DSML｜invoke name="{n}">\n' + "".join(
                f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>\n'
                for k, v in a.items()) + "</｜DSML｜invoke>\n" for n, a in calls)
            + f"</｜DSML｜{block}>" if calls else "")), True
    if framing == "lfm2":
        return ((f"<think>{r}</think>" if r else "") + c + ("<|tool_call_start|>[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in a.items())
            + ")" for n, a in calls) + "]<|tool_call_end|>" if calls else "")), False
    if framing == "seed_oss":
        return ((f"<seed:think>{r}</seed:think>" if r else "") + c + "".join(
            f"<seed:tool_call>\n<function={n}>\n" + _xml_pairs(a, "<parameter=", ">",
                                                               "</parameter>\n")
            + "</function>\n</seed:tool_call>" for n, a in calls)), False
    if framing == "apertus":
        return ((f"<|inner_prefix|>{r}<|inner_suffix|>" if r else "") + c + (
            "<|tools_prefix|>" + json.dumps([{n: a} for n, a in calls], ensure_ascii=False)
            + "<|tools_suffix|>" if calls else "")), False
    if framing == "command_r7b":
        return ((f"<|START_THINKING|>{r}<|END_THINKING|>" if r else "")
                + (f"<|START_RESPONSE|>{c}<|END_RESPONSE|>" if c else "") + (
            "<|START_ACTION|>" + json.dumps(
                [{"tool_call_id": str(i), "tool_name": n, "parameters": a}
                 for i, (n, a) in enumerate(calls)], indent=4) + "<|END_ACTION|>"
            if calls else "")), False
    assert framing == "generic"
    if calls:
        return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}), False
    return json.dumps({"response": c}), False


GENERATED = dict.fromkeys(("gpt_oss", "glm45", "minimax_m2", "mistral", "deepseek_v31",
                           "deepseek_r1", "kimi_k2", "llama3", "generic", "gemma4",
                           "deepseek_v32", "deepseek_v4", "lfm2", "seed_oss", "apertus",
                           "command_r7b"), 1000)     # outputs per family (issue 30's bar)


@pytest.mark.parametrize("framing", sorted(GENERATED))
def test_generated_outputs_parse_back_streamed_and_whole(framing: str) -> None:
    rng = random.Random("gen-" + framing)
    no_reasoning = framing in ("llama3", "generic")
    for _ in range(GENERATED[framing]):
        r = "" if no_reasoning or rng.random() < 0.3 else _text(rng)
        calls = [(rng.choice(["f", "g_2"]), {k: _text(rng) for k in rng.sample(["k1", "k2"],
                                                                                 rng.randrange(3))})
                 for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        c = "" if (calls and (framing in ("llama3", "generic") or rng.random() < 0.5)) \
            else _text(rng)
        if framing == "gemma4":                  # a Gemma string cannot hold its own quote
            calls = [(n, {k: v.replace('<|"|>', "") for k, v in a.items()}) for n, a in calls]
        text, starts = _write(framing, r, c, calls)
        parser = output_parser(framing, starts, FUZZ_TOOLS)
        deltas, sent, i = ChatDeltaStream(), [], 0
        while i < len(text):
            j = min(len(text), i + rng.choice([1, 2, 3, 4, 7, 11, 30]))
            parser.feed(text[i:j])
            sent += deltas.update(parser.snapshot())
            i = j
        view = parser.finish()
        sent += deltas.finish(view)
        assert (view.reasoning, view.content) == (r, c), text
        assert [(t.name, json.loads(t.arguments_text)) for t in view.tool_calls] == calls, text
        assert not any(d.get("reset") for d in sent), text
        assert "".join(d.get("content", "") for d in sent) == c
        assert "".join(d.get("reasoning_content", "") for d in sent) == r
        whole = output_parser(framing, starts, FUZZ_TOOLS)
        whole.feed(text)
        assert whole.finish() == view


def test_reasoning_format_none_keeps_the_familys_own_markers() -> None:
    """llama-server's --reasoning-format none beside tools: the reasoning goes back into
    the content in the family's own markers (Gemma 4's thought channel), calls still read."""
    from bmoe.engine.turn import Prepared, TurnRequest
    from bmoe.runtime.turnevents import TurnOutput
    text = ("<|channel>thought\nLet me see.<channel|>"
            '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>')
    prepared = Prepared("", [], False, "gemma4", None, 0, family="gemma4")
    out = TurnOutput(prepared, TurnRequest(messages=[], tools=TOOLS_ANY), "revisable",
                     reasoning_format="none")
    for i in range(0, len(text), 3):
        out.feed(text[i:i + 3], 1)
    out.finish()
    assert out.view.reasoning == ""
    assert out.view.content == "<|channel>thought\nLet me see.\n<channel|>"
    assert [(c.name, json.loads(c.arguments_text)) for c in out.view.tool_calls] == \
        [("get_time", {"city": "Paris"})]


@pytest.mark.parametrize("framing,text", [
    ("gemma4", "<|tool_call>call:f{a:" + "{a:" * 5000 + "1" + "}" * 5001 + "<tool_call|>"),
    ("lfm2", "<|tool_call_start|>[f(a=" + "[" * 5000 + "]" * 5000 + ")]<|tool_call_end|>"),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter '
     'name="a" string="false">' + "[" * 100000 + "]" * 100000 + "</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    ("seed_oss", "<seed:tool_call>\n<function=f>\n<parameter=a>" + "[" * 100000 + "]" * 100000
     + "</parameter>\n</function>\n</seed:tool_call>"),
])
def test_arguments_nested_past_the_stack_do_not_break_the_turn(framing: str, text: str) -> None:
    view = _whole(framing, text, False)
    assert all(c.name == "f" for c in view.tool_calls)
