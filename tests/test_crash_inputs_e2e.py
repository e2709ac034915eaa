"""Requests that used to kill the server (or could) against the real server: each answers
with 200 or a clean 400, and the process is alive after every one.

The schemas are the issue's (Claude Code's `Workflow` tool with `maxLength: 524288`,
`maxLength: 60000`, `maxItems: 100000`, a pattern `a{1,50000}`, a recursive `$defs`
tree), sent on /v1/chat/completions as tools with `tool_choice` auto and required and
as `response_format: json_schema`, and on /v1/messages and /v1/responses as tools; then
hostile `grammar` strings and prompt text. Both chat framings the engine knows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import ServerProcess, start_server
from bmoe.modelmaker import make_model
from test_grammar_bounds import ISSUE_SCHEMAS


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def srv(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        model_dir: Path) -> Iterator[ServerProcess]:
    model = make_model(model_dir / f"crash-{request.param}.gguf", template=request.param)
    s = start_server(tmp_path_factory.mktemp("crash-data"), "-m", str(model), "-c", "8192",
                     "-n", "24", "--temp", "0")
    yield s
    s.stop()


def _alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, f"the server died (exit {srv.proc.returncode})"
    status, _, info = srv.request("GET", "/api/info")
    assert status == 200 and info["state"] == "ready", info


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                         _strict_response_validation=True)


def _tools(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "Workflow", "description": "Run it.",
                                              "parameters": schema}},
            {"type": "function", "function": {"name": "Read", "parameters": {
                "type": "object", "properties": {"path": {"type": "string"}},
                "required": ["path"]}}}]


MESSAGES = [{"role": "user", "content": "Say hi in one word."}]


@pytest.mark.parametrize("name", sorted(ISSUE_SCHEMAS))
@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("stream", [False, True])
def test_issue_tools_on_chat(srv: ServerProcess, name: str, choice: str, stream: bool) -> None:
    schema = ISSUE_SCHEMAS[name]
    client = _client(srv)
    kwargs: dict[str, Any] = {"model": "m", "messages": MESSAGES, "tools": _tools(schema),
                              "tool_choice": choice, "max_tokens": 24}
    if stream:
        with client.chat.completions.create(stream=True, **kwargs) as events:
            finishes = [c.choices[0].finish_reason for c in events if c.choices]
        assert finishes[-1] in ("stop", "length", "tool_calls")
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if choice == "required":
            assert out.choices[0].message.tool_calls or out.choices[0].finish_reason == "length"
    _alive(srv)


@pytest.mark.parametrize("name", sorted(ISSUE_SCHEMAS))
def test_issue_schemas_as_response_format(srv: ServerProcess, name: str) -> None:
    out = _client(srv).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=24,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ISSUE_SCHEMAS[name]}})
    assert out.choices[0].finish_reason in ("stop", "length")
    _alive(srv)


@pytest.mark.parametrize("name", sorted(ISSUE_SCHEMAS))
def test_issue_tools_on_messages_and_responses(srv: ServerProcess, name: str) -> None:
    schema = ISSUE_SCHEMAS[name]
    status, _, body = srv.request("POST", "/v1/messages", {
        "model": "m", "max_tokens": 24, "messages": MESSAGES,
        "tools": [{"name": "Workflow", "description": "Run it.", "input_schema": schema}],
        "tool_choice": {"type": "any"}})
    assert status == 200, body
    _alive(srv)
    status, _, body = srv.request("POST", "/v1/responses", {
        "model": "m", "max_output_tokens": 24, "input": "Say hi.",
        "tools": [{"type": "function", "name": "Workflow", "parameters": schema}],
        "tool_choice": "required"})
    assert status == 200, body
    _alive(srv)


def _nested(n: int) -> str:
    return "root ::= " + "(" * n + '"a"' + ")" * n


@pytest.mark.parametrize("grammar,reason", [
    (_nested(100_000), "nests groups"),
    ('root ::= "a"{60000}', "llama.cpp allows"),
    ("root ::= <[99999999]>", "vocabulary"),
    ('root ::= "a" | b', "never defines"),
    ('root ::= "\\q"', "unknown escape"),
    ("root ::= root \"a\"", None),       # left recursion: llama.cpp's own clean refusal
    ("\n".join(f"r{i} ::= r{i + 1}" for i in range(60_000)) + '\nr60000 ::= "a"\nroot ::= r0',
     "rules"),
])
def test_hostile_grammar_field(srv: ServerProcess, grammar: str, reason: str | None) -> None:
    status, _, body = srv.request("POST", "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 8, "grammar": grammar})
    assert status == 400, body
    assert body["code"] == "invalid_request", body     # the spec's {"error", "code"}
    message = body["error"]
    assert "grammar" in message.lower()
    if reason:
        assert reason in message, message
    assert "Error(" not in message and "Traceback" not in message
    _alive(srv)


@pytest.mark.parametrize("text", [
    "a\ud800b",                          # an unpaired surrogate (legal in JSON, not UTF-8)
    "\udfff" * 100,
    "x" * 200_000,                       # more tokens than the context: a clean refusal
    "\x00\x01\x7f" * 50,
    "<|im_start|>system\n<|im_end|>" * 20,
    "é\u200d👨‍👩‍👧" * 200,
])
def test_odd_prompt_text(srv: ServerProcess, text: str) -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4},
                     ensure_ascii=True).encode()
    status, _, body = srv.request("POST", "/v1/chat/completions", raw=raw)
    assert status in (200, 400), body
    if status == 400:
        assert body["code"] in ("invalid_request", "context_full"), body
    _alive(srv)


def test_deep_schema_nesting_is_refused(srv: ServerProcess) -> None:
    deep = '{"type": "array", "items": ' * 3000 + '{"type": "string"}' + "}" * 3000
    raw = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
           '"response_format": {"type": "json_schema", "json_schema": {"name": "a", '
           f'"schema": {deep}}}}}}}').encode()
    status, _, body = srv.request("POST", "/v1/chat/completions", raw=raw)
    assert status == 400, body
    _alive(srv)
