"""The parts of llama-server's surface its own test suite reads, on a real bmoe-server.

Log-probabilities on chat (OpenAI's `logprobs` / `top_logprobs`, through the `openai` SDK
with its strict models, whole and streamed), `/completion`'s `n_probs` after the samplers
(`post_sampling_probs`), `logit_bias` keyed by text, and `--host` naming several
addresses. The expectations are llama-server's documented behaviour, and each is checked
against something the model's own numbers decide (a probability recomputed, a token kept
out), not against our output.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import urllib.request
from conftest import ServerProcess, start_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("surface"), "-m", str(tiny_moe), "-c",
                          "1024", "--temp", "0", "--metrics")
    try:
        assert server.info()["state"] == "ready", server.info()
        yield server
    finally:
        server.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


MESSAGES: list[Any] = [{"role": "system", "content": "Book"},
                       {"role": "user", "content": "What is the best book"}]


def test_chat_logprobs_whole(srv: ServerProcess) -> None:
    res = _client(srv).chat.completions.create(model="m", messages=MESSAGES, max_tokens=6,
                                               logprobs=True, top_logprobs=5)
    choice = res.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content, choice
    text = "".join(t.token for t in choice.logprobs.content)
    assert text == choice.message.content
    for t in choice.logprobs.content:
        assert t.logprob <= 0.0 and t.bytes == list(t.token.encode())
        assert 1 <= len(t.top_logprobs) <= 5
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-9
        assert t.top_logprobs[0].token == t.token        # greedy takes the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_chat_logprobs_streamed_match_the_text(srv: ServerProcess) -> None:
    stream = _client(srv).chat.completions.create(model="m", messages=MESSAGES, max_tokens=6,
                                                  logprobs=True, top_logprobs=3, stream=True)
    content, tokens = "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            assert choice.delta.content                  # they ride with the text they made
            tokens += "".join(t.token for t in choice.logprobs.content)
            assert all(len(t.top_logprobs) <= 3 for t in choice.logprobs.content)
    assert content and tokens == content


def test_chat_without_logprobs_says_none_and_top_needs_logprobs(srv: ServerProcess) -> None:
    res = _client(srv).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert res.choices[0].logprobs is None
    for extra, word in (({"top_logprobs": 3}, "logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                            "top_logprobs"),
                        ({"logprobs": "yes"}, "logprobs")):
        status, _, body = srv.request("POST", "/v1/chat/completions",
                                      {"messages": MESSAGES, "max_tokens": 2, **extra})
        assert status == 400 and body["code"] == "invalid_request", (extra, body)
        assert word in body["error"], (extra, body)


def _complete(srv: ServerProcess, **body: Any) -> dict[str, Any]:
    status, _, payload = srv.request("POST", "/completion", {"prompt": "Once upon a time",
                                                             "n_predict": 5, **body})
    assert status == 200, payload
    return payload


def test_post_sampling_probs_are_the_distribution_drawn_from(srv: ServerProcess) -> None:
    pre = _complete(srv, n_probs=10, temperature=0)["completion_probabilities"]
    # top-k 3 at temperature 1: the three most likely ids, renormalised among themselves
    post = _complete(srv, n_probs=10, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0,
                     seed=7, post_sampling_probs=True)["completion_probabilities"]
    assert len(post) == 5
    for tok in post:
        assert {"id", "token", "bytes", "prob", "top_probs"} <= set(tok), tok
        assert "logprob" not in tok and 0.0 < tok["prob"] <= 1.0
        assert len(tok["top_probs"]) == 3
        assert sum(p["prob"] for p in tok["top_probs"]) == pytest.approx(1.0)
        assert tok["id"] in [p["id"] for p in tok["top_probs"]]     # drawn from these
    # the first token's context is the same prompt: its three are the model's top three,
    # in proportion to their own probabilities
    first = pre[0]["top_logprobs"][:3]
    z = sum(math.exp(t["logprob"]) for t in first)
    want = {t["id"]: math.exp(t["logprob"]) / z for t in first}
    got = {p["id"]: p["prob"] for p in post[0]["top_probs"]}
    assert got.keys() == want.keys()
    for tok_id, p in want.items():
        assert got[tok_id] == pytest.approx(p, rel=1e-3)
    greedy = _complete(srv, n_probs=4, temperature=0, post_sampling_probs=True)
    assert all(t["prob"] == 1.0 and len(t["top_probs"]) == 1
               for t in greedy["completion_probabilities"])


def test_logit_bias_by_text_in_both_forms(srv: ServerProcess) -> None:
    text = _complete(srv, temperature=0, n_predict=8)["content"]
    ids = srv.request("POST", "/tokenize", {"content": text})[2]["tokens"]
    assert ids
    for bias in ([[text, -100]], {text: -100}, [[text, False]]):
        out = _complete(srv, temperature=0, n_predict=8, return_tokens=True, logit_bias=bias)
        assert not set(ids) & set(out["tokens"]), (bias, ids, out["tokens"])
    for bad in ([["x" * 300, 1]], {"": 1}, [["x", "y"]]):
        status, _, body = srv.request("POST", "/completion", {"prompt": "x", "logit_bias": bad})
        assert status == 400 and "logit_bias" in body["error"]["message"], (bad, body)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_host_lists_several_addresses_and_aliases_sort(tmp_path: Path, tiny_moe: Path) -> None:
    hosts = "127.0.0.1,::1" if _ipv6_loopback() else "127.0.0.1,localhost"
    server = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "256", "--host", hosts,
                          "--alias", "tinyllama-2,fim,code", "--tags", "chat,fim,small")
    try:
        # llama-server's sorted set of names: the first in that order is the id
        listed = server.request("GET", "/v1/models")[2]["data"]
        assert [m["id"] for m in listed] == ["code"], listed
        assert listed[0]["aliases"] == ["code", "fim", "tinyllama-2"]
        assert listed[0]["tags"] == ["chat", "fim", "small"]
        assert server.request("GET", "/props")[2]["model_alias"] == "code"
        assert server.request("GET", "/v1/models/fim")[0] == 200
        port = int(server.url.rsplit(":", 1)[1].rstrip("/"))
        assert server.url.startswith("http://127.0.0.1:"), server.url
        for host in (["127.0.0.1", "[::1]"] if "::1" in hosts else ["127.0.0.1"]):
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as r:
                assert r.status == 200, host
    finally:
        server.stop()


def test_context_exceeded_is_llama_servers_error_with_both_sizes(srv: ServerProcess) -> None:
    long = [{"role": "user", "content": "What is the best book " * 20},
            {"role": "assistant", "content": "Book"}] * 12 + [{"role": "user", "content": "x"}]
    for path, body in (("/chat/completions", {"messages": long}),
                       ("/chat/completions", {"messages": long, "stream": True}),
                       ("/completion", {"prompt": "book " * 1500}),
                       ("/completion", {"prompt": "book " * 1500, "stream": True})):
        status, _, payload = srv.request("POST", path, body)
        assert status == 400, (path, payload)             # before any stream starts
        err = payload["error"]
        assert err["type"] == "exceed_context_size_error", (path, payload)
        assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1024, (path, payload)
        assert "exceeds the available context size" in err["message"], err   # llama-server's
        assert str(err["n_prompt_tokens"]) in err["message"]


def _scrape(srv: ServerProcess) -> tuple[dict[str, str], dict[str, tuple[str, float]]]:
    """The samples by the name written, each with its # TYPE (as llama-server's suite
    reads them); Prometheus's own parser must read the text too."""
    from prometheus_client.parser import text_string_to_metric_families
    status, headers, text = srv.request("GET", "/metrics")
    assert status == 200
    text = text.decode() if isinstance(text, bytes) else str(text)
    assert list(text_string_to_metric_families(text))
    types: dict[str, str] = {}
    found: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            assert name in types and f"# HELP {name} " in text, name
            found[name] = (types[name], float(value))
    return headers, found


