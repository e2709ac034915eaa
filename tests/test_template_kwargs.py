"""A request's ``chat_template_kwargs`` (llama-server's field) reach the model's template.

The tiny model served with the sdist's real Seed-OSS template (it reads
``thinking_budget``) and the server's ``--chat-template-kwargs``; a request's own
variables win over the server's, on ``/v1/chat/completions`` (the openai SDK's
``extra_body``) and ``/apply-template``; a bad object is a 400 ``invalid_request`` that
says what is wrong. And with Qwen3's template: the server's ``enable_thinking`` false, a
request's own true turns thinking back on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from _llama_templates import templates_dir
from conftest import ServerProcess, start_server

MSGS = [{"role": "user", "content": "Hello"}]


def budget_line(n: int) -> str:
    return f"complete your thinking within {n} tokens"


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("kwargs-seed"), "-m", str(tiny_moe), "-c", "2048",
                       "--chat-template-file", str(templates_dir() / "ByteDance-Seed-OSS.jinja"),
                       "--chat-template-kwargs", '{"thinking_budget": 512}')
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


def prompt(srv: ServerProcess, **body: object) -> str:
    status, _, out = srv.request("POST", "/apply-template", {"messages": MSGS, **body})
    assert status == 200, out
    return str(out["prompt"])


def test_the_requests_variables_win_over_the_servers(seed: ServerProcess) -> None:
    assert budget_line(512) in prompt(seed)
    mine = prompt(seed, chat_template_kwargs={"thinking_budget": 64})
    assert budget_line(64) in mine and budget_line(512) not in mine
    # a variable the request does not name keeps the server's value
    assert budget_line(512) in prompt(seed, chat_template_kwargs={"unrelated": [1, {"a": None}]})


def test_chat_completions_through_the_openai_sdk(seed: ServerProcess) -> None:
    client = openai.OpenAI(base_url=seed.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="x", messages=MSGS, max_tokens=2,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"thinking_budget": 128}, "verbose": True})
    rendered = out.model_extra["__verbose"]["prompt"]  # type: ignore[index]
    assert budget_line(128) in rendered and budget_line(512) not in rendered


@pytest.mark.parametrize(("kwargs", "says"), [
    ("yes", "`chat_template_kwargs` must be an object"),
    ([1], "`chat_template_kwargs` must be an object"),
    ({"enable_thinking": "no"}, "`chat_template_kwargs.enable_thinking` must be true or false"),
    ({"messages": []}, "cannot set messages: the server gives the template those itself"),
    ({"add_generation_prompt": False, "bos_token": "x"},
     "cannot set add_generation_prompt, bos_token"),
    ({"big": "x" * 70_000}, "characters of JSON; the limit is 65,536"),
    ({"deep": json.loads("[" * 70 + "]" * 70)}, "nests objects and arrays more than 64 deep"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/apply-template"])
def test_a_bad_object_is_a_400_that_says_why(seed: ServerProcess, route: str, kwargs: object,
                                             says: str) -> None:
    status, _, out = seed.request("POST", route, {"messages": MSGS, "max_tokens": 1,
                                                  "chat_template_kwargs": kwargs})
    assert status == 400, out
    if route == "/apply-template":             # llama-server's route, llama-server's shape
        assert out["error"]["type"] == "invalid_request_error", out
        message = out["error"]["message"]
    else:
        assert out["code"] == "invalid_request", out
        message = out["error"]
    assert says in message and "Traceback" not in message, out
    assert seed.info()["state"] == "ready"


def test_a_request_turns_thinking_back_on(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "2048",
                       "--chat-template-file", str(templates_dir() / "Qwen-Qwen3-0.6B.jinja"),
                       "--chat-template-kwargs", '{"enable_thinking": false}')
    try:
        empty_think = "<think>\n\n</think>"
        assert prompt(srv).rstrip().endswith(empty_think)
        assert empty_think not in prompt(srv, chat_template_kwargs={"enable_thinking": True})
        assert prompt(srv, chat_template_kwargs={"other": 1}).rstrip().endswith(empty_think)
    finally:
        srv.stop()
