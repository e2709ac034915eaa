"""A prompt's MoE matmuls four rows at a time on repacked experts (bmoe.engine.moegemm).

The real engine on models the model maker writes and llama.cpp quantizes: a gpt-oss MoE
with MXFP4 experts and a Qwen3 MoE in Q4_K_M, Q4_0, IQ4_NL and Q2_K, resident with
repacking on, and the first streamed. Where this host's kernel choice keeps repacking off,
or its CPU_REPACK picks other kernels than the kinds wrapped, the tests check that nothing
is wrapped instead.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bmoe.engine import kernels, moegemm
from bmoe.engine.experts import streamer_factory
from bmoe.engine.experts.repack import GGML_TYPE_MXFP4, RepackUnavailable, packer
from bmoe.engine.session import Session
from bmoe.modelmaker import make_model
from bmoe.modelmaker.quantize import quantize

# kind: (llama.cpp's file type for the Qwen3 MoE, the experts' ggml type)
QUANTS = {"q4_k": ("Q4_K_M", 12), "q4_0": ("Q4_0", 2), "iq4_nl": ("IQ4_NL", 20),
          "q2_k": ("Q2_K", 10)}
BASE = {"temp": 0, "ctx-size": 512, "threads": 2, "repack": "on", "ubatch-size": 128,
        "batch-size": 128}
PROMPT = 200            # tokens: every batch of 128 and the rest of 72 pass MIN_TOKENS (32)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("moegemm")
    oss = make_model(d / "oss.gguf", arch="gpt-oss", n_layer=2, n_embd=256, n_head=4,
                     n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4, n_ff_exp=256,
                     dtype="f16", expert_dtype="mxfp4", residual_scale=0.3, seed=11)
    f16 = make_model(d / "qwen-f16.gguf", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                     head_dim=64, n_expert=16, n_expert_used=4, n_ff_exp=256, dtype="f16",
                     residual_scale=0.3, seed=12)
    out = {"mxfp4": oss}
    for kind, (ftype, _) in QUANTS.items():
        out[kind] = quantize(f16, d / f"qwen-{kind}.gguf", ftype)
    return out


def scratch_kernels(ggml_type: int, ne0: int, ne1: int, ne2: int) -> int:
    """The kernels object CPU_REPACK gives a tensor of this type and shape here (0: none,
    or no CPU_REPACK here)."""
    try:
        return packer().scratch_kernels(ggml_type, ne0, ne1, ne2)
    except RepackUnavailable:
        return 0


def expected_wraps(ggml_type: int, ne0: int, ne1: int, ne2: int) -> bool:
    """Whether this host should wrap an expert tensor of this type and shape: repacking
    allowed by the kernel choice and CPU_REPACK picking one of the kinds for it."""
    if not kernels.choose("on").extra_bufts:
        return False
    traits = scratch_kernels(ggml_type, ne0, ne1, ne2)
    return bool(traits) and moegemm.wrap(traits) != 0


WANT = {"mxfp4": (GGML_TYPE_MXFP4, 256, 256, 16),
        **{kind: (t, 256, 256, 16) for kind, (_, t) in QUANTS.items()}}


def prompt_of(s: Session, n: int) -> list[int]:
    words = "the quick brown fox jumps over a lazy dog while seven engineers measure".split()
    return s.tokenize(" ".join(words[(i * 5) % len(words)] for i in range(2 * n)))[:n]


def run(path: Path, n_prompt: int, gemm: str, monkeypatch: pytest.MonkeyPatch,
        **values: Any) -> tuple[list[int], np.ndarray, int]:
    """A prompt and 12 greedy tokens: the tokens, the prompt's last logits and how many
    MUL_MAT_IDs the wrapper ran."""
    monkeypatch.setenv(moegemm.ENV, gemm)
    before = moegemm.stats()["ops"]
    factory = streamer_factory if values.get("moe-stream") else None
    s = Session(path, {**BASE, **values}, factory)
    try:
        tokens = prompt_of(s, n_prompt)
        cancel = threading.Event()
        s.prefill(tokens, cancel)
        logits = np.array(s.logits_row(), dtype=np.float32)
        out = list(tokens)
        for _ in range(12):
            out.append(int(s.logits_row().argmax()))
            s.prefill(out, cancel)
        return out[len(tokens):], logits, moegemm.stats()["ops"] - before
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["mxfp4", *QUANTS])
def test_a_prompts_expert_rows_run_four_at_a_time_with_llama_cpps_results(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Resident, repacking on: with the wrapper the prompt's MUL_MAT_IDs run four rows at
    a time (counted), the greedy tokens are those of llama.cpp's own one-row path and
    the logits agree with them to float rounding (the gemm kernels sum the same products
    in their own order; on MXFP4 here they come out identical)."""
    wraps = expected_wraps(*WANT[kind])
    own_tokens, own_logits, own_ops = run(models[kind], PROMPT, "0", monkeypatch)
    padded = moegemm.stats()["padded"]
    tokens, logits, ops = run(models[kind], PROMPT, "1", monkeypatch)
    assert own_ops == 0
    assert (ops > 0) == wraps, (ops, wraps)
    # some expert got two or three rows past its fours, run as a padded group of four
    assert (moegemm.stats()["padded"] > padded) == wraps
    assert tokens == own_tokens
    scale = float(np.abs(own_logits).max())
    assert float(np.abs(logits - own_logits).max()) <= 1e-3 * scale
    assert int(logits.argmax()) == int(own_logits.argmax())