def test_metrics_count_as_llama_server_counts(srv: ServerProcess) -> None:
    headers, before = _scrape(srv)
    assert int(headers["Process-Start-Time-Unix"]) > 1_600_000_000
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                 "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
                 "n_tokens_max", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"):
        assert before[f"llamacpp:{name}"][0] == "counter", name
    for name in ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
                 "requests_deferred", "n_busy_slots_per_decode"):
        assert before[f"llamacpp:{name}"][0] == "gauge", name
    prompt = "the quick brown fox jumps over the lazy dog"
    timings = [_complete(srv, prompt=prompt, n_predict=n)["timings"] for n in (4, 1, 16)]
    assert timings[1]["cache_n"] > 0                     # the same prompt, from the KV
    _, after = _scrape(srv)

    def grew(name: str) -> float:
        return after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]
    assert grew("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert grew("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings)
    assert grew("tokens_predicted_total") == sum(t["predicted_n"] for t in timings)
    assert after["llamacpp:requests_processing"][1] == 0
    one, many = timings[1], timings[2]
    assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    assert many["predicted_n"] == 16                    # the rate is over 15 decode steps
    assert many["predicted_per_second"] == pytest.approx(15 / (many["predicted_ms"] / 1e3))


def _events(srv: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json
    import urllib.request as ur
    req = ur.Request(srv.url + path, data=json.dumps(body).encode(), method="POST",
                     headers={"Content-Type": "application/json"})
    out = []
    with ur.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _check_progress(progress: list[dict[str, Any]], cached: bool) -> None:
    assert len(progress) >= 2, progress               # before the first batch, then each
    first, last = progress[0], progress[-1]
    assert first["processed"] == first["cache"] and first["time_ms"] == 0.0
    assert (first["cache"] > 0) == cached, first
    for a, b in zip(progress, progress[1:], strict=False):
        assert b["total"] == a["total"] and b["cache"] == a["cache"]
        assert b["processed"] > a["processed"] and b["time_ms"] >= a["time_ms"]
    assert last["processed"] == last["total"] > 0


def test_return_progress_on_completion_and_chat(tmp_path: Path, tiny_moe: Path) -> None:
    """-b 16: a prompt of ~100 tokens prefills in several batches, each reported; the same
    prompt again starts from what the KV kept."""
    server = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "1024", "-b", "16",
                          "-ub", "16")
    try:
        prompt = "the quick brown fox jumps over the lazy dog " * 10
        for cached in (False, True):
            chunks = _events(server, "/completion", {"prompt": prompt, "n_predict": 3,
                                                     "stream": True, "return_progress": True,
                                                     "timings_per_token": True})
            progress = [c for c in chunks if "prompt_progress" in c]
            _check_progress([c["prompt_progress"] for c in progress], cached)
            first = progress[0]["timings"]
            assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0
            assert first["predicted_n"] == 0 and first["predicted_ms"] == 0.0
            ms = [c["timings"]["prompt_ms"] for c in progress]
            assert ms == sorted(ms) and ms[-1] > 0
            tokens = [c for c in chunks if c.get("content") and not c.get("stop")]
            assert all(c["timings"]["predicted_n"] == c["tokens_predicted"] for c in tokens)
            assert chunks[-1]["stop"] is True
            assert chunks[-1]["timings"]["prompt_n"] == progress[-1]["timings"]["prompt_n"]
        msgs = [{"role": "user", "content": prompt}]
        for cached in (False, True):
            chunks = _events(server, "/v1/chat/completions",
                             {"messages": msgs, "max_tokens": 3, "stream": True,
                              "return_progress": True, "timings_per_token": True,
                              "stream_options": {"include_usage": True}})
            progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
            _check_progress(progress, cached)
            assert all(not c["choices"] for c in chunks if "prompt_progress" in c)
            assert "timings" in chunks[-1] and chunks[-1]["usage"], chunks[-1]
            assert "timings" not in chunks[0]
        plain = _events(server, "/completion", {"prompt": prompt, "n_predict": 2,
                                                "stream": True})
        assert not any("prompt_progress" in c or ("timings" in c and not c["stop"])
                       for c in plain)
    finally:
        server.stop()


