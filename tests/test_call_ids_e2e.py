"""Call ids a family's format carries are the model's own, on every protocol, and they
come back in the next turn.

The tiny model served with the sdist's real templates, its calls forced by the family's
grammar (``tool_choice`` required / any): Kimi K2 writes ``functions.NAME:0`` as the
call's id, and that id (not a server-made one) is the call's on ``/v1/chat/completions``
(whole and streamed), ``/v1/messages`` and ``/v1/responses``; sent back with the tool's
result, the template renders the result under the call it answers. Mistral's template
refuses any id but 9 letters and digits: the calls its model makes without one get such
ids, so the next turn renders on every protocol. Hermes (no id in its format) keeps the
server's ``call_...`` ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _llama_templates import templates_dir
from conftest import ServerProcess, start_server

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Rome?"}]
NO_THINK = {"enable_thinking": False}


def serve(tmp: Path, model: Path, template: str) -> ServerProcess:
    srv = start_server(tmp, "-m", str(model), "-c", "4096",
                       "--chat-template-file", str(templates_dir() / template))
    assert srv.info()["state"] == "ready", srv.info()
    return srv


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = serve(tmp_path_factory.mktemp("ids-kimi"), tiny_moe, "moonshotai-Kimi-K2.jinja")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = serve(tmp_path_factory.mktemp("ids-mistral"), tiny_moe,
                "Mistral-Small-3.2-24B-Instruct-2506.jinja")
    yield srv
    srv.stop()


def post(srv: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    status, _, out = srv.request("POST", path, body, timeout=120)
    assert status == 200, (path, out)
    return out


def chat_call(srv: ServerProcess) -> dict[str, Any]:
    out = post(srv, "/v1/chat/completions", {
        "messages": ASK, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 400,
        "chat_template_kwargs": NO_THINK})
    (call,) = out["choices"][0]["message"]["tool_calls"]
    return call


def streamed_chat_ids(srv: ServerProcess) -> list[str]:
    status, _, raw = srv.request("POST", "/v1/chat/completions", {
        "messages": ASK, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 400,
        "stream": True, "chat_template_kwargs": NO_THINK}, timeout=120)
    assert status == 200
    text = raw.decode() if isinstance(raw, bytes) else json.dumps(raw)
    ids = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                ids += [c["id"] for c in choice["delta"].get("tool_calls") or [] if "id" in c]
    return ids


def messages_call(srv: ServerProcess, messages: list[dict[str, Any]] | None = None) -> Any:
    return post(srv, "/v1/messages", {
        "model": "x", "max_tokens": 400, "messages": messages or ASK,
        "tools": [{"name": "get_weather", "input_schema": PARAMS}],
        "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}})


def responses_call(srv: ServerProcess, items: list[dict[str, Any]] | None = None) -> Any:
    return post(srv, "/v1/responses", {
        "model": "x", "max_output_tokens": 400,
        "input": items or [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        "tool_choice": "required", "reasoning": {"effort": "none"}})


def chat_reply(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]


KIMI_ID = "functions.get_weather:0"


def test_kimi_keeps_its_own_id_on_chat_completions(kimi: ServerProcess) -> None:
    call = chat_call(kimi)
    assert call["id"] == KIMI_ID and call["function"]["name"] == "get_weather"
    assert streamed_chat_ids(kimi) == [KIMI_ID]
    # the next turn: the result renders under the call it answers
    out = post(kimi, "/apply-template", {"messages": chat_reply(call), "tools": CHAT_TOOLS})
    assert f"<|tool_call_begin|>{KIMI_ID}<|tool_call_argument_begin|>" in out["prompt"]
    assert f"## Return of {KIMI_ID}" in out["prompt"]


def test_kimi_keeps_its_own_id_on_messages(kimi: ServerProcess) -> None:
    first = messages_call(kimi)
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    assert use["id"] == KIMI_ID
    again = messages_call(kimi, [*ASK, {"role": "assistant", "content": [use]},
                                 {"role": "user", "content": [{"type": "tool_result",
                                                               "tool_use_id": use["id"],
                                                               "content": "sunny"}]}])
    # the model calls again: its ids count the conversation's calls, so this one is :1
    (use2,) = [b for b in again["content"] if b["type"] == "tool_use"]
    assert use2["id"] == "functions.get_weather:1"


def test_kimi_keeps_its_own_id_on_responses(kimi: ServerProcess) -> None:
    first = responses_call(kimi)
    (call,) = [i for i in first["output"] if i["type"] == "function_call"]
    assert call["call_id"] == KIMI_ID
    again = responses_call(kimi, [{"role": "user", "content": "Weather in Rome?"}, call,
                                  {"type": "function_call_output", "call_id": call["call_id"],
                                   "output": "sunny"}])
    (call2,) = [i for i in again["output"] if i["type"] == "function_call"]
    assert call2["call_id"] == "functions.get_weather:1"


def test_mistral_ids_are_the_ones_its_template_takes(mistral: ServerProcess) -> None:
    call = chat_call(mistral)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call
    out = post(mistral, "/apply-template", {"messages": chat_reply(call), "tools": CHAT_TOOLS})
    assert f"[CALL_ID]{call['id']}[ARGS]" in out["prompt"]
    assert f"[TOOL_RESULTS]{call['id']}[TOOL_CONTENT]sunny" in out["prompt"]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in streamed_chat_ids(mistral))
    # the next turn on /v1/messages and /v1/responses renders (the template would refuse
    # any other id) and calls again
    first = messages_call(mistral)
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", use["id"]), use
    messages_call(mistral, [*ASK, {"role": "assistant", "content": [use]},
                            {"role": "user", "content": [{"type": "tool_result",
                                                          "tool_use_id": use["id"],
                                                          "content": "sunny"}]}])
    first = responses_call(mistral)
    (item,) = [i for i in first["output"] if i["type"] == "function_call"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", item["call_id"]), item
    responses_call(mistral, [{"role": "user", "content": "Weather in Rome?"}, item,
                             {"type": "function_call_output", "call_id": item["call_id"],
                              "output": "sunny"}])


def test_hermes_calls_keep_the_servers_ids(server: ServerProcess) -> None:
    assert chat_call(server)["id"].startswith("call_")


# -- the parsers and the id choice, no model -------------------------------------------

def test_each_format_reads_the_id_it_carries() -> None:
    from bmoe.engine.families import output_parser

    def ids(framing: str, text: str) -> list[str]:
        parser = output_parser(framing, False, CHAT_TOOLS)
        parser.feed(text)
        return [c.id for c in parser.finish().tool_calls]

    assert ids("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
               '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
               "<|tool_calls_section_end|>") == ["functions.get_weather:3"]
    assert ids("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}') \
        == ["a1b2c3d4e"]
    assert ids("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {}, "id": "x9"}]') \
        == ["x9"]
    assert ids("command_r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": '
               '"get_weather", "parameters": {}}]<|END_ACTION|>') == ["0"]
    assert ids("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {}, '
               '"id": "c1"}]}') == ["c1"]
    assert ids("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome"
               "</arg_value>\n</tool_call>") == [""]


def test_an_id_already_taken_or_unusable_is_replaced() -> None:
    from bmoe.engine.chatparse import ToolCallView, choose_call_id, conversation_call_ids
    taken = conversation_call_ids(chat_reply({"id": "functions.f:0", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}))
    assert taken == {"functions.f:0"}
    made = iter(["new1", "new2", "new3", "new4"])
    pick = [choose_call_id(ToolCallView("f", "{}", True, i), taken, lambda: next(made))
            for i in ("functions.f:0", "functions.f:1", "functions.f:1", "", "a b\n")]
    assert pick == ["new1", "functions.f:1", "new2", "new3", "new4"]
