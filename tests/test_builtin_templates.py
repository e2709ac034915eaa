"""The chat formats a person names with ``--chat-template NAME``, as llama-server has them.

Every one of llama.cpp's 54 names is accepted. chatml, gemma and llama3 are Jinja of our
own; the rest are rendered by llama.cpp's own formatter (``llama_chat_apply_template``),
so they are byte for byte llama-server's ``--no-jinja`` prompts. The expected prompts
below are the legacy outputs in llama.cpp's ``tests/test-chat-template.cpp`` for its
six-message conversation, and the server case is ``test_apply_chat_template`` of
llama-server's own suite.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as lc
import pytest

from bmoe.engine import builtin_templates, params
from bmoe.engine.builtin_templates import LegacyTemplate
from conftest import ServerProcess, start_server

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]

# name -> the legacy expected output of test-chat-template.cpp's case for that format
EXPECTED = {
    "command-r": (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "phi3": (
        "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\n"
        "Hi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   "
        "<|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n"),
    "chatglm3": (
        "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi "
        "there<|user|>\n Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another "
        "question<|assistant|>"),
    "chatglm4": (
        "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi "
        "there<|user|>\nWho are you<|assistant|>\n   I am an assistant   <|user|>\nAnother "
        "question<|assistant|>\n"),
    "deepseek2": (
        "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>"
        "User: Who are you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: "
        "Another question\n\nAssistant:"),
    "mistral-v7": (
        "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi "
        "there</s>[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another "
        "question[/INST]"),
    "phi4": (
        "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user"
        "<|im_sep|>Hello<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|>"
        "<|im_start|>user<|im_sep|>Who are you<|im_end|><|im_start|>assistant<|im_sep|>   I am "
        "an assistant   <|im_end|><|im_start|>user<|im_sep|>Another question<|im_end|>"
        "<|im_start|>assistant<|im_sep|>"),
    "seed_oss": (
        "<seed:bos>system\nYou are a helpful assistant<seed:eos><seed:bos>user\nHello<seed:eos>"
        "<seed:bos>assistant\nHi there<seed:eos><seed:bos>user\nWho are you<seed:eos><seed:bos>"
        "assistant\nI am an assistant<seed:eos><seed:bos>user\nAnother question<seed:eos>"
        "<seed:bos>assistant\n"),
}


def test_the_names_are_llama_cpps_own() -> None:
    n = lc.llama_chat_builtin_templates(None, 0)
    out = (ctypes.c_char_p * n)()
    assert lc.llama_chat_builtin_templates(out, n) == n
    assert sorted(v.decode() for v in out if v) == sorted(builtin_templates.LEGACY)
    assert len(builtin_templates.NAMES) == 54


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_name_renders_llama_cpps_expected_prompt(name: str) -> None:
    assert LegacyTemplate(name).render(CONVERSATION) == EXPECTED[name]


@pytest.mark.parametrize("name", builtin_templates.NAMES)
def test_every_name_is_a_setting_and_renders(name: str) -> None:
    assert params.parse_value(params.param("chat-template"), f" {name.upper()} ") \
        == f" {name.upper()} "
    text = builtin_templates.resolve(name)
    assert text is not None
    if builtin_templates.is_legacy(text):
        out = LegacyTemplate(text).render(CONVERSATION)
        assert "Another question" in out and "Who are you" in out


def test_parts_are_joined_as_llama_server_joins_them_and_nul_is_dropped() -> None:
    t = LegacyTemplate("command-r")
    out = t.render([{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "two\0three"}]}], add_generation_prompt=False)
    assert out == ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>one\ntwothree<|END_OF_TURN_TOKEN|>")


def test_a_name_that_is_not_one_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError) as info:
        params.parse_value(params.param("chat-template"), "command-x")
    assert "command-r" in str(info.value) and "mistral-v7" in str(info.value)


@pytest.fixture(scope="module")
def command_r(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("command-r"), "--model", str(tiny_moe),
                       "--no-jinja", "--chat-template", "command-r", "-c", "256")
    try:
        yield srv
    finally:
        srv.stop()


def test_llama_servers_own_case_and_a_chat_through_the_engine(command_r: ServerProcess) -> None:
    status, _, body = command_r.request("POST", "/apply-template", {"messages": [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "Hi there"}]})
    assert status == 200, body
    assert body["prompt"] == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert command_r.request("GET", "/props")[2]["chat_template"] == "command-r"
    status, _, chat = command_r.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert status == 200, chat
    assert chat["usage"]["completion_tokens"] >= 1