def test_verbose_answers_the_prompt_read(srv: ServerProcess) -> None:
    for verbose in (True, False):
        status, _, body = srv.request("POST", "/chat/completions",
                                      {"messages": MESSAGES, "max_tokens": 2,
                                       "verbose": verbose})
        assert status == 200, body
        if verbose:
            rendered = srv.request("POST", "/apply-template", {"messages": MESSAGES})[2]
            assert body["__verbose"]["prompt"] == rendered["prompt"]
            assert body["__verbose"]["content"] == body["choices"][0]["message"]["content"]
        else:
            assert "__verbose" not in body


def test_several_prompts_answer_as_a_list(srv: ServerProcess) -> None:
    text = "I believe the meaning of life is"
    ids = srv.request("POST", "/tokenize", {"content": text, "add_special": True})[2]["tokens"]
    for prompt in ([ids, ids], [ids, text], [ids, {"prompt_string": text}]):
        status, _, body = srv.request("POST", "/completion", {"prompt": prompt, "n_predict": 4,
                                                             "temperature": 0})
        assert status == 200 and isinstance(body, list) and len(body) == 2, body
        assert body[0]["content"] == body[1]["content"] and body[0]["content"], body
        assert [b["index"] for b in body] == [0, 1]
    status, _, body = srv.request("POST", "/completion", {"prompt": {"prompt_string": text},
                                                         "n_predict": 2})
    assert status == 200 and isinstance(body["content"], str), body
    for bad, word in (({"prompt_string": text, "multimodal_data": ["iVBORw0KGgo="]},
                       "multimodal_data"),
                      ([ids] * 17, "prompts"), ({"prompt_string": 3}, "prompt_string")):
        status, _, body = srv.request("POST", "/completion", {"prompt": bad, "n_predict": 2})
        assert status == 400 and word in body["error"]["message"], (bad, body)
    status, _, body = srv.request("POST", "/completion", {"prompt": [ids, ids], "stream": True})
    assert status == 400 and "stream" in body["error"]["message"], body


