"""llama-server's routes against a real bmoe-server with the tiny MoE loaded.

The expected shapes are written from llama-server's documentation
(tools/server/README.md: /completion, /tokenize, /detokenize, /props, /slots,
/metrics, /health; OpenAI's text completion for /v1/completions), not from our output.
Clients: raw HTTP, curl, the official `openai` SDK with strict response validation,
and `prometheus_client`'s own parser for /metrics.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _e2e_support import call, port_of
from conftest import ServerProcess, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from bmoe.server import llama_flags
from bmoe.server.main import build_parser

KEY = "llama-compat-test-key"
N_VOCAB = 576          # the tiny MoE's vocabulary (bmoe.modelmaker)

POST_ROUTES = ["/completion", "/completions", "/v1/completions", "/tokenize", "/detokenize",
               "/apply-template", "/v1/chat/completions/input_tokens", "/chat/completions",
               "/api/show", "/slots/0"]
GET_ROUTES = ["/props", "/slots", "/metrics", "/models", "/models/tiny-moe.gguf",
              "/v1/models/tiny-moe.gguf", "/api/tags"]

SETTINGS_FIELDS = {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                   "seed", "ignore_eos", "n_probs", "n_predict", "stream", "logit_bias", "stop"}
TIMINGS_FIELDS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                  "predicted_n", "predicted_ms", "predicted_per_token_ms",
                  "predicted_per_second", "cache_n"}


def env_argv(argv: list[str], environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """llama-server's variables read in with bmoe-server's own parser, as a start reads them."""
    return llama_flags.env_argv(argv, environ, build_parser())


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("llama"), "-m", str(tiny_moe), "-c", "1024",
                          "--metrics")
    try:
        assert server.info()["state"] == "ready", server.info()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("llama-key"), "-m", str(tiny_moe), "-c",
                          "512", "--metrics", "--api-key", KEY, wait_ready=False)
    server.key = KEY
    try:
        server.wait_state("ready")
        yield server
    finally:
        server.stop()


def post(srv: ServerProcess, path: str, body: Any) -> tuple[int, Any]:
    status, _, payload = srv.request("POST", path, body)
    return status, payload


def complete(srv: ServerProcess, **body: Any) -> dict[str, Any]:
    status, payload = post(srv, "/completion", {"prompt": "Hello", "n_predict": 6, **body})
    assert status == 200, payload
    return payload


def stream_chunks(srv: ServerProcess, path: str, body: dict[str, Any]) -> list[Any]:
    status, headers, payload = srv.request("POST", path, {**body, "stream": True})
    assert status == 200, payload
    assert headers["Content-Type"].startswith("text/event-stream")
    text = payload.decode() if isinstance(payload, bytes) else json.dumps(payload)
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def is_llama_error(payload: Any, status: int) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return (isinstance(err, dict) and err.get("code") == status
            and isinstance(err.get("message"), str) and isinstance(err.get("type"), str))


# -- /completion -------------------------------------------------------------------

def test_completion_shape(srv: ServerProcess) -> None:
    body = complete(srv, temperature=0, return_tokens=True)
    for key in ("content", "tokens", "stop", "model", "tokens_predicted", "tokens_evaluated",
                "generation_settings", "prompt", "stop_type", "stopping_word", "tokens_cached",
                "timings", "truncated", "id_slot", "index", "has_new_line"):
        assert key in body, key
    assert body["stop"] is True and body["stop_type"] in ("eos", "limit")
    assert isinstance(body["content"], str)
    assert 1 <= body["tokens_predicted"] == len(body["tokens"]) <= 6
    assert body["tokens_evaluated"] >= 1
    assert all(0 <= t < N_VOCAB for t in body["tokens"])
    assert SETTINGS_FIELDS <= set(body["generation_settings"])
    assert body["generation_settings"]["n_predict"] == 6
    assert TIMINGS_FIELDS <= set(body["timings"])
    assert body["timings"]["predicted_n"] == body["tokens_predicted"]
    assert body["tokens_cached"] >= body["tokens_evaluated"]


def test_defaults_are_llama_servers(srv: ServerProcess) -> None:
    settings_ = complete(srv)["generation_settings"]
    assert settings_["temperature"] == 0.8 and settings_["top_k"] == 40
    assert settings_["top_p"] == 0.95 and settings_["min_p"] == 0.05
    assert settings_["repeat_penalty"] == 1.0 and settings_["repeat_last_n"] == 64


def test_streamed_equals_whole_at_temperature_zero(srv: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0}
    whole = complete(srv, **body)
    chunks = stream_chunks(srv, "/completion", body)
    assert "[DONE]" not in chunks                     # llama-server's /completion sends none
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]
    assert chunks[-1]["stop_type"] == whole["stop_type"]
    assert TIMINGS_FIELDS <= set(chunks[-1]["timings"])


def test_prompt_as_token_ids_and_mixed(srv: ServerProcess) -> None:
    status, toks = post(srv, "/tokenize", {"content": "Once upon a time"})
    ids = toks["tokens"]
    by_text = complete(srv, prompt="Once upon a time", temperature=0)
    by_ids = complete(srv, prompt=ids, temperature=0)
    mixed = complete(srv, prompt=["Once upon", *ids[-2:]], temperature=0)
    assert by_ids["content"] == by_text["content"]
    assert by_ids["tokens_evaluated"] == len(ids)
    assert mixed["tokens_evaluated"] >= 3


def test_stop_string_is_cut_and_named(srv: ServerProcess) -> None:
    free = complete(srv, temperature=0, n_predict=16)["content"]
    word = free[len(free) // 2:len(free) // 2 + 2]
    assert word.strip(), free
    body = complete(srv, temperature=0, n_predict=16, stop=[word])
    assert body["stop_type"] == "word" and body["stopping_word"] == word
    assert body["content"] == free[:free.index(word)]
    chunks = stream_chunks(srv, "/completion", {"prompt": "Hello", "n_predict": 16,
                                                 "temperature": 0, "stop": [word]})
    assert "".join(c["content"] for c in chunks) == body["content"]


def test_seeded_sampling_repeats(srv: ServerProcess) -> None:
    a = complete(srv, seed=1234, temperature=1.5, n_predict=10, top_k=0, top_p=1.0, min_p=0)
    b = complete(srv, seed=1234, temperature=1.5, n_predict=10, top_k=0, top_p=1.0, min_p=0)
    assert a["content"] == b["content"]
    assert a["generation_settings"]["seed"] == 1234


def test_n_probs_sorted_and_summing_at_most_one(srv: ServerProcess) -> None:
    body = complete(srv, temperature=0, n_probs=5, n_predict=4)
    probs = body["completion_probabilities"]
    assert len(probs) == body["tokens_predicted"]
    for entry in probs:
        top = entry["top_logprobs"]
        assert len(top) == 5
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-9
        assert top[0]["id"] == entry["id"]            # greedy picks the most likely
        assert all({"id", "token", "bytes", "logprob"} <= set(t) for t in top)


def test_logit_bias_keeps_out_and_forces(srv: ServerProcess) -> None:
    first = complete(srv, temperature=0, n_predict=1, return_tokens=True)["tokens"][0]
    kept_out = complete(srv, temperature=0, n_predict=6, return_tokens=True,
                        logit_bias={str(first): -100})
    assert first not in kept_out["tokens"]
    forced = complete(srv, temperature=0.9, seed=3, n_predict=6, return_tokens=True,
                      logit_bias=[[77, 100]])
    assert forced["tokens"] == [77] * 6
    never = complete(srv, temperature=0, n_predict=6, return_tokens=True,
                     logit_bias=[[first, False]])
    assert first not in never["tokens"]
    # a text names each of its tokens (llama-server's reading), in both forms
    text = complete(srv, temperature=0, n_predict=6)["content"]
    ids = post(srv, "/tokenize", {"content": text})[1]["tokens"]
    for bias in ([[text, -100]], {text: -100}):
        out = complete(srv, temperature=0, n_predict=6, return_tokens=True, logit_bias=bias)
        assert not set(ids) & set(out["tokens"]), (bias, ids, out["tokens"])


def test_ignore_eos_runs_to_the_limit(srv: ServerProcess) -> None:
    body = complete(srv, ignore_eos=True, n_predict=24, temperature=0)
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 24


def test_grammar_and_json_schema(srv: ServerProcess) -> None:
    yes_no = complete(srv, grammar='root ::= "yes" | "no"', n_predict=8)
    assert yes_no["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = complete(srv, json_schema=schema, n_predict=64, temperature=0)
    if body["stop_type"] == "eos":
        assert isinstance(json.loads(body["content"])["a"], int)


def test_unsupported_fields_are_refused_by_name(srv: ServerProcess) -> None:
    for field, value in (("mirostat", 2), ("typical_p", 0.5), ("dry_multiplier", 0.8),
                         ("xtc_probability", 0.5), ("post_sampling_probs", "yes"),
                         ("samplers", ["top_k"]), ("n_predict", -2), ("n_probs", 1000),
                         ("top_p", 2), ("temperature", "hot"), ("id_slot", 3),
                         ("id_slot", "x"), ("id_slot", -2)):
        status, payload = post(srv, "/completion", {"prompt": "x", field: value})
        assert status == 400 and is_llama_error(payload, 400), (field, payload)
        assert field in payload["error"]["message"], (field, payload)
    status, payload = post(srv, "/completion", {"prompt": "x", "mirostat": 0, "n_predict": 1})
    assert status == 200                                  # turned off: nothing to refuse


def test_bad_token_ids_are_400_naming_the_field(srv: ServerProcess) -> None:
    for path, body, field in (("/completion", {"prompt": [1, N_VOCAB]}, "prompt"),
                              ("/completion", {"prompt": [-1]}, "prompt"),
                              ("/completion", {"prompt": "x", "logit_bias": {"99999": 1}},
                               "logit_bias"),
                              ("/completion", {"prompt": "x", "logit_bias": {"": 1}},
                               "logit_bias"),
                              ("/detokenize", {"tokens": [N_VOCAB]}, "tokens"),
                              ("/detokenize", {"tokens": [2**40]}, "tokens")):
        status, payload = post(srv, path, body)
        assert status == 400 and is_llama_error(payload, 400), (body, payload)
        assert field in payload["error"]["message"]


# -- /v1/completions ---------------------------------------------------------------

def sdk(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.key or "none",
                         _strict_response_validation=True, max_retries=0)


def test_openai_sdk_completions_strict(srv: ServerProcess) -> None:
    client = sdk(srv)
    got = client.completions.create(model="tiny-moe.gguf", prompt="Hello", max_tokens=5,
                                    temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].finish_reason in ("stop", "length")
    assert got.usage is not None and 1 <= got.usage.completion_tokens <= 5
    # A stream's chunks carry "finish_reason": null until the last (as OpenAI's and
    # llama-server's do), which the SDK's generated type does not admit under strict
    # validation, so the stream is read by a default client and checked here.
    loose = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    pieces, finish = [], None
    for chunk in loose.completions.create(model="tiny-moe.gguf", prompt="Hello",
                                          max_tokens=5, temperature=0, stream=True,
                                          stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage is not None and chunk.usage.completion_tokens <= 5
            continue
        assert chunk.object == "text_completion"
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == got.choices[0].text and finish == got.choices[0].finish_reason


def test_openai_completions_refusals(srv: ServerProcess) -> None:
    for extra in ({"echo": True}, {"suffix": "x"}, {"best_of": 2}, {"n": 17}, {"n": 0},
                  {"logprobs": 2}, {"prompt": ["a", "b"]}):
        status, payload = post(srv, "/v1/completions", {"prompt": "Hello", **extra})
        assert status == 400 and is_llama_error(payload, 400), (extra, payload)
        assert next(iter(extra)) in payload["error"]["message"]


def test_n_choices_seeded_one_after_another(srv: ServerProcess) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 1.5, "top_k": 0, "seed": 11}
    status, one = post(srv, "/v1/completions", body)
    status, three = post(srv, "/v1/completions", {**body, "n": 3})
    assert status == 200, three
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["choices"][0]["text"] == one["choices"][0]["text"]
    status, seed12 = post(srv, "/v1/completions", {**body, "seed": 12})
    assert three["choices"][1]["text"] == seed12["choices"][0]["text"]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert 3 <= three["usage"]["completion_tokens"] <= 18
    chunks = stream_chunks(srv, "/v1/completions", {**body, "n": 2,
                                                     "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    texts = ["", ""]
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts[0] == one["choices"][0]["text"] and texts[1] == three["choices"][1]["text"]
    assert chunks[-2]["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]


# -- tokenizer, template, props, slots, lookups --------------------------------------------

def test_tokenize_detokenize_round_trip(srv: ServerProcess) -> None:
    text = "Hello world, this is bmoe: 42 tokens?"
    status, toks = post(srv, "/tokenize", {"content": text})
    assert status == 200 and all(isinstance(t, int) for t in toks["tokens"])
    status, back = post(srv, "/detokenize", {"tokens": toks["tokens"]})
    assert status == 200 and back == {"content": text}
    status, pieces = post(srv, "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == toks["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == text
    status, missing = post(srv, "/tokenize", {})
    assert status == 400 and "content" in missing["error"]["message"]


def test_apply_template_and_input_tokens(srv: ServerProcess) -> None:
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    status, out = post(srv, "/apply-template", msgs)
    assert status == 200 and set(out) == {"prompt"} and "hi" in out["prompt"]
    status, out = post(srv, "/apply-template", {**msgs, "return_prompt_ids": True})
    assert isinstance(out["prompt_ids"], list)
    status, n = post(srv, "/v1/chat/completions/input_tokens", msgs)
    assert n == {"input_tokens": len(out["prompt_ids"])}


def test_props_and_slots(srv: ServerProcess, tiny_moe: Path) -> None:
    status, _, props = srv.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 1
    assert props["model_path"] == str(tiny_moe) and props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    assert "build_info" in props and SETTINGS_FIELDS - {"stream", "n_predict"} <= \
        set(props["default_generation_settings"]["params"])
    status, payload = post(srv, "/props", {"n_ctx": 1})
    assert status == 501 and is_llama_error(payload, 501)
    status, _, slots = srv.request("GET", "/slots")
    assert status == 200 and len(slots) == 1
    assert {"id", "n_ctx", "is_processing", "next_token"} <= set(slots[0]) and "params" not in slots[0]
    status, payload = post(srv, "/slots/0?action=save", {"filename": "x.bin"})
    assert status == 501 and is_llama_error(payload, 501)


def test_model_lookups_and_ollama(srv: ServerProcess) -> None:
    for path in ("/v1/models/tiny-moe.gguf", "/models/tiny-moe.gguf"):
        status, _, entry = srv.request("GET", path)
        assert status == 200 and entry["id"] == "tiny-moe.gguf" and entry["object"] == "model"
    status, _, missing = srv.request("GET", "/v1/models/other")
    assert status == 404 and is_llama_error(missing, 404)
    assert "tiny-moe.gguf" in missing["error"]["message"]
    status, _, tags = srv.request("GET", "/api/tags")
    assert status == 200 and tags["models"][0]["name"] == "tiny-moe.gguf"
    assert tags["models"][0]["details"]["format"] == "gguf"
    status, show = post(srv, "/api/show", {"model": "tiny-moe.gguf"})
    assert status == 200 and "completion" in show["capabilities"] and show["template"]
    assert any(k.endswith(".context_length") for k in show["model_info"])
    status, chat = post(srv, "/chat/completions", {"messages": [{"role": "user",
                                                                 "content": "hi"}],
                                                   "max_tokens": 2})
    assert status == 200 and chat["object"] == "chat.completion"


# -- /metrics ----------------------------------------------------------------------

def scrape(srv: ServerProcess) -> dict[str, float]:
    status, headers, payload = srv.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = payload.decode() if isinstance(payload, bytes) else str(payload)
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_metrics_parse_and_move_by_one_request(srv: ServerProcess) -> None:
    before = scrape(srv)
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                 "llamacpp:prompt_seconds_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:kv_cache_tokens",
                 "bmoe:expert_cache_hits_total", "bmoe:expert_cache_misses_total",
                 "bmoe:expert_read_bytes_total", "bmoe:expert_cache_resident_bytes",
                 "bmoe:expert_cache_budget_bytes", "bmoe:expert_read_wait_seconds_total",
                 "bmoe:expert_read_ahead_bytes_total", "bmoe:expert_pages_moved_bytes_total"):
        assert name in before, name
    # the bytes the cache handed on from its victims are part of what it read
    assert 0 <= before["bmoe:expert_pages_moved_bytes_total"] <= \
        before["bmoe:expert_read_bytes_total"]
    body = complete(srv, prompt="A fresh prompt for the metrics test", n_predict=7,
                    cache_prompt=False, temperature=0)
    after = scrape(srv)
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == \
        body["timings"]["prompt_n"] == body["tokens_evaluated"]
    assert after["llamacpp:tokens_predicted_total"] - \
        before["llamacpp:tokens_predicted_total"] == body["tokens_predicted"]
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    assert after["bmoe:expert_cache_hits_total"] + after["bmoe:expert_cache_misses_total"] > \
        before["bmoe:expert_cache_hits_total"] + before["bmoe:expert_cache_misses_total"]


def test_process_metrics_only_when_asked_for(srv: ServerProcess) -> None:
    plain = scrape(srv)
    status, _, payload = srv.request("GET", "/metrics?process=1")
    assert status == 200
    text = payload.decode() if isinstance(payload, bytes) else str(payload)
    process = {s.name: s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
    names = ("bmoe:process_trio_tasks", "bmoe:process_event_subscribers",
             "bmoe:process_threads", "bmoe:process_open_fds", "bmoe:process_resident_bytes",
             "bmoe:process_heap_trims_total")
    assert not any(n in plain for n in names)
    assert all(n in process for n in names), sorted(process)
    assert process["bmoe:process_resident_bytes"] > 1 << 20
    assert process["bmoe:process_heap_trims_total"] >= 0


def test_metrics_off_without_the_flag(server: ServerProcess) -> None:
    status, _, payload = server.request("GET", "/metrics")
    assert status == 501 and is_llama_error(payload, 501)
    assert "--metrics" in payload["error"]["message"]


# -- /health -----------------------------------------------------------------------

def test_health_503_without_a_model_and_while_loading(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, wait_ready=False)
    try:
        srv.wait_state("empty")
        status, _, payload = srv.request("GET", "/health")
        assert status == 503 and is_llama_error(payload, 503)
        seen = set()
        for _ in range(5):                    # the tiny model loads in well under a second
            status, _, _ = srv.request("POST", "/api/session/load", {"model": str(tiny_moe)})
            assert status == 202
            status, _, payload = srv.request("GET", "/health")
            seen.add(status)
            if status == 503:
                assert payload["error"]["message"] == "Loading model"
                break
            srv.request("POST", "/api/session/unload", {})
        assert 503 in seen, seen
        srv.wait_state("ready")
        assert srv.request("GET", "/health")[2] == {"status": "ok"}
    finally:
        srv.stop()


# -- security ----------------------------------------------------------------------

def test_health_is_public_and_everything_else_needs_the_key(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    for path in ("/health", "/v1/health"):
        reply = call(port, "GET", path)
        assert reply.status == 200 and reply.json() == {"status": "ok"}
    for path in GET_ROUTES:
        reply = call(port, "GET", path)
        assert reply.status == 401, (path, reply.status)
        assert reply.header("www-authenticate") == "Bearer"
        assert call(port, "GET", path, key=KEY).status == 200, path
    for path in POST_ROUTES:
        reply = call(port, "POST", path, body={"prompt": "x", "n_predict": 1})
        assert reply.status == 401, (path, reply.status)


def test_foreign_origin_and_text_plain_are_refused(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    evil = [("Origin", "http://evil.example")]
    site = [("Sec-Fetch-Site", "cross-site")]
    for path in [*GET_ROUTES, "/health"]:
        for headers in (evil, site):
            reply = call(port, "GET", path, key=KEY, headers=headers)
            assert reply.status == 403, (path, headers, reply.status)
            assert reply.header("access-control-allow-origin") is None
    for path in POST_ROUTES:
        body = {"prompt": "x", "n_predict": 1}
        assert call(port, "POST", path, key=KEY, body=body, headers=evil).status == 403, path
        plain = call(port, "POST", path, key=KEY, body=body, json_type=False,
                     headers=[("Content-Type", "text/plain")])
        assert plain.status == 415, (path, plain.status)


def test_wrong_host_is_refused(keyed: ServerProcess) -> None:
    port = port_of(keyed)
    for path in ("/health", "/completion", "/metrics"):
        assert call(port, "GET", path, host="evil.example").status == 421


# -- curl --------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_completion_and_metrics(srv: ServerProcess) -> None:
    out = subprocess.run(["curl", "-sS", "--fail-with-body", srv.url + "/completion", "-H",
                          "Content-Type: application/json", "-d",
                          '{"prompt": "Building a website can be done in 10 simple steps:",'
                          ' "n_predict": 8}'], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["stop"] is True and body["tokens_predicted"] <= 8
    out = subprocess.run(["curl", "-sS", "-N", srv.url + "/completion", "-H",
                          "Content-Type: application/json", "-d",
                          '{"prompt": "Hi", "n_predict": 3, "stream": true}'],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("data: {") and '"stop":true' in out.stdout
    out = subprocess.run(["curl", "-sS", "--fail-with-body", srv.url + "/metrics"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "llamacpp:tokens_predicted_total" in out.stdout


# -- property tests: every id a client sends is checked before llama.cpp sees it ------

def alive(srv: ServerProcess) -> bool:
    return srv.proc.poll() is None and srv.request("GET", "/health")[0] == 200


ids = st.integers(min_value=-(2**63), max_value=2**63)
near = st.integers(min_value=-3, max_value=N_VOCAB + 3)
PROP = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@PROP
@given(st.lists(st.one_of(ids, near), min_size=1, max_size=8))
def test_prompt_ids_property(srv: ServerProcess, prompt: list[int]) -> None:
    status, payload = post(srv, "/completion", {"prompt": prompt, "n_predict": 1})
    valid = all(0 <= t < N_VOCAB for t in prompt)
    assert status == (200 if valid else 400), (prompt, payload)
    assert alive(srv)


@PROP
@given(st.lists(st.one_of(ids, near), max_size=8))
def test_detokenize_ids_property(srv: ServerProcess, tokens: list[int]) -> None:
    status, payload = post(srv, "/detokenize", {"tokens": tokens})
    valid = all(0 <= t < N_VOCAB for t in tokens)
    assert status == (200 if valid else 400), (tokens, payload)
    assert alive(srv)


bias_keys = st.one_of(near.map(str), ids.map(str), st.text(max_size=6))
bias_values = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32),
                        st.integers(-200, 200), st.just(False))


@PROP
@given(st.dictionaries(bias_keys, bias_values, max_size=6))
def test_logit_bias_property(srv: ServerProcess, bias: dict[str, Any]) -> None:
    status, payload = post(srv, "/completion", {"prompt": "x", "n_predict": 1,
                                                "logit_bias": bias})
    def is_id(k: str) -> bool:              # a key that reads as a number names an id
        return re.fullmatch(r"[+-]?[0-9]+", k.strip()) is not None

    def id_of(k: str) -> int | None:
        m = re.fullmatch(r"\s*\+?([0-9]{1,10})\s*", k)
        return int(m.group(1)) if m else None

    def ok(k: str, v: Any) -> bool:         # an id of the vocabulary, or a text (its tokens)
        tok = id_of(k)
        key_ok = (tok is not None and tok < N_VOCAB) if is_id(k) else 1 <= len(k) <= 256
        return key_ok and (v is False or abs(v) <= 100)
    valid = all(ok(k, v) for k, v in bias.items())     # an id named twice: the last holds
    assert status == (200 if valid else 400), (bias, payload)
    assert alive(srv)


@PROP
@given(st.one_of(st.integers(-3, 2**31 + 3), st.sampled_from([2**31 - 1, 2**31, -1, 0])),
       st.floats(0.5, 3.0))
def test_penalty_window_property(srv: ServerProcess, last_n: int, penalty: float) -> None:
    """llama.cpp sizes a buffer by repeat_last_n: any accepted count must not reach it raw."""
    status, payload = post(srv, "/completion", {"prompt": "x", "n_predict": 2,
                                                "repeat_last_n": last_n,
                                                "repeat_penalty": penalty})
    assert status == (200 if -1 <= last_n <= 2**31 - 1 else 400), (last_n, payload)
    assert alive(srv)


@PROP
@given(st.one_of(st.integers(-(2**40), 2**40), st.integers(-2, 102), st.floats(),
                 st.booleans(), st.text(max_size=3)))
def test_n_probs_property(srv: ServerProcess, n_probs: Any) -> None:
    status, payload = post(srv, "/completion", {"prompt": "x", "n_predict": 1,
                                                "n_probs": n_probs})
    valid = (not isinstance(n_probs, bool) and isinstance(n_probs, (int, float))
             and math.isfinite(n_probs) and float(n_probs).is_integer() and 0 <= n_probs <= 100)
    assert status == (200 if valid else 400), (n_probs, payload)
    if valid and n_probs:
        top = payload["completion_probabilities"][0]["top_logprobs"]
        assert len(top) == int(n_probs)
    assert alive(srv)


HOSTILE: list[Any] = [None, 1, "x", [], {}, True, -1, 2**70, [2**70], [[1, 2]], {"a": 1},
                      [None], ["\ud800"], "\x00" * 1000, [[]] * 3, 1e308, -1e308]


def test_hostile_fields_never_5xx(srv: ServerProcess) -> None:
    fields = {"/completion": ["prompt", "n_predict", "stop", "temperature", "top_k", "seed",
                              "logit_bias", "n_probs", "grammar", "json_schema", "stream",
                              "ignore_eos", "cache_prompt", "repeat_last_n", "samplers"],
              "/v1/completions": ["prompt", "max_tokens", "n", "echo", "suffix", "stop"],
              "/tokenize": ["content", "add_special", "with_pieces"],
              "/detokenize": ["tokens"], "/apply-template": ["messages"],
              "/api/show": ["model"]}
    base = {"prompt": "x", "n_predict": 2, "content": "x", "tokens": [1],
            "messages": [{"role": "user", "content": "x"}], "model": "tiny-moe.gguf"}
    count = 0
    for path, names in fields.items():
        for name in names:
            for value in HOSTILE:
                status, payload = post(srv, path, {**base, name: value})
                assert status < 500, (path, name, value, payload)
                count += 1
    assert count > 300 and alive(srv)


def test_turn_line_still_serves_chat_after_completions(srv: ServerProcess) -> None:
    t0 = time.monotonic()
    status, chat = post(srv, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and time.monotonic() - t0 < 30


# -- start-up: llama-server's flags and variables ----------------------------------

def test_env_vars_read_as_flags_and_replaced_by_the_command_line() -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "768", "LLAMA_ARG_MODEL": "m.gguf", "LLAMA_API_KEY": "sekrit",
           "LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_ARG_N_GPU_LAYERS": "99",
           "LLAMA_ARG_FLASH_ATTN": "on", "HOME": "/x"}
    argv, lines = env_argv(["-c", "640"], env)
    assert argv == ["-c", "640", "--api-key", "sekrit", "--flash-attn", "on", "--model",
                    "m.gguf", "--n-gpu-layers", "99"]
    text = "\n".join(lines)
    assert "LLAMA_ARG_CTX_SIZE is replaced by the command line's --ctx-size" in text
    assert "LLAMA_ARG_HOST is not read" in text            # no variable widens the binding
    assert "LLAMA_ARG_N_GPU_LAYERS read as --n-gpu-layers 99" in text
    assert "LLAMA_ARG_FLASH_ATTN read as --flash-attn on" in text
    assert "sekrit" not in text
    with pytest.raises(SystemExit, match="LLAMA_API_KEY"):
        env_argv([], {"LLAMA_API_KEY": " "})
    argv, _ = env_argv(["--api-key-file", "k"], {"LLAMA_API_KEY": "x"})
    assert argv == ["--api-key-file", "k"]


def test_server_starts_from_llama_variables(tmp_path: Path, tiny_moe: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", LLAMA_ARG_MODEL=str(tiny_moe),
               LLAMA_ARG_CTX_SIZE="768", LLAMA_API_KEY=KEY, LLAMA_ARG_ENDPOINT_METRICS="1")
    err = tmp_path / "stderr.txt"
    with err.open("w") as errf:
        proc = subprocess.Popen([sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
                                 str(tmp_path / "data"), "--threads", "1", "-ngl", "99"],
                                stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        srv = ServerProcess(proc, line.split("listening on", 1)[1].strip(), tmp_path)
        try:
            srv.key = KEY
            srv.wait_state("ready")
            status, _, props = srv.request("GET", "/props")
            assert status == 200 and props["default_generation_settings"]["n_ctx"] == 768
            assert srv.request("GET", "/metrics")[0] == 200
            srv.key = None
            assert srv.request("GET", "/props")[0] == 401
        finally:
            srv.stop()
    text = err.read_text()
    assert "LLAMA_ARG_CTX_SIZE read as --ctx-size 768" in text
    assert "-ngl 99 has no effect" in text and KEY not in text


def test_parallel_makes_slots_that_split_the_context(tmp_path: Path, tiny_moe: Path) -> None:
    """--parallel 4 -c 1024: four slots of 256 tokens each, as llama-server makes them
    without --kv-unified; one turn runs at a time on them, and /props, /slots and the
    engine's own context say the same."""
    err = tmp_path / "stderr.txt"
    with err.open("w") as errf:
        proc = subprocess.Popen([sys.executable, "-m", "bmoe.server", "--port", "0",
                                 "--data-dir", str(tmp_path / "data"), "--threads", "1",
                                 "--no-auto", "-m", str(tiny_moe), "-c", "1024", "-np", "4"],
                                stdout=subprocess.PIPE, stderr=errf, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        srv = ServerProcess(proc, line.split("listening on", 1)[1].strip(), tmp_path)
        try:
            srv.wait_state("ready")
            props = srv.request("GET", "/props")[2]
            assert props["total_slots"] == 4, props
            assert props["default_generation_settings"]["n_ctx"] == 256, props
            assert srv.info()["model"]["n_ctx"] == 256                  # the engine's own
            listed = srv.request("GET", "/slots")[2]
            assert [s["id"] for s in listed] == [0, 1, 2, 3], listed
            assert all(s["n_ctx"] == 256 and not s["is_processing"] for s in listed)
            status, _, body = srv.request("POST", "/completion", {"prompt": "hi",
                                                                 "n_predict": 2, "id_slot": 3})
            assert status == 200 and body["id_slot"] == 3, body
            status, _, body = srv.request("POST", "/completion", {"prompt": "hi",
                                                                 "n_predict": 2, "id_slot": 4})
            assert status == 400 and "id_slot" in body["error"]["message"], body
            status, _, body = srv.request("POST", "/completion", {"prompt": "hi " * 400,
                                                                 "n_predict": 2})
            assert status == 400, body                                  # past the slot's 256
        finally:
            srv.stop()
    said = [x for x in err.read_text().splitlines() if "--parallel" in x]
    assert said == ["bmoe-server: --parallel 4: 4 slots, 256 tokens of context each (-c 1024 "
                    "split, as llama-server splits it without --kv-unified); this server "
                    "serves one turn at a time, the others wait in line."], said


# -- compressed request bodies (the cap holds before and after decoding) -------------

def test_decode_body_bounds() -> None:
    import gzip
    import zlib

    from bmoe.http.errors import HTTPError
    from bmoe.http.messages import decode_body
    raw = b'{"content": "hi"}'
    assert decode_body(gzip.compress(raw), "gzip", 100) == raw
    assert decode_body(zlib.compress(raw), "deflate", 100) == raw
    assert decode_body(b"", "gzip", 100) == b""
    bomb = gzip.compress(b" " * 10_000_000)
    assert len(bomb) < 20_000
    for body, coding, status in ((bomb, "gzip", 413), (gzip.compress(raw) + b"x", "gzip", 400),
                                 (gzip.compress(raw)[:-4], "gzip", 400), (b"not gzip", "gzip", 400),
                                 (raw, "deflate", 400)):
        with pytest.raises(HTTPError) as e:
            decode_body(body, coding, 1_000_000)
        assert e.value.status == status, (body[:20], coding)


def test_compressed_bodies_end_to_end(srv: ServerProcess) -> None:
    import gzip
    import zlib
    port = port_of(srv)
    body = json.dumps({"prompt": "Hello", "n_predict": 2}).encode()
    for coding, data in (("gzip", gzip.compress(body)), ("x-gzip", gzip.compress(body)),
                         ("deflate", zlib.compress(body))):
        reply = call(port, "POST", "/completion", raw=data,
                     headers=[("Content-Encoding", coding)])
        assert reply.status == 200 and reply.json()["tokens_predicted"] <= 2, coding
    reply = call(port, "POST", "/tokenize", raw=gzip.compress(b'{"content": "hi"}'),
                 headers=[("Content-Encoding", "gzip")])
    assert reply.status == 200 and reply.json()["tokens"]
    bomb = gzip.compress(b" " * (9 * 2**20))          # past the route's 8 MiB cap decoded
    reply = call(port, "POST", "/completion", raw=bomb, headers=[("Content-Encoding", "gzip")])
    assert reply.status == 413
    for coding in ("br", "gzip, gzip", "zstd"):
        reply = call(port, "POST", "/completion", raw=body, headers=[("Content-Encoding", coding)])
        assert reply.status == 415 and reply.header("accept-encoding") == "gzip, deflate", coding
    reply = call(port, "POST", "/completion", raw=gzip.compress(body) + b"junk",
                 headers=[("Content-Encoding", "gzip")])
    assert reply.status == 400
    assert alive(srv)


def test_shutdown_from_loopback_stops_cleanly(tmp_path: Path) -> None:
    srv = start_server(tmp_path, wait_ready=False)
    try:
        port = port_of(srv)
        assert call(port, "POST", "/shutdown", json_type=False,
                    headers=[("Content-Type", "text/plain")]).status == 415
        assert call(port, "POST", "/shutdown", body={},
                    headers=[("Origin", "http://evil.example")]).status == 403
        reply = call(port, "POST", "/shutdown", body={})
        assert reply.status == 200 and reply.json() == {"status": "stopping"}, reply
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_shutdown_is_registered_local_only() -> None:
    from _app_routes import flagged
    assert ("POST", "/shutdown") in flagged()


def test_config_file_rules(tmp_path: Path) -> None:
    from bmoe.server.llama_compat import config_argv
    from bmoe.server.main import build_parser
    parser = build_parser()
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"model": "m.gguf", "ctx-size": 4096, "metrics": True,
                               "allow-origin": ["http://a", "http://b"], "api-key": "k"}))
    argv, lines = config_argv(["--config", str(cfg), "-c", "640"], parser)
    assert argv == ["--model", "m.gguf", "--metrics", "--allow-origin", "http://a",
                    "--allow-origin", "http://b", "--api-key", "k", "-c", "640"]
    text = "\n".join(lines)
    assert "ctx-size is replaced by the command line's --ctx-size" in text
    assert "model read as --model m.gguf" in text
    assert "api-key read as --api-key (not shown)." in text
    args = parser.parse_args(argv)
    assert args.metrics and args.api_key == "k"
    for body, why in (('{"model": "a", "model": "b"}', "twice"), ('[1]', "one JSON object"),
                      ('{"--model": "a"}', "without its dashes"), ('{"help": true}', "asks"),
                      ('{"metrics": false}', "false"), ('{"model": null}', "null"),
                      ('{"model": true}', "takes a value"), ('{"metrics": "yes"}', "switch"),
                      ('{"nope": 1}', "not a flag"), ('{"model": {}}', "model"),
                      ('{"scan-dir": []}', "empty list"), ("{", "not JSON")):
        cfg.write_text(body)
        with pytest.raises(SystemExit, match=why):
            config_argv(["--config", str(cfg)], parser)
    with pytest.raises(SystemExit, match="twice"):
        config_argv(["--config", str(cfg), "--config=x"], parser)
    with pytest.raises(SystemExit, match="cannot be read"):
        config_argv(["--config", str(tmp_path / "missing.json")], parser)


