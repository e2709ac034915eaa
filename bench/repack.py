"""Prefill and decode tokens/s with llama.cpp's extra buffer types (repacking) on and off.

    python bench/repack.py [--runs 3] [--prompt 512] [--decode 64] [--model PATH]

What the `repack` setting buys on this host, measured on real layouts: Gemma 3 270M in
Q4_K_M (the PyPI model the tests use; its q4_K tensors are what repacking takes) and a
model-maker dense qwen3 (1024 wide, 8 layers) quantized by llama.cpp to Q4_0 (the type
repacking was first written for). Each run loads the model twice, extra buffer types off
(the baseline: the file's own layout, as the expert streamer runs) and on, in turn, and
times a prompt of `--prompt` tokens (one llama_decode per 512) and `--decode` greedy
tokens one at a time. Printed: each layout's median tokens/s and on ÷ off, per model.
`--model PATH` measures that file instead (the gpt-oss-120b slice: what the expert
streamer's repacked MXFP4 experts are worth to its compute).
The on-run is skipped (and said so) where the engine's kernel choice is off here
(AMX hosts: the pinned build's AMX kernels crash on batches). BENCH_THREADS=N sets the
threads (default 2).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import llama_cpp as lc  # noqa: E402
import numpy as np  # noqa: E402

from bmoe.engine import kernels  # noqa: E402
from bmoe.modelmaker import make_model  # noqa: E402
from bmoe.modelmaker.quantize import quantize  # noqa: E402

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe-bench"


def models() -> list[tuple[str, Path]]:
    from _real_models import gemma_path
    dense = CACHE / "repack-dense-q4_0.gguf"
    if not dense.exists():
        f32 = make_model(CACHE / "repack-dense-f32.gguf", arch="qwen3", n_layer=8,
                         n_embd=1024, n_head=16, n_head_kv=8, head_dim=64, n_ff=2816,
                         seed=1)
        quantize(f32, dense, "Q4_0", threads=THREADS)
        f32.unlink()
    return [("gemma3-270m Q4_K_M", gemma_path()), ("dense qwen3 1024x8 Q4_0", dense)]


def measure(path: Path, extra: bool, n_prompt: int, n_decode: int) -> tuple[float, float]:
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = extra
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_prompt + n_decode + 8
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = THREADS
    cp.no_perf = True
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    try:
        ids = [(i * 7919 + 11) % (n_vocab - 1000) + 500 for i in range(n_prompt)]
        t0 = time.perf_counter()
        for start in range(0, n_prompt, 512):
            chunk = (lc.llama_token * 512)(*ids[start:start + 512])
            n = min(512, n_prompt - start)
            if lc.llama_decode(ctx, lc.llama_batch_get_one(chunk, n)) != 0:
                raise RuntimeError("prefill failed")
        prefill = n_prompt / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        one = (lc.llama_token * 1)()
        for _ in range(n_decode):
            row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            one[0] = int(row.argmax())
            if lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("decode failed")
        decode = n_decode / (time.perf_counter() - t0)
        return prefill, decode
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


@lc.llama_log_callback
def _quiet(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--model", action="append", default=[], type=Path,
                    help="a GGUF file to measure instead of the two built-in models "
                         "(repeatable), e.g. the gpt-oss-120b slice of stream_vs_mmap.py")
    args = ap.parse_args()
    lc.llama_log_set(_quiet, ctypes.c_void_p(0))
    lc.llama_backend_init()
    choice = kernels.choose("auto")
    print(f"host: {kernels.registered_extra_bufts() or 'no extra buffer types'}; "
          f"engine's choice: {choice.line()}; threads {THREADS}")
    for name, path in ([(m.name, m) for m in args.model] or models()):
        got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.runs):
            for extra in (False, True):
                if extra and not choice.extra_bufts:
                    continue
                got[extra].append(measure(path, extra, args.prompt, args.decode))
        off_p = statistics.median(p for p, _ in got[False])
        off_d = statistics.median(d for _, d in got[False])
        print(f"{name}: off (baseline) prefill {off_p:.1f} tok/s, decode {off_d:.2f} tok/s")
        if not got[True]:
            print(f"{name}: on not run ({choice.reason})")
            continue
        on_p = statistics.median(p for p, _ in got[True])
        on_d = statistics.median(d for _, d in got[True])
        print(f"{name}: on            prefill {on_p:.1f} tok/s, decode {on_d:.2f} tok/s"
              f"  -> on/off prefill {on_p / off_p:.2f}x, decode {on_d / off_d:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