def test_response_fields_pick_paths(srv: ServerProcess) -> None:
    body = _complete(srv, n_predict=3, response_fields=["content", "generation_settings/n_predict",
                                                         "prompt", "no/such"])
    assert set(body) == {"content", "generation_settings/n_predict", "prompt"}, body
    assert body["generation_settings/n_predict"] == 3 and body["prompt"] == "Once upon a time"
    assert set(_complete(srv, n_predict=2, response_fields=[])) > {"content", "timings"}
    status, _, err = srv.request("POST", "/completion", {"prompt": "x", "response_fields": "a"})
    assert status == 400 and "response_fields" in err["error"]["message"], err


def test_generation_settings_show_the_biases_applied(srv: ServerProcess) -> None:
    eos = _complete(srv, n_predict=2, ignore_eos=True)["generation_settings"]["logit_bias"]
    assert eos and all(e["bias"] is None for e in eos)           # -inf: JSON's null
    assert _complete(srv, n_predict=2)["generation_settings"]["logit_bias"] == []
    text = _complete(srv, n_predict=2, logit_bias=[["hello", -5]])["generation_settings"]
    ids = srv.request("POST", "/tokenize", {"content": "hello"})[2]["tokens"]
    assert sorted(e["token"] for e in text["logit_bias"]) == sorted(set(ids))
    assert all(e["bias"] == -5 for e in text["logit_bias"])


