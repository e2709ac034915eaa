"""The kernel probe: run llama.cpp's extra buffer types once, in a process of its own.

llama.cpp's CPU backend can hand a model's weights to *extra buffer types*: weight
repacking (``CPU_REPACK``: Q4_0, Q4_K, IQ4_NL and MXFP4 rows interleaved for AVX2 /
AVX-512 kernels) and, where the build was compiled for it, AMX tiles. They are chosen at
load, per tensor, and they run other kernels than the file's own layout does. On some
hosts those kernels fault (the pinned build's AMX matmul reads a half-written tile
configuration and dies with SIGSEGV on any batch of two or more tokens), which would take
the server and every user's session with it.

So this program is what the engine runs before it trusts them (``bmoe.engine.kernels``
starts it as ``python -m bmoe.kernelprobe`` and caches the verdict): it writes a tiny
model-maker MoE, quantizes it with llama.cpp's quantizer into every type those buffer
types take, and for each one decodes a MoE prompt batch (which the engine's four-row MoE
matmuls take, `bmoe.engine.moegemm`, as a session would run them), a smaller batch and a
single token with the extra buffer types on and off. A crash is the parent's verdict
"unusable" (the last progress line on stderr says where); logits that disagree beyond
quantization noise are "unusable" too; otherwise it prints a JSON report on stdout.

``BMOE_KERNEL_PROBE_FAULT=1`` makes the probe die as a faulting kernel would (SIGSEGV,
before its first decode with extra buffer types on): the tests use it to take the
"unusable" branch on a host whose kernels work.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from .engine import moegemm
from .modelmaker import make_model
from .modelmaker.quantize import quantize

# The types the CPU extra buffer types take (repack: Q4_0, Q4_K, IQ4_NL, MXFP4 experts;
# AMX: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS), each through a file type that makes
# the model's matrices of that type.
PROBE_TYPES = ("Q4_0", "Q4_K_M", "IQ4_NL", "MXFP4_MOE", "Q8_0", "Q6_K", "IQ4_XS")
# tokens per decode: a MoE prompt batch the four-row path takes (bmoe.engine.moegemm: 32
# and up), a prompt batch, the smallest, one token
BATCHES = (40, 16, 2, 1)
MAX_REL_ERR = 0.05              # logits' distance allowed between the two layouts
FAULT_ENV = "BMOE_KERNEL_PROBE_FAULT"

# Every width a multiple of 256 (a K-quant block), rows a multiple of 8 (repack's
# interleave): every probed type is taken by the buffer types, not left to fallbacks.
SPEC = dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
            n_expert=8, n_expert_used=2, n_ff_exp=256, dtype="f32", seed=7)


def _say(text: str) -> None:
    os.write(2, f"kernel probe: {text}\n".encode())


@lc.llama_log_callback
def _quiet(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    pass


def _logits(path: Path, extra: bool) -> list[np.ndarray]:
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = extra
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the probe model {path.name}")
    try:
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = 64
        cparams.n_batch = cparams.n_ubatch = max(BATCHES)
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.no_perf = True
        callback = moegemm.callback() if extra else None
        if callback is not None:       # the engine's MoE prompt matmuls, as a Session runs them
            cparams.cb_eval = callback
            cparams.cb_eval_user_data = None
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the probe's context")
        try:
            return _decode_batches(model, ctx, path.name, extra)
        finally:
            lc.llama_free(ctx)
    finally:
        lc.llama_model_free(model)


def _decode_batches(model: Any, ctx: Any, name: str, extra: bool) -> list[np.ndarray]:
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    out: list[np.ndarray] = []
    pos = 0
    for n in BATCHES:
        if extra:
            _say(f"{name}: a batch of {n} with extra buffer types")
            if os.environ.get(FAULT_ENV) == "1":
                os.kill(os.getpid(), signal.SIGSEGV)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i in range(n):
                batch.token[i] = (pos * 7 + 3) % n_vocab
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
                pos += 1
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode refused the probe's batch of {n}")
            rows = lc.llama_get_logits(ctx)
            out.append(np.ctypeslib.as_array(rows, shape=(n * n_vocab,)).copy())
        finally:
            lc.llama_batch_free(batch)
    return out


def _rel_err(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = float(np.linalg.norm(x)) or 1.0
        worst = max(worst, float(np.linalg.norm(x - y)) / scale)
    return worst


def run(folder: Path) -> dict[str, Any]:
    lc.llama_log_set(_quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    base = make_model(folder / "probe-f32.gguf", **SPEC)  # type: ignore[arg-type]
    checked: dict[str, float] = {}
    for ftype in PROBE_TYPES:
        path = quantize(base, folder / f"probe-{ftype.lower()}.gguf", ftype)
        plain = _logits(path, extra=False)
        packed = _logits(path, extra=True)
        err = _rel_err(plain, packed)
        checked[ftype] = round(err, 6)
        if not np.isfinite(err) or err > MAX_REL_ERR:
            return {"usable": False, "checked": checked,
                    "why": f"{ftype} logits with extra buffer types differ from the file's "
                           f"own layout (relative error {err:.3g})"}
    return {"usable": True, "checked": checked, "why": ""}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bmoe-kernel-probe-") as tmp:
        try:
            report = run(Path(tmp))
        except Exception as e:  # noqa: BLE001 - the parent reads the verdict, not a trace
            report = {"usable": False, "checked": {}, "why": f"the probe failed: {e}"}
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
