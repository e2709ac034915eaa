"""A resident MoE's prompt and decode tokens/s: llama.cpp's repacked MoE matmul against
bmoe's four rows at a time (`bmoe.engine.moegemm`), and the file's own layout.

    python bench/moe_gemm.py [--runs 3] [--prompt 2048] [--ubatch 512] [--model PATH ...]

Each run loads the model three times, in turn, each in its own process, through the
engine's `Session` (resident, 2 threads): `file layout` (repack off: llama.cpp's kernels
on the file's bytes), `repacked` (repack on, `BMOE_MOE_GEMM=0`: llama.cpp's CPU_REPACK
kernels, its MUL_MAT_ID one row at a time; the baseline) and `four rows` (repack on, the
engine's default: a prompt's expert rows grouped four at a time into llama.cpp's gemm
kernels). It times a prompt of `--prompt` tokens in batches of `--ubatch` and 32 greedy
tokens one at a time, and prints each variant's median tokens/s and its ratio to
`repacked`. The models: written here and quantized by llama.cpp (a gpt-oss-shaped MoE
with MXFP4 experts, a Qwen3-MoE-shaped one in Q4_K_M, Q4_0, IQ4_NL and Q2_K), or
`--model PATH` (the gpt-oss-120b and Qwen3-30B-A3B slices of stream_vs_mmap.py). On a host
where the kernel choice keeps repacking off (AMX) only `file layout` runs, and it says so.
BENCH_THREADS=N sets the threads (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe-bench"
VARIANTS = {  # name: (repack value, BMOE_MOE_GEMM)
    "file layout": ("off", "1"),
    "repacked": ("on", "0"),
    "four rows": ("on", "1"),
}
BASELINE = "repacked"
# the Qwen3-shaped model's quantizations: one per kind the four-row path takes
QWEN_QUANTS = ("Q4_K_M", "Q4_0", "IQ4_NL", "Q2_K")


def models() -> list[tuple[str, Path]]:
    from bmoe.modelmaker import make_model
    from bmoe.modelmaker.quantize import quantize
    oss = CACHE / "moegemm-oss-mxfp4.gguf"
    if not oss.exists():
        make_model(oss, arch="gpt-oss", n_layer=6, n_embd=1024, n_head=16, n_head_kv=4,
                   head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=1024, dtype="f16",
                   expert_dtype="mxfp4", seed=7)
    out = [("gpt-oss-shaped MoE, MXFP4 experts", oss)]
    f16 = CACHE / "moegemm-qwen3moe-f16.gguf"
    for ftype in QWEN_QUANTS:
        q = CACHE / f"moegemm-qwen3moe-{ftype.lower()}.gguf"
        if not q.exists():
            if not f16.exists():
                make_model(f16, n_layer=6, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64,
                           n_expert=32, n_expert_used=8, n_ff_exp=768, dtype="f16", seed=8)
            quantize(f16, q, ftype, threads=THREADS)
        out.append((f"Qwen3-MoE-shaped, {ftype}", q))
    f16.unlink(missing_ok=True)
    return out


def worker(spec: dict[str, object]) -> dict[str, object]:
    """One load: prompt and decode tokens/s (run in a child process)."""
    import threading

    from bmoe.engine import moegemm
    from bmoe.engine.session import Session
    n_prompt = int(spec["prompt"])  # type: ignore[call-overload]
    values = {"temp": 0, "threads": THREADS, "moe-stream": False, "repack": spec["repack"],
              "ctx-size": n_prompt + 64, "batch-size": spec["ubatch"],
              "ubatch-size": spec["ubatch"]}
    s = Session(str(spec["model"]), values)
    try:
        words = ("the quick brown fox jumps over a lazy dog while seven engineers "
                 "measure prompts and tokens ").split()
        text = " ".join(words[(i * 7) % len(words)] for i in range(n_prompt * 2))
        tokens = s.tokenize(text)[:n_prompt]
        cancel = threading.Event()
        t0 = time.perf_counter()
        s.prefill(tokens, cancel)
        prefill = len(tokens) / (time.perf_counter() - t0)
        out = list(tokens)
        t0 = time.perf_counter()
        for _ in range(32):
            out.append(int(s.logits_row().argmax()))
            s.prefill(out, cancel)
        decode = 32 / (time.perf_counter() - t0)
        return {"prefill": prefill, "decode": decode, "kernels": s.kernels.line(),
                "moegemm": moegemm.stats()}
    finally:
        s.close()


def run(model: Path, variant: str, args: argparse.Namespace) -> dict[str, object]:
    repack, gemm = VARIANTS[variant]
    spec = {"model": str(model), "repack": repack, "prompt": args.prompt,
            "ubatch": args.ubatch}
    env = dict(os.environ, BMOE_MOE_GEMM=gemm)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} on {model.name} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--model", action="append", default=[], type=Path,
                    help="a GGUF MoE to measure instead of the two written here (repeatable)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from bmoe.engine import kernels, moegemm
    choice = kernels.choose("on")
    print(f"host: {kernels.registered_extra_bufts() or 'no extra buffer types'}; "
          f"repack on: {choice.line()}; four-row kinds: {moegemm.kinds() or 'none'}; "
          f"threads {THREADS}; prompt {args.prompt}, ubatch {args.ubatch}")
    names = list(VARIANTS) if choice.extra_bufts else ["file layout"]
    for label, path in ([(m.name, m) for m in args.model] or models()):
        got: dict[str, list[dict[str, object]]] = {v: [] for v in names}
        t0 = time.monotonic()
        for _ in range(args.runs):
            for v in names:
                got[v].append(run(path, v, args))
        base_p = base_d = None
        if BASELINE in got:
            base_p = statistics.median(float(r["prefill"]) for r in got[BASELINE])  # type: ignore[arg-type]
            base_d = statistics.median(float(r["decode"]) for r in got[BASELINE])  # type: ignore[arg-type]
        print(f"\n{label} ({path.stat().st_size / 2**30:.2f} GiB; {args.runs} runs, "
              f"{time.monotonic() - t0:.0f} s)")
        for v in names:
            p = statistics.median(float(r["prefill"]) for r in got[v])  # type: ignore[arg-type]
            d = statistics.median(float(r["decode"]) for r in got[v])  # type: ignore[arg-type]
            ratio = (f"  x {BASELINE}: prefill {p / base_p:.2f}, decode {d / base_d:.2f}"
                     if base_p and base_d else "")
            ops = got[v][-1]["moegemm"]
            print(f"  {v:12s} prefill {p:8.1f} tok/s  decode {d:6.2f} tok/s{ratio}"
                  f"  (four-row ops {ops['ops']})")  # type: ignore[index]
        if not choice.extra_bufts:
            print(f"  repacked and four rows not run: {choice.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
