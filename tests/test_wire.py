"""The wire models down to the nested parts: a wrong value anywhere in a body is a 400
`invalid_request` naming its full path in a sentence of ours; unknown fields are
ignored; the real clients' captured requests pass. No model, no socket."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bmoe.http.errors import HTTPError
from bmoe.server import wire
from bmoe.server.protocols import anthropic, completions, openai_chat, responses

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json"))
DECODE = {"/v1/messages": anthropic.decode, "/v1/responses": responses.decode,
          "/v1/chat/completions": openai_chat.decode}
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAE"
       "lFTkSuQmCC")


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=lambda: {"n-predict": 0, "think": True})
    user_keys: list[str] = field(default_factory=list)


def refusal(decode: Any, body: dict[str, Any]) -> str:
    with pytest.raises(HTTPError) as info:
        decode(body, Config())
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    return info.value.message


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


MESSAGES = [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": [
                       {"type": "text", "text": "c"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": 5}}]}]},
     "`messages[2].content[1].source.data` must be a string."),
    ({"messages": user([{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "ok"}, {"type": "text"}]}])},
     "`messages[0].content[0].content[1].text` is required."),
    ({"messages": user([{"type": "tool_result", "tool_use_id": 7}])},
     "`messages[0].content[0].tool_use_id` must be a string."),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}, *user("y")]},
     "`messages[1].content[0].type` is 'tool_result'; here it must be \"text\", \"thinking\", "
     "\"redacted_thinking\" or \"tool_use\"."),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, *user("y")]},
     "`messages[1].content[0].input` must be an object."),
    ({"messages": user([{"text": "no type"}])},
     "`messages[0].content[0].type` is required: \"text\", \"image\", \"tool_result\" or "
     "\"document\"."),
    ({"messages": user(["a string, not a block"])}, "`messages[0].content[0]` must be an object."),
    ({"messages": user(5)}, "`messages[0].content` must be a string or an array."),
    ({"messages": [{"role": "robot", "content": "x"}]},
     "`messages[0].role` is 'robot'; here it must be \"user\", \"assistant\" or \"system\"."),
    ({"messages": user("x"), "system": [{"type": "text", "text": 1}]},
     "`system[0].text` must be a string."),
    ({"messages": user("x"), "system": [{"type": "image"}]},
     "`system[0].type` must be \"text\"."),
    ({"messages": user("x"), "tools": [{"name": "f", "input_schema": {"type": "object"}},
                                       {"name": "g", "input_schema": True}]},
     "`tools[1].input_schema` must be a JSON object schema; boolean schemas are not supported."),
    ({"messages": user("x"), "tools": [{"name": "", "input_schema": {}}]},
     "`tools[0].name` must not be empty."),
    ({"messages": user("x"), "tool_choice": {"type": "some"}},
     "`tool_choice.type` is 'some'; here it must be \"auto\", \"any\", \"none\" or \"tool\"."),
    ({"messages": user("x"), "tool_choice": {"type": "tool"}}, "`tool_choice.name` is required."),
    ({"messages": user("x"), "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "g"}},
     "`tool_choice` names 'g', which is not among the function `tools`."),
    ({"messages": user("x"), "tool_choice": {"type": "any"}},
     "`tool_choice` asks for a tool call, but there are no function `tools` to call."),
    ({"messages": user("x"), "thinking": {"type": "enabled", "budget_tokens": 9},
      "max_tokens": 2.5}, "`max_tokens` must be a non-negative integer."),
    ({"messages": user("x"), "output_config": {"format": {"type": "json_schema",
                                                           "schema": []}}},
     "`output_config.format.schema` must be a JSON object schema."),
    ({"messages": user([{"type": "document", "source": {}}])},
     "`messages[0].content[0]`: documents are not supported; send text."),
    ({"messages": user([{"type": "image", "source": {"type": "url", "url": "https://x"}}])},
     "`messages[0].content[0].source.type` must be \"base64\""),
]

CHAT = [
    ({"messages": user([{"type": "text", "text": "a"}, {"type": "image_url",
                                                        "image_url": {"url": 3}}])},
     "`messages[0].content[1].image_url.url` must be a string."),
    ({"messages": user([{"type": "video"}])},
     "`messages[0].content[0].type` is 'video'; here it must be \"text\", \"image_url\", "
     "\"input_audio\", \"file\" or \"audio\"."),
    ({"messages": user([{"type": "input_audio", "input_audio": {}}])},
     "`messages[0].content[0]`: input_audio parts are not supported; send text."),
    ({"messages": [*user("x"), {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": 3}}]}, *user("y")]},
     "`messages[1].tool_calls[0].function.arguments` must be a string or an object."),
    ({"messages": user("x"), "tools": [{"type": "function", "function": {"name": "f"}},
                                       {"type": "function", "function": {"parameters": {}}}]},
     "`tools[1].function.name` is required."),
    ({"messages": user("x"), "tools": [{"type": "retrieval"}]},
     "`tools[0].type` must be \"function\"."),
    ({"messages": user("x"), "tool_choice": {"type": "function", "function": {"name": 1}}},
     "`tool_choice.function.name` must be a string."),
    ({"messages": user("x"), "response_format": {"type": "json_schema",
                                                 "json_schema": {"strict": "yes"}}},
     "`response_format.json_schema.strict` must be true or false."),
    ({"messages": user("x"), "chat_template_kwargs": {"enable_thinking": 1}},
     "`chat_template_kwargs.enable_thinking` must be true or false."),
    ({"messages": user("x"), "stream_options": {"include_usage": "yes"}},
     "`stream_options.include_usage` must be true or false."),
    ({"messages": user("x"), "max_completion_tokens": -3},
     "`max_completion_tokens` must be a non-negative integer."),
]

RESPONSES = [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": None}]}]},
     "`input[0].content[1].text` must be a string."),
    ({"input": [{"role": "user", "content": "q"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "`input[1].arguments` must be a string."),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "a"}, {"type": "output_text"}]}]},
     "`input[0].output[1].text` is required."),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 1}]},
                {"role": "user", "content": "q"}]},
     "`input[0].content[0].text` must be a string."),
    ({"input": [{"type": "compaction"}]},
     "`input[0].type` is 'compaction'; here it must be \"message\", \"function_call\", "
     "\"function_call_output\", \"reasoning\" or \"item_reference\"."),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "`input[0]` is an item_reference."),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                  "image_url": "data:,"}]},
                {"role": "user", "content": "q"}]},
     "`input[0].content[0]`: only a user message or a function_call_output carries images."),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "`tools[0].parameters` must be a JSON object schema."),
    ({"input": "x", "tool_choice": {"type": "function"}}, "`tool_choice.name` is required."),
    ({"input": "x", "text": {"format": {"type": "yaml"}}},
     "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"."),
    ({"input": "x", "reasoning": {"effort": 2}}, "`reasoning.effort` must be a string."),
]


@pytest.mark.parametrize("body,said", MESSAGES)
def test_messages_nested_paths(body: dict[str, Any], said: str) -> None:
    assert refusal(anthropic.decode, body).startswith(said)


@pytest.mark.parametrize("body,said", CHAT)
def test_chat_nested_paths(body: dict[str, Any], said: str) -> None:
    assert refusal(openai_chat.decode, body).startswith(said)


@pytest.mark.parametrize("body,said", RESPONSES)
def test_responses_nested_paths(body: dict[str, Any], said: str) -> None:
    assert refusal(responses.decode, body).startswith(said)


def test_unknown_fields_are_ignored_at_every_depth() -> None:
    extra = {"cache_control": {"type": "ephemeral"}, "citations": None, "future": [1]}
    req = anthropic.decode({"messages": user([
        {"type": "text", "text": "Look:", **extra},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG, **extra}, **extra}]),
        "tools": [{"name": "f", "input_schema": {"type": "object"}, **extra}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, **extra}, Config())
    assert req.images is not None and len(req.images) == 1
    assert req.messages[-1]["content"].startswith("Look:")
    chat = openai_chat.decode({"messages": user([{"type": "text", "text": "hi", **extra}]),
                               "tools": [{"type": "function", "strict": True, "function": {
                                   "name": "f", "parameters": {}, **extra}}]}, Config())
    assert chat.tools is not None and chat.tools[0]["function"]["name"] == "f"
    resp = responses.decode({"input": [{"role": "user", "id": "m1", "status": "completed",
                                        "content": [{"type": "input_text", "text": "q",
                                                     **extra}]}],
                             "tools": [{"type": "web_search", "anything": 1}]}, Config())
    assert resp.messages == [{"role": "user", "content": "q"}] and resp.tools is None


def test_a_server_tool_is_refused_with_its_reason() -> None:
    said = refusal(anthropic.decode, {"messages": user("x"), "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]})
    assert said.startswith("`tools[0]` is a server tool ('web_search_20250305')")


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_real_clients_requests_decode(path: Path) -> None:
    fixture = json.loads(path.read_text())
    req = DECODE[fixture["route"]](fixture["body"], Config())
    assert req.messages and req.messages[-1]["role"] == "user"
    assert req.tools and all(t["function"]["name"] for t in req.tools)


def test_field_path_skips_union_labels() -> None:
    loc = ("messages", "list[tagged-union[A,B]]", 2, "role=user", "content",
           "list[tagged-union[C,D]]", 1, "type=image", "source", "ImageSource", "data", "str")
    assert wire.field_path(loc) == "messages[2].content[1].source.data"
    assert wire.field_path((), "values.x") == "values.x"


@pytest.mark.parametrize("body,said", [
    ({"prompt": "x", "top_p": 2}, "`top_p` must be between 0 and 1."),
    ({"prompt": "x", "temperature": "hot"}, "`temperature` must be a finite number."),
    ({"prompt": "x", "temperature": float("inf")}, "`temperature` must be a finite number."),
    ({"prompt": "x", "top_k": True}, "`top_k` must be an integer."),
    ({"prompt": "x", "n_probs": 101}, "`n_probs` must be between 0 and 100."),
    ({"prompt": "x", "n_predict": 2.5}, "`n_predict` must be an integer."),
    ({"prompt": "x", "json_schema": True}, "`json_schema` must be a JSON object schema"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}},
     "`stream_options.include_usage` must be true or false."),
])
def test_completion_fields(body: dict[str, Any], said: str) -> None:
    with pytest.raises(HTTPError) as info:
        completions.decode_completion(body)
    assert info.value.status == 400 and info.value.message.startswith(said)


def test_completion_sampling_reads_the_model() -> None:
    req = completions.decode_completion({"prompt": "x", "top_k": 7.0, "seed": 5, "n_predict": 3.0,
                                         "temperature": 0})
    assert req.sampling is not None and (req.sampling.top_k, req.sampling.seed) == (7, 5)
    assert req.sampling.temperature == 0.0 and req.sampling.top_p == 0.95
    assert req.max_tokens == 3
    with pytest.raises(HTTPError, match="`best_of` above 1 is not supported"):
        completions.decode_openai({"prompt": "x", "best_of": 2})
    assert completions.decode_openai({"prompt": "x", "max_tokens": 4}).max_tokens == 4