def test_short_batches_keep_llama_cpps_path(models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch under 32 tokens (and every decode step) goes to llama.cpp's own kernels:
    the same bytes as with the wrapper off."""
    tokens, logits, ops = run(models["mxfp4"], 20, "1", monkeypatch)
    own_tokens, own_logits, _ = run(models["mxfp4"], 20, "0", monkeypatch)
    assert ops == 0
    assert tokens == own_tokens and logits.tobytes() == own_logits.tobytes()


def test_streamed_experts_run_four_rows_at_a_time_as_resident_ones(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert streamer's repacked MXFP4 experts get the wrapper when it binds them:
    under a cache that evicts, the prompt's tokens and logits are the resident engine's
    with the wrapper, byte for byte."""
    wraps = expected_wraps(*WANT["mxfp4"])
    resident = run(models["mxfp4"], PROMPT, "1", monkeypatch)
    streamed = run(models["mxfp4"], PROMPT, "1", monkeypatch, **{
        "moe-stream": True, "io-threads": 2, "cache-mb": 1})
    assert (streamed[2] > 0) == wraps
    assert streamed[0] == resident[0]
    assert streamed[1].tobytes() == resident[1].tobytes()


def test_only_the_kinds_are_wrapped() -> None:
    """An object whose virtual functions are not one of the kinds' is never wrapped (a
    made-up object); one that is gets one wrapper, which wrapped again is itself."""
    fake_vtable = (ctypes.c_void_p * 6)(*([ctypes.cast(ctypes.pythonapi.Py_IsInitialized,
                                                       ctypes.c_void_p).value] * 6))
    fake = (ctypes.c_void_p * 2)(ctypes.addressof(fake_vtable), None)
    assert moegemm.wrap(ctypes.addressof(fake)) == 0
    assert moegemm.wrap(0) == 0
    mx = scratch_kernels(*WANT["mxfp4"])
    w = moegemm.wrap(mx)
    if w:
        assert moegemm.wrap(w) == w              # wrapping the wrapper: itself
        assert w != mx


def test_it_turns_off_with_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(moegemm.ENV, "0")
    assert not moegemm.enabled()
    assert moegemm.callback() is None
    monkeypatch.setenv(moegemm.ENV, "1")
    assert moegemm.enabled() == bool(moegemm.kinds())
