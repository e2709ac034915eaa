"""Every quantization llama.cpp's quantizer writes, resident and streamed (issue 28).

A model-maker qwen3moe (F16; n_embd, n_head*head_dim and n_ff_exp multiples of 256, so
every K-quant and IQ type takes the matrices whole, with no fallback type) is quantized
in the set-up by llama.cpp's own ``llama_model_quantize`` into Q4_0, Q4_K_M, Q5_K_M, Q6_K,
Q8_0, IQ4_XS and MXFP4_MOE; deepseek2 (MLA, a leading dense layer, shared experts) as V3
and as V2-Lite has it, each plain and quantized. For every file:

* **resident, repack off** is the baseline;
* **streamed** (``moe-stream``, a cache small enough to evict, and no cache) must give the
  same greedy tokens and the same bytes of the last logits. Both run the same kernels:
  the streamer loads without extra buffer types and only moves expert bytes into the
  buffers llama.cpp reads, so both compute on the file's own layout with ggml's plain CPU
  matmuls, and any difference is the streamer's;
* **resident, repack auto** runs what this host chose (``bmoe.engine.kernels``: CPU_REPACK's
  interleaved kernels where the probe passed, none on an AMX host): other kernels, other
  bits, so it is asked to answer: the token count and finite logits.

Each prompt is one prefill batch of a few hundred tokens, then decoded tokens: batches of
two or more are what crashed the AMX kernels. The engines run in a child process
(tests/quant_worker.py), so a kernel that faults fails its test, not the test run. Then
three servers per type for two types (default flags, ``--no-repack``, ``--moe-stream``)
answer a long ``/completion`` and ``/v1/chat/completions`` and stay up, and ``bmoe-cli``
answers on the Q8_0 model its own ``make-model`` writes.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest

from _child import WorkerChild
from bmoe.engine import kernels
from bmoe.engine.experts.layout import read_layout
from bmoe.engine.kernels import KernelChoice
from bmoe.modelmaker import make_model
from bmoe.modelmaker.quantize import ftype_of, quantize
from bmoe.models.probe import read_file_header
from conftest import ServerProcess, start_server

T = gguf.GGMLQuantizationType
MIB = 1 << 20
WORKER = Path(__file__).resolve().parent / "quant_worker.py"

QWEN = dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
            n_expert=8, n_expert_used=2, n_ff_exp=256, dtype="f16", residual_scale=0.3,
            router_skew=1.0, seed=11)
# The type each file type gives the routed experts' gate matrices (the mixes keep other
# tensors in other types: ffn_down in Q6_K for the _M mixes, attention in Q8_0 for MXFP4).
EXPERT_TYPE = {"Q4_0": T.Q4_0, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K,
               "Q8_0": T.Q8_0, "IQ4_XS": T.IQ4_XS, "MXFP4_MOE": T.MXFP4}
# deepseek2 as V3: Q through a LoRA bottleneck, sigmoid gating with normalised and scaled
# weights, two shared experts; as V2-Lite: one attn_q, softmax, one shared expert. One
# dense leading layer each. residual_scale 0.3 (the maker's is 0.05): a wrong expert
# changes the greedy tokens, not only the logits.
DEEPSEEK_V3 = dict(arch="deepseek2", n_layer=3, n_embd=256, n_head=4, n_ff=256, n_expert=8,
                   n_expert_used=2, n_ff_exp=256, q_lora_rank=256, kv_lora_rank=256,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_dense_lead=1,
                   n_expert_shared=2, expert_gating="sigmoid", expert_weights_norm=True,
                   expert_weights_scale=2.5, dtype="f16", residual_scale=0.3, seed=12)
# (16 experts of width 192: their Q4_0 bytes, 1.3 MiB, are more than the smallest cache.)
DEEPSEEK_LITE = dict(arch="deepseek2", n_layer=2, n_embd=256, n_head=4, n_ff=256,
                     n_expert=16, n_expert_used=2, n_ff_exp=192, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, dtype="f32",
                     residual_scale=0.3, seed=13)
DEEPSEEK = {"deepseek2-f16": "", "deepseek2-Q4_K_M": "Q4_K_M",
            "deepseek2-lite-f32": "", "deepseek2-lite-Q4_0": "Q4_0"}

BASE = {"temp": 0, "ctx-size": 1024, "threads": 1}
N_TOKENS = 16
PROMPT_TEXT = ("Tell me about the weather in Paris, London and Rome this week, day by day, "
               "and what I should wear in the morning and in the evening. ") * 5
MESSAGES = [{"role": "user", "content": PROMPT_TEXT}]
SERVED = ("Q4_0", "Q4_K_M")          # Q4_0 and Q4_K are what CPU_REPACK takes on AVX2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quantized")
    qwen = make_model(d / "qwen3moe-f16.gguf", **QWEN)
    out = {f"qwen3moe-{f}": quantize(qwen, d / f"qwen3moe-{f.lower()}.gguf", f)
           for f in EXPERT_TYPE}
    v3 = make_model(d / "deepseek2-f16.gguf", **DEEPSEEK_V3)
    lite = make_model(d / "deepseek2-lite-f32.gguf", **DEEPSEEK_LITE)
    out |= {"deepseek2-f16": v3, "deepseek2-lite-f32": lite,
            "deepseek2-Q4_K_M": quantize(v3, d / "deepseek2-q4_k_m.gguf", "Q4_K_M"),
            "deepseek2-lite-Q4_0": quantize(lite, d / "deepseek2-lite-q4_0.gguf", "Q4_0")}
    return out


@pytest.fixture(scope="module")
def host() -> KernelChoice:
    """What a resident load with repack auto runs here (the probe runs once per host, in
    a child, and is cached; so the worker reads its verdict)."""
    return kernels.choose("auto")


@pytest.fixture(scope="module")
def worker(host: KernelChoice) -> Iterator[WorkerChild]:
    child = WorkerChild(WORKER, timeout_s=120)
    yield child
    child.close()


def run(worker: WorkerChild, path: Path, **values: Any) -> dict[str, Any]:
    out = worker.ask({"path": str(path), "values": {**BASE, **values},
                      "messages": MESSAGES, "max_tokens": N_TOKENS})
    assert not out.crashed, f"{path.name} {values}: the engine died (exit {out.returncode})"
    assert not out.timed_out, f"{path.name} {values}: no answer in {worker.timeout_s} s"
    assert "error" not in out.answer, out.answer
    answer = out.answer
    assert len(answer["tokens"]) == N_TOKENS and answer["finite"], answer
    assert answer["n_prompt"] > 200, answer          # one prefill batch of many tokens
    return answer


def same_kernels_gate(worker: WorkerChild, path: Path, host: KernelChoice) -> dict[str, Any]:
    """The module docstring's three engines on one file; returns the baseline answer."""
    off = run(worker, path, repack="off")
    assert off["kernels"]["extra_bufts"] is False and not off["streamed"]
    auto = run(worker, path, repack="auto")
    assert not auto["streamed"]
    assert auto["kernels"]["extra_bufts"] is host.extra_bufts, auto["kernels"]
    cache_mb = math.ceil(read_layout(path).token_cycle_bytes / MIB)
    stream = {"moe-stream": True, "io-threads": 2}
    small = run(worker, path, **stream, **{"cache-mb": cache_mb})
    s = small["summary"]
    assert s["cache_budget_mib"] == cache_mb and s["cache_evictions"] > 0, s
    assert 0 < s["cache_hit_pct"] < 100, s
    uncached = run(worker, path, **stream, **{"cache-mb": 0})
    assert uncached["summary"]["cache_hit_pct"] == -1 and uncached["read_bytes"] > 0
    for streamed in (small, uncached):
        assert streamed["streamed"] and streamed["kernels"]["decided_by"] == "streamer"
        assert streamed["kernels"]["extra_bufts"] is False
        assert streamed["tokens"] == off["tokens"], (path.name, streamed["summary"])
        assert streamed["logits_sha256"] == off["logits_sha256"], path.name
    return off


