"""``--sleep-idle-seconds``: the idle model is unloaded and the next request loads it again.

Real engine, real server: after a second with nothing using it the model is unloaded
(`/api/info` says so and holds no model), the read-only routes answer as they did without
waking it, and a chat wakes it and is answered. An unload on purpose is not woken.
Also the metrics' throughput window (llama-server's buckets), which a sleeping server's
scrapes rely on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ServerProcess, start_server

from bmoe.runtime.metrics import Metrics

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _wait_sleeping(srv: ServerProcess, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = srv.info()
        if info.get("sleeping"):
            return info
        time.sleep(0.1)
    raise AssertionError(f"the model did not sleep: {srv.info()}")


def _metrics(srv: ServerProcess) -> str:
    status, _, body = srv.request("GET", "/metrics")
    assert status == 200
    return body if isinstance(body, str) else body.decode()


@pytest.fixture
def sleepy(tmp_path: Path, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path, "--model", str(tiny_moe), "-c", "256", "--metrics",
                       "--sleep-idle-seconds", "1")
    try:
        yield srv
    finally:
        srv.stop()


def test_the_idle_model_sleeps_and_a_chat_wakes_it(sleepy: ServerProcess) -> None:
    status, _, chat = sleepy.request("POST", "/v1/chat/completions", CHAT)
    assert status == 200, chat
    awake_props = sleepy.request("GET", "/props")[2]
    assert awake_props["is_sleeping"] is False
    _metrics(sleepy)                           # the first scrape reads the window
    awake_metrics = _metrics(sleepy)
    assert "llamacpp:tokens_predicted_total 4.0" in awake_metrics
    info = _wait_sleeping(sleepy)
    assert info["state"] == "empty" and info["model"] is None
    # the read-only routes answer as before and wake nothing
    assert sleepy.request("GET", "/health")[:1] == (200,)
    props = sleepy.request("GET", "/props")[2]
    assert props == {**awake_props, "is_sleeping": True}
    assert _metrics(sleepy) == awake_metrics
    models = sleepy.request("GET", "/v1/models")[2]
    assert [m["id"] for m in models["data"]] == ["tiny-moe.gguf"]
    assert sleepy.info()["sleeping"] is True
    # a request that runs the model waits for it to load again
    status, _, chat = sleepy.request("POST", "/v1/chat/completions", CHAT)
    assert status == 200, chat
    assert chat["usage"]["completion_tokens"] >= 1
    info = sleepy.info()
    assert info["sleeping"] is False and info["state"] == "ready"
    assert sleepy.request("GET", "/props")[2]["is_sleeping"] is False
    assert "llamacpp:tokens_predicted_total" in _metrics(sleepy)


def test_token_counts_wake_it_too(sleepy: ServerProcess) -> None:
    _wait_sleeping(sleepy)
    status, _, body = sleepy.request("POST", "/v1/responses/input_tokens",
                                     {"input": "Hello world"})
    assert status == 200, body
    assert body["object"] == "response.input_tokens" and body["input_tokens"] > 2
    assert sleepy.info()["sleeping"] is False


def test_an_unload_on_purpose_is_not_woken(sleepy: ServerProcess) -> None:
    _wait_sleeping(sleepy)
    assert sleepy.request("POST", "/api/session/unload", {})[0] == 200
    info = sleepy.info()
    assert info["sleeping"] is False and info["state"] == "empty"
    status, _, body = sleepy.request("POST", "/v1/chat/completions", CHAT)
    assert status == 503 and body["code"] == "no_model", body


def test_the_throughput_window_is_the_time_since_the_last_scrape() -> None:
    m = Metrics()
    gen = SimpleNamespace(tokens=[1] * 5, n_prefilled=10, n_cached=0, prefill_s=0.5,
                          decode_s=2.0, n_prompt=10)
    m.book(gen)
    m.book(gen)
    assert m.prompt_rate() == pytest.approx(20 / 1.0)
    assert m.predicted_rate() == pytest.approx(8 / 4.0)     # the first token is the prompt's
    m.reset_bucket()
    assert m.prompt_rate() == 0.0 and m.predicted_rate() == 0.0
    assert m.tokens_predicted == 10                           # the counters go on