def test_server_starts_from_a_config_file(tmp_path: Path, tiny_moe: Path) -> None:
    cfg = tmp_path / "server.json"
    cfg.write_text(json.dumps({"model": str(tiny_moe), "ctx-size": 1280, "metrics": True}))
    srv = start_server(tmp_path / "data", "--config", str(cfg), "-c", "768")
    try:
        status, _, props = srv.request("GET", "/props")
        assert status == 200, (props, srv.info())
        assert props["default_generation_settings"]["n_ctx"] == 768, props
        metrics = srv.request("GET", "/metrics")
        assert metrics[0] == 200, metrics
    finally:
        srv.stop()


def test_autoload_wakes_on_completion(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "--autoload", "-m", str(tiny_moe), "-c", "512")
    try:
        assert srv.request("POST", "/api/session/unload", {})[0] == 200
        assert srv.request("GET", "/health")[0] == 503
        status, body = post(srv, "/completion", {"prompt": "Hello", "n_predict": 2})
        assert status == 200 and body["tokens_predicted"] <= 2     # waited for the load
        assert srv.request("GET", "/health")[2] == {"status": "ok"}
    finally:
        srv.stop()


def test_chat_n_choices(srv: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, one = post(srv, "/v1/chat/completions", body)
    status, two = post(srv, "/v1/chat/completions", {**body, "n": 2})
    assert status == 200, two
    assert [c["index"] for c in two["choices"]] == [0, 1]
    greedy = srv.request("GET", "/api/config")[2]["values"].get("temp", 0) in (0, 0.0)
    if greedy:
        assert all(c["message"] == one["choices"][0]["message"] for c in two["choices"])
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert 2 <= two["usage"]["completion_tokens"] <= 8
    chunks = stream_chunks(srv, "/v1/chat/completions",
                           {**body, "n": 2, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    seen = {c["choices"][0]["index"] for c in chunks[:-1] if c.get("choices")}
    assert seen == {0, 1}
    assert chunks[-2]["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    got = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                        _strict_response_validation=True).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    status, refused = post(srv, "/v1/chat/completions", {**body, "n": 17})
    assert status == 400 and "`n`" in json.dumps(refused)


def test_seeded_choices_take_seed_plus_i() -> None:
    from bmoe.engine.sampling import SEED_RANDOM, Sampling
    from bmoe.engine.turn import TurnRequest
    from bmoe.server.protocols.choices import seeded
    req = TurnRequest(messages=[])
    assert [r.sampling.seed for r in seeded(req, 3, Sampling(seed=7))] == [7, 8, 9]
    assert all(r.sampling.seed == SEED_RANDOM for r in seeded(req, 2, Sampling()))