def tensor_types(path: Path) -> dict[str, T]:
    return {t.name: T(t.type) for t in read_file_header(path).tensors}


# --- the quantized files -------------------------------------------------------------------

@pytest.mark.parametrize("ftype", sorted(EXPERT_TYPE))
def test_the_quantizer_writes_the_type(models: dict[str, Path], ftype: str) -> None:
    path = models[f"qwen3moe-{ftype}"]
    header = read_file_header(path)
    assert header.kv["general.file_type"] == ftype_of(ftype)
    types = tensor_types(path)
    for layer in range(2):
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == EXPERT_TYPE[ftype], types
        assert types[f"blk.{layer}.ffn_gate_inp.weight"] == T.F32     # routers stay F32


# --- resident and streamed, the same kernels ----------------------------------------------

@pytest.mark.parametrize("ftype", sorted(EXPERT_TYPE))
def test_streamed_equals_resident_for_every_quantization(
        worker: WorkerChild, models: dict[str, Path], host: KernelChoice, ftype: str) -> None:
    same_kernels_gate(worker, models[f"qwen3moe-{ftype}"], host)


@pytest.mark.parametrize("name", sorted(DEEPSEEK))
def test_deepseek2_loads_resident_and_streams(worker: WorkerChild, models: dict[str, Path],
                                              host: KernelChoice, name: str) -> None:
    path = models[name]
    layout = read_layout(path)
    assert layout.arch == "deepseek2" and layout.layers == tuple(range(1, layout.n_layer))
    if DEEPSEEK[name]:
        assert tensor_types(path)["blk.1.ffn_gate_exps.weight"] == EXPERT_TYPE[DEEPSEEK[name]]
    off = same_kernels_gate(worker, path, host)
    assert off["arch"] == "deepseek2"


