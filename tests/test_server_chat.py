"""The walking skeleton end to end: a real bmoe-server, the real engine, the openai SDK."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from bmoe.engine.templating import ChatTemplate

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key or "none",
                         _strict_response_validation=True, max_retries=0, timeout=120)


def test_models_lists_the_loaded_model(server: Any, tiny_moe: Path) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [tiny_moe.name]


def test_stream_and_non_stream_agree_at_temp_zero(server: Any) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Write three words about the sea."}]
    full = c.chat.completions.create(model="x", messages=messages, max_tokens=40,
                                     extra_body=NO_THINK)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens > 0
    text = (choice.message.content or "")

    pieces: list[str] = []
    finish = None
    usage = None
    stream = c.chat.completions.create(model="x", messages=messages, max_tokens=40, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body=NO_THINK)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert "".join(pieces) == text
    assert finish == choice.finish_reason
    assert usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_usage_matches_tokenization(server: Any, tiny_moe: Path) -> None:
    import llama_cpp
    messages = [{"role": "user", "content": "Count the tokens of this prompt, please."}]
    resp = client(server).chat.completions.create(model="x", messages=messages, max_tokens=5,
                                                  extra_body=NO_THINK)
    vocab_model = llama_cpp.Llama(str(tiny_moe), vocab_only=True, verbose=False)
    template = ChatTemplate(vocab_model.metadata["tokenizer.chat_template"])
    prompt = template.render(messages, enable_thinking=False)
    n = len(vocab_model.tokenize(prompt.encode(), add_bos=False, special=True))
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == n
    assert resp.usage.total_tokens == n + resp.usage.completion_tokens
    assert 0 < resp.usage.completion_tokens <= 5


def test_resent_conversation_reuses_the_kv_prefix(server: Any) -> None:
    c = client(server)
    first = [{"role": "user", "content": "Tell me about the mountains in spring."}]
    a = c.chat.completions.create(model="x", messages=first, max_tokens=12)
    assert a.usage is not None
    msg = a.choices[0].message
    second = first + [{"role": "assistant", "content": msg.content or ""},
                      {"role": "user", "content": "And in winter?"}]
    b = c.chat.completions.create(model="x", messages=second, max_tokens=4)
    assert b.usage is not None and b.usage.prompt_tokens_details is not None
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens
    assert b.usage.prompt_tokens > a.usage.prompt_tokens


def _post_raw(server: Any, path: str, body: Any, content_type: str = "application/json"
              ) -> tuple[int, Any]:
    return server.request("POST", path, raw=body if isinstance(body, bytes) else
                          json.dumps(body).encode(), headers={"Content-Type": content_type})[::2]


def test_cancel_ends_a_long_generation(server: Any) -> None:
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["resp"] = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Go on forever."}],
            "max_tokens": 3500, **NO_THINK})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while not server.info()["generating"]:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)
    status, _, body = server.request("POST", "/api/cancel")
    assert status == 200
    t.join(30)
    status, _, body = result["resp"]
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "cancelled"
    assert body["usage"]["completion_tokens"] < 3500
    assert body["bmoe"]["summary"]["cancelled"] is True


def test_stream_disconnect_stops_its_generation(server: Any) -> None:
    host, port = server.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"messages": [{"role": "user", "content": "Talk for a long time."}],
                       "max_tokens": 3500, "stream": True, **NO_THINK})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    assert server.info()["generating"]
    conn.sock.close()  # the client goes away mid-answer
    conn.close()
    deadline = time.monotonic() + 1.5
    while server.info()["generating"]:
        assert time.monotonic() < deadline, "the generation outlived its client"
        time.sleep(0.02)


@pytest.mark.parametrize("raw,why", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "an array"),
    (b"\xff\xfe", "not UTF-8"),
    (json.dumps({"messages": "hi"}).encode(), "messages not an array"),
    (json.dumps({"messages": [{"role": 3, "content": "x"}]}).encode(), "role a number"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content a number"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
     "negative budget"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(),
     "string budget"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": {}}).encode(),
     "tools an object"),
    (json.dumps({"messages": [{"role": "user", "content": "x"},
                              {"role": "assistant", "content": "x"},
                              {"role": "assistant", "content": "y"}]}).encode(),
     "ends with two assistant messages (one is a prefill, two are ambiguous)"),
])
def test_bad_bodies_are_400_invalid_request(server: Any, raw: bytes, why: str) -> None:
    status, body = _post_raw(server, "/v1/chat/completions", raw)
    assert status == 400, why
    assert body["code"] == "invalid_request", why
    assert body["error"]


def test_text_plain_post_is_415(server: Any) -> None:
    status, body = _post_raw(server, "/v1/chat/completions", b"{}", "text/plain")
    assert status == 415
    assert body["code"]


def test_unknown_route_is_json_404(server: Any) -> None:
    status, _, body = server.request("GET", "/api/no-such-thing")
    assert status == 404
    assert body["code"] == "not_found"


def test_info_describes_the_session(server: Any, tiny_moe: Path) -> None:
    info = server.info()
    assert info["state"] == "ready"
    model = info["model"]
    assert model["name"] == tiny_moe.name and model["arch"] == "qwen3moe"
    assert model["n_ctx"] == 4096
    assert model["ctx_advice"]["short"] is True and model["ctx_advice"]["recommended"] == 16384
    assert info["host"]["cpu_threads"] >= 1