def test_vertex_ai_predict_runs_each_instance_through_its_route(tmp_path: Path,
                                                                 tiny_moe: Path) -> None:
    from bmoe.server.gcp import alias
    assert alias("/v1/chat/completions") == "chatCompletions"
    assert alias("/apply-template") == "applyTemplate" and alias("/completion") == "completion"
    server = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "512",
                          env={"AIP_MODE": "PREDICTION", "AIP_HEALTH_ROUTE": "/isalive"})
    try:
        chat = {"@requestFormat": "chatCompletions", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Say hello"}]}
        status, _, body = server.request("POST", "/predict", {"instances": [
            chat, {"@requestFormat": "tokenize", "content": "hello"},
            {"@requestFormat": "nope"}, {**chat, "stream": True}, 3]})
        assert status == 200, body
        chat_answer, tokens, unknown, streamed, bad = body["predictions"]
        assert chat_answer["object"] == "chat.completion"
        assert chat_answer["choices"][0]["message"]["role"] == "assistant"
        assert tokens["tokens"] == server.request("POST", "/tokenize",
                                                  {"content": "hello"})[2]["tokens"]
        for failed in (unknown, streamed, bad):
            assert failed["error"]["code"] == 400, failed
        assert server.request("GET", "/isalive")[0] == 200
        for wrong in ({}, {"instances": 1}, {"instances": [{}] * 129}):
            status, _, err = server.request("POST", "/predict", wrong)
            assert status == 400 and "instances" in err["error"]["message"], err
    finally:
        server.stop()
    plain = start_server(tmp_path / "plain", "-m", str(tiny_moe), "-c", "256")
    try:
        assert plain.request("POST", "/predict", {"instances": []})[0] == 404
    finally:
        plain.stop()


def test_completion_streams_a_chunk_per_token(srv: ServerProcess) -> None:
    chunks = _events(srv, "/completion", {"prompt": "Once upon a time", "n_predict": 12,
                                          "n_probs": 3, "stream": True, "temperature": 0})
    tokens = [c for c in chunks if not c["stop"]]
    assert [c["tokens_predicted"] for c in tokens] == list(range(1, len(tokens) + 1))
    assert all(len(c["completion_probabilities"]) == 1 for c in tokens)
    whole = _complete(srv, prompt="Once upon a time", n_predict=12, temperature=0)
    assert "".join(c["content"] for c in chunks) == whole["content"]


def test_an_assistant_message_last_is_continued(srv: ServerProcess) -> None:
    """llama-server's prefill: the prompt is the history, its generation prompt and the
    begun answer's text; continue_final_message names it (with add_generation_prompt
    false); the refusals are llama-server's."""
    history = [{"role": "user", "content": "What is the best book"}]

    def prompt(body: dict[str, Any]) -> tuple[int, Any]:
        status, _, out = srv.request("POST", "/apply-template", body)
        return status, out

    base = prompt({"messages": history})[1]["prompt"]
    assert prompt({"messages": [*history, {"role": "assistant", "content": "Whill"}]}) == \
        (200, {"prompt": base + "Whill"})
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    assert prompt({"messages": [*history, {"role": "assistant", "content": parts}]})[1] == \
        {"prompt": base + "Wh\n\nill"}
    named = {"messages": [*history, {"role": "assistant", "content": "Whill"}],
             "continue_final_message": True, "add_generation_prompt": False}
    assert prompt(named)[1] == {"prompt": base + "Whill"}
    for bad, why in (({**named, "add_generation_prompt": True}, "Cannot set both"),
                     ({"messages": [*history, {"role": "assistant", "content": "a"},
                                    {"role": "assistant", "content": "b"}]}, "2 or more"),
                     ({"messages": [*history, {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "f", "arguments": "{}"}}]}]}, "tool calls")):
        status, out = prompt(bad)
        assert status == 400 and why in out["error"]["message"], out
    status, _, body = srv.request("POST", "/v1/chat/completions", {
        "messages": [*history, {"role": "assistant", "content": "Whill"}], "max_tokens": 3})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(srv.request(
        "POST", "/tokenize", {"content": base + "Whill", "add_special": True})[2]["tokens"])


def test_a_verbose_server_answers_the_prompt_read_unasked(tmp_path: Path, tiny_moe: Path) -> None:
    """llama-server's --verbose puts __verbose in every chat answer (its suite's debug
    runs read the prompt from there)."""
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "512", "--verbose")
    try:
        status, _, body = srv.request("POST", "/chat/completions",
                                      {"messages": MESSAGES, "max_tokens": 2})
        assert status == 200 and "__verbose" in body, body
        rendered = srv.request("POST", "/apply-template", {"messages": MESSAGES})[2]
        assert body["__verbose"]["prompt"] == rendered["prompt"]
    finally:
        srv.stop()