# --- servers ------------------------------------------------------------------------------

def _ask_completion(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("POST", "/completion", {
        "prompt": PROMPT_TEXT * 2, "n_predict": 12, "temperature": 0, "return_tokens": True})
    assert status == 200, body
    assert body["tokens_evaluated"] > 400 and body["tokens_predicted"] == 12, body
    assert len(body["tokens"]) == 12, body
    return body


def _ask_chat(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("POST", "/v1/chat/completions", {
        "model": "m", "messages": MESSAGES, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 12, body
    assert body["choices"][0]["finish_reason"] == "length", body
    return body


@pytest.mark.parametrize("ftype", SERVED)
def test_servers_answer_long_prompts_and_stay_up(tmp_path: Path, models: dict[str, Path],
                                                 host: KernelChoice, ftype: str) -> None:
    path = models[f"qwen3moe-{ftype}"]
    cache_mb = str(math.ceil(read_layout(path).token_cycle_bytes / MIB))
    flags = {"default": ["--no-moe-stream"], "off": ["--no-moe-stream", "--no-repack"],
             "streamed": ["--moe-stream", "--cache-mb", cache_mb]}
    servers: dict[str, ServerProcess] = {}
    got: dict[str, dict[str, Any]] = {}
    try:
        for name, extra in flags.items():        # started together: their loads overlap
            servers[name] = start_server(tmp_path / name, "-m", str(path), "-c", "2048",
                                         *extra, wait_ready=False)
        for name, srv in servers.items():
            assert srv.wait_state("ready", "error")["state"] == "ready", srv.info()
            got[name] = {"completion": _ask_completion(srv), "chat": _ask_chat(srv)}
            info = srv.info()
            assert srv.proc.poll() is None and info["state"] == "ready", info
            got[name]["model"] = info["model"]
    finally:
        for srv in servers.values():
            srv.stop()
    assert got["default"]["model"]["kernels"]["extra_bufts"] is host.extra_bufts
    assert got["off"]["model"]["kernels"]["extra_bufts"] is False
    assert got["streamed"]["model"]["streaming"] is True
    assert got["streamed"]["model"]["kernels"]["extra_bufts"] is False
    # the streamer and the resident engine on the file's own layout: the same tokens
    stream, off = got["streamed"], got["off"]
    assert stream["completion"]["tokens"] == off["completion"]["tokens"]
    assert stream["completion"]["content"] == off["completion"]["content"]
    assert stream["chat"]["choices"][0]["message"] == off["chat"]["choices"][0]["message"]


# --- the CLI ------------------------------------------------------------------------------

def test_cli_answers_on_its_own_q8_0_model(tmp_path: Path) -> None:
    """The issue's report: ``bmoe-cli make-model --dtype q8_0`` then ``bmoe-cli -m`` died
    with SIGSEGV on an AMX host (a batched prompt through the AMX Q8_0 matmul)."""
    model = tmp_path / "q8.gguf"
    cli = [sys.executable, "-m", "bmoe.cli"]
    made = subprocess.run([*cli, "make-model", "--out", str(model), "--dtype", "q8_0"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert tensor_types(model)["blk.0.ffn_up_exps.weight"] == T.Q8_0
    done = subprocess.run([*cli, "-m", str(model), "-p", PROMPT_TEXT, "-n", "8", "-t", "1",
                           "-c", "1024", "--no-think"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip(), done.stdout
    assert "generation: 8 tokens" in done.stderr, done.stderr[-2000:]
