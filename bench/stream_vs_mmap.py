"""Expert streaming against llama.cpp on mmap, under a memory cap smaller than the model.

    sudo .venv/bin/python bench/stream_vs_mmap.py --dir DIR --threads 1    # 4-6 minutes here

Writes a benchmark MoE with the model maker (default: qwen3moe 24 layers x 64 experts,
top-4, F16, 4.6 GiB, router skew and local context so routing looks like real text),
measures the disk's O_DIRECT read rate, then teacher-forces the same text, token by
token, through:

  compute   llama.cpp on mmap with the file in the page cache, no cap (the compute floor)
  mmap      llama.cpp on mmap (bmoe with moe-stream off) under the cap (--mmap-tokens)
  auto      bmoe streaming, cache-mb auto, LRU, serial reads (issue 7's engine), under the cap
  next-use  the same with the next-use cache policy
  auto+prefetch          next-use, read-ahead of the next layer, serial
  auto+prefetch+overlap  next-use, read-ahead `--depth` layers, reads overlapped with compute
  nocache   bmoe streaming, cache-mb 0, under the cap

each in its own process inside a cgroup-v1 memory cap (a child of this process's
memory cgroup, `--cap-frac` of the file size), with the page cache dropped before each
run. The first `--warmup` tokens are not timed. From the auto run's routing (captured by
the streamer) it prints the router skew (top-quarter share, consecutive-token overlap),
and simulates an offline optimal cache (Belady) of the same size: the serial I/O floor is
its bytes per token at the measured read rate plus the compute floor; the overlapped
floor is the larger of the two. Every run's load time is printed beside the dense
bytes / disk rate that a load reading no experts needs.

With `--shape qwen3-30b-a3b|gpt-oss-120b` the model is a slice of that real model
(`--layers`, default 12) quantized by llama.cpp as the model is (`SHAPES`); the table's
`rd MiB/s` and `/disk` columns give the engine's achieved read rate beside the disk's.

Needs root (cgroups, drop_caches). Deletes the model file at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    MIB,
    MemoryCap,
    burst_read_rate,
    consecutive_overlap,
    direct_read_rate,
    drop_caches,
    simulate,
    top_quarter_share,
)

TEXT = (
    "The history of the city begins with a small village on the river, where fishermen "
    "and farmers traded grain, salt and wool. Over the centuries the village grew into a "
    "market town, then into a port, and at last into the capital of a large province. "
    "Its old streets still follow the paths of the first traders, and the names of many "
    "squares recall the goods that were once sold there. In the museum near the bridge you "
    "can see maps, coins and tools from every period, and a model of the harbour as it was "
    "two hundred years ago, when ships from distant countries brought tea, silk and spices. "
    "def load(path):\n    with open(path) as f:\n        return [line.strip() for line in f]\n"
    "The weather in spring is mild, with short showers in the afternoon; in summer the days "
    "are long and warm, and people sit outside until late in the evening to talk and eat."
)

STAT_KEYS = ("read_bytes", "hits", "misses", "io_s", "mgmt_s", "stall_s", "spec_bytes")
# llama.cpp's mmap run keeps the file's layout (`repack off`): repacked weights are copied
# into memory (under the cap it would have to hold the whole model); the compute floor
# runs the streamed runs' kernels (`floor_repack`)
RUNS: dict[str, dict[str, Any]] = {
    "mmap": {"moe-stream": False, "repack": "off"},
    "auto": {"moe-stream": True, "cache-mb": "auto", "cache-policy": "lru"},
    # `auto` reading into pages carved from huge pages (kept on with expert slots)
    "auto+huge": {"moe-stream": True, "cache-mb": "auto", "cache-policy": "lru",
                  "huge-pages": True},
    "next-use": {"moe-stream": True, "cache-mb": "auto", "cache-policy": "next-use"},
    "auto+prefetch": {"moe-stream": True, "cache-mb": "auto", "prefetch": 1},
    "auto+prefetch+overlap": {"moe-stream": True, "cache-mb": "auto", "overlap": True},
    # the same, reading the model and permuting MXFP4 experts as they land where a packed
    # experts file (--pack) is beside it: that file's A/B
    "auto+prefetch+overlap-unpacked": {"moe-stream": True, "cache-mb": "auto",
                                       "overlap": True, "packed-experts": False},
    "nocache": {"moe-stream": True, "cache-mb": 0},
}


def packed_bytes(model: Path) -> int:
    from bmoe.engine.experts.layout import read_layout
    return read_layout(model).expert_bytes


def pack(model: Path) -> None:
    """The model's packed experts file (`bmoe-server models pack-experts`), made once and
    kept beside the model; its time printed."""
    from bmoe.engine.experts import packed

    out = packed.packed_path(model)
    if out.exists():
        print(f"packed experts file: {out.name} (kept from an earlier run)", flush=True)
        return
    drop_caches()
    t0 = time.monotonic()
    packed.write(model)
    secs = time.monotonic() - t0
    print(f"packed experts file: {out.name} written in {secs:.1f} s "
          f"({packed_bytes(model) / MIB / secs:.0f} MiB/s of experts, "
          f"{out.stat().st_blocks * 512 / MIB:.0f} MiB on disk)", flush=True)


def floor_repack(model: Path) -> str:
    """The compute floor's `repack` setting: the kernels the streamed runs use. The
    streamer repacks MXFP4 experts (where the kernel choice allows it, `auto`) and keeps
    every other type in the file's layout; a resident load with `repack auto` repacks
    exactly those in an MXFP4_MOE file (its dense weights are Q8_0 / F32, which this
    build repacks on no x86 CPU), and Q4_0 / Q4_K / IQ4_NL dense weights besides, so
    any other file's floor runs with repack off."""
    from bmoe.engine.experts.layout import read_layout
    from bmoe.engine.experts.repack import GGML_TYPE_MXFP4
    lay = read_layout(model)
    mxfp4 = bool(lay.experts) and all(t.ggml_type == GGML_TYPE_MXFP4 for t in lay.experts)
    return "auto" if mxfp4 else "off"


# -- the worker: one configuration in one process ------------------------------------------

class PerfControl:
    """`perf record --control fifo:CTL,ACK`: turn its sampling on and off from the worker."""

    def __init__(self, ctl: str, ack: str) -> None:
        self.ctl = open(ctl, "w")       # noqa: SIM115 - kept open for the run
        self.ack = open(ack)            # noqa: SIM115

    def send(self, command: str) -> None:
        self.ctl.write(command + "\n")
        self.ctl.flush()
        self.ack.readline()             # perf answers "ack" once it has done it


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session

    values = {"temp": 0, "ctx-size": 1024, "threads": spec["threads"], **spec["values"]}
    t0 = time.monotonic()
    s = Session(spec["model"], values, streamer_factory)
    load_s = time.monotonic() - t0
    st: Any = s.streamer
    if st is not None:
        st.record_routing = True
    tokens = s.tokenize(TEXT)[: spec["tokens"]]
    cancel = threading.Event()
    walls: list[float] = []
    deltas: dict[str, list[float]] = {k: [] for k in STAT_KEYS}
    perf = PerfControl(*spec["perf_ctl"]) if spec.get("perf_ctl") else None
    for i in range(1, len(tokens) + 1):
        if perf is not None and i == spec.get("perf_from", 0) + 1:
            perf.send("enable")             # cpu_profile.py: sample the timed tokens only
        before = st.stats() if st is not None else {}
        if st is not None:
            st.token_begin()
        t = time.perf_counter()
        s.prefill(tokens[:i], cancel)      # the KV holds tokens[:i-1]: this decodes one token
        walls.append(time.perf_counter() - t)
        if st is not None:
            st.token_end()
            after = st.stats()
            for k in STAT_KEYS:
                deltas[k].append(after[k] - before[k])
    if perf is not None:
        perf.send("disable")
    out: dict[str, Any] = {"load_s": load_s, "walls": walls, "reads": deltas["read_bytes"],
                           "hits": deltas["hits"], "misses": deltas["misses"],
                           "io": deltas["io_s"], "mgmt": deltas["mgmt_s"],
                           "stall_s": deltas["stall_s"], "spec_bytes": deltas["spec_bytes"],
                           "n_tokens": len(tokens), "pid": os.getpid()}
    if st is not None:
        out["summary"] = st.summary()
        out["load_info"] = st.load_info
        out["budget_bytes"] = st.budget.bytes
        out["unit_bytes"] = st.layout.unit_bytes(0)
        out["routing"] = [r.tolist() for r in st.routing]
        out["dense_bytes"] = st.layout.dense_bytes
    s.close()
    return out


# -- the parent ----------------------------------------------------------------------------

BENCH_DIR = os.path.expanduser("~/.cache/bmoe-bench")   # where the benchmark models go


# Slices of real models: every dimension exact but the layer count (`--layers`, default
# 12), written by the model maker in the model's own layout (qwen3moe; gpt-oss, with its
# biases, attention sinks and sliding-window layers) and quantized by llama.cpp.
# Qwen3 goes through llama.cpp's whole-file quantizer (its Q4_K_M mix: ffn_down in Q6_K on
# some layers); gpt-oss's experts are quantized to MXFP4 by llama.cpp's row quantizer as
# they are written (`expert_dtype`: byte-identical to what the file quantizer writes for
# MXFP4_MOE, without the 38 GiB Q8_0 source a 12-layer slice would need first).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {"embd": 2048, "experts": 128, "top_k": 8, "ff_exp": 768, "n_head": 32,
                      "n_head_kv": 4, "head_dim": 128, "quant": "Q4_K_M", "dtype": "f16"},
    "gpt-oss-120b": {"embd": 2880, "experts": 128, "top_k": 4, "ff_exp": 2880, "n_head": 64,
                     "n_head_kv": 8, "head_dim": 64, "quant": "MXFP4_MOE", "dtype": "q8_0",
                     "expert_dtype": "mxfp4", "arch": "gpt-oss"},
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The benchmark MoE's shape and folder: the flags every bench that uses it takes."""
    p.add_argument("--dir", default=BENCH_DIR, help=f"the models' folder (default {BENCH_DIR})")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="a real model's slice instead of the synthetic MoE (the flags below "
                        "but --layers are then the shape's); quantized as the model is")
    p.add_argument("--layers", type=int, default=None,
                   help="layers (default 24; 12 with --shape)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--ff-exp", type=int, default=512)
    p.add_argument("--dtype", default="f16")
    p.add_argument("--router-skew", type=float, default=1.5)
    p.add_argument("--context-mix", type=float, default=1.5)


def apply_shape(args: argparse.Namespace) -> None:
    """Fill the model flags from --shape (and the layer count's default)."""
    shape = SHAPES.get(getattr(args, "shape", None) or "")
    if args.layers is None:
        args.layers = 12 if shape else 24
    args.quant = shape["quant"] if shape else ""
    args.n_head, args.n_head_kv, args.head_dim = 8, 4, 128
    args.expert_dtype = ""
    args.arch = "qwen3moe"
    if shape:
        for k, v in shape.items():
            if k != "quant":
                setattr(args, k, v)


def make_bench_model(args: argparse.Namespace) -> Path:
    from bmoe.modelmaker import make_model

    apply_shape(args)
    if args.quant:
        return make_shape_model(args)
    path = Path(args.dir) / (f"bench-{args.layers}x{args.experts}-top{args.top_k}-"
                             f"{args.dtype}-e{args.embd}-f{args.ff_exp}.gguf")
    if path.exists() and args.keep:
        print(f"model: reusing {path}", flush=True)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    make_model(path, n_layer=args.layers, n_expert=args.experts, n_expert_used=args.top_k,
               n_embd=args.embd, n_ff_exp=args.ff_exp, n_head=args.n_head,
               n_head_kv=args.n_head_kv, head_dim=args.head_dim,
               dtype=args.dtype, router_skew=args.router_skew, context_mix=args.context_mix,
               seed=7)
    print(f"model: wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return path


def make_shape_model(args: argparse.Namespace) -> Path:
    """A real model's slice: the model maker's file (F16 or Q8_0), then llama.cpp's
    quantizer; the source is deleted once quantized. Prints the time of each step."""
    from bmoe.modelmaker import make_model
    from bmoe.modelmaker.quantize import quantize

    from bmoe.engine.experts.layout import read_layout

    path = Path(args.dir) / f"{args.shape}-{args.layers}L-{args.quant.lower()}.gguf"
    if path.exists() and args.keep:
        if read_layout(path).arch == args.arch:
            print(f"model: reusing {path}", flush=True)
            return path
        print(f"model: {path.name} has another layout than {args.arch}'s: written again",
              flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    shape = dict(arch=args.arch, n_layer=args.layers, n_expert=args.experts,
                 n_expert_used=args.top_k,
                 n_embd=args.embd, n_ff_exp=args.ff_exp, n_ff=args.ff_exp,
                 n_head=args.n_head, n_head_kv=args.n_head_kv, head_dim=args.head_dim,
                 dtype=args.dtype, router_skew=args.router_skew,
                 context_mix=args.context_mix, seed=7)
    if args.expert_dtype:      # quantized as it is written: no source file
        make_model(path, **shape, expert_dtype=args.expert_dtype)
        print(f"model: wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, experts in "
              f"{args.expert_dtype} by llama.cpp's row quantizer) in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        return path
    src = path.with_suffix(f".{args.dtype}.gguf")
    try:
        make_model(src, **shape)
        t1 = time.monotonic()
        print(f"model: wrote {src.name} ({src.stat().st_size / 2**30:.2f} GiB) in "
              f"{t1 - t0:.0f} s", flush=True)
        quantize(src, path, args.quant, threads=os.cpu_count() or 1,
                 requantize=args.dtype != "f16")
    finally:
        src.unlink(missing_ok=True)
    print(f"model: quantized to {args.quant}: {path} ({path.stat().st_size / 2**30:.2f} GiB) "
          f"in {time.monotonic() - t1:.0f} s", flush=True)
    return path


def run_one(name: str, values: dict[str, Any], model: Path, args: argparse.Namespace,
            cap: MemoryCap | None) -> dict[str, Any]:
    spec = {"model": str(model), "values": values, "tokens": args.tokens,
            "threads": args.threads}
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    drop_caches()
    t0 = time.monotonic()
    if cap is None:
        import subprocess
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    else:
        proc = cap.run(cmd, timeout=args.run_timeout)
    if proc.returncode != 0:
        oom = cap.oom_kills() if cap else 0
        raise SystemExit(f"{name}: worker failed (rc {proc.returncode}, oom kills {oom}):\n"
                         f"{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["elapsed_s"] = time.monotonic() - t0
    res["peak_mib"] = cap.peak() / MIB if cap else 0.0
    w = res["walls"][args.warmup:]
    res["median"] = statistics.median(w)
    res["p90"] = float(np.percentile(w, 90))
    rd = res["reads"][args.warmup:]
    res["mib_tok"] = sum(rd) / len(rd) / MIB if rd else 0.0
    if res["io"]:
        res["io_tok"] = statistics.mean(res["io"][args.warmup:])
        res["mgmt_tok"] = statistics.mean(res["mgmt"][args.warmup:])
        res["read_rate"] = sum(rd) / sum(res["io"][args.warmup:]) if sum(rd) else 0.0
    h, m = sum(res["hits"][args.warmup:]), sum(res["misses"][args.warmup:])
    res["hit_pct"] = 100.0 * h / (h + m) if (h + m) and values.get("cache-mb") != 0 else -1.0
    print(f"{name:8s} load {res['load_s']:6.1f} s  median {res['median']:.4f} s/tok  "
          f"p90 {res['p90']:.4f}  read {res['mib_tok']:6.1f} MiB/tok  hits "
          f"{res['hit_pct']:5.1f} %  ({res['elapsed_s']:.0f} s)", flush=True)
    if res.get("summary", {}).get("prefetch"):
        sm = res["summary"]
        n_t = len(res["walls"]) - args.warmup
        res["stall_tok"] = statistics.mean(res["stall_s"][args.warmup:])
        res["spec_mib_tok"] = sum(res["spec_bytes"][args.warmup:]) / n_t / MIB
        res["wasted_mib_tok"] = sm["spec_wasted_mib"] / len(res["walls"])
        print(f"{'':8s} read-ahead: recall {sm['spec_recall_pct']:.1f} %, "
              f"{sm['spec_useful']}/{sm['spec_prefetched']} guessed experts used, "
              f"{res['spec_mib_tok']:.1f} MiB/tok read ahead, ~{res['wasted_mib_tok']:.1f} "
              f"MiB/tok wasted; stall {res['stall_tok']:.4f} s/tok", flush=True)
    if res["io"] and not res.get("summary", {}).get("overlap"):
        rest = statistics.mean(res["walls"][args.warmup:]) - res["io_tok"] - res["mgmt_tok"]
        print(f"{'':8s} per token: read wait {res['io_tok']:.4f} s "
              f"({res['read_rate'] / MIB:.0f} MiB/s), cache management {res['mgmt_tok']:.4f} s, "
              f"the rest (compute and callbacks) {rest:.4f} s", flush=True)
    return res


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=70, help="tokens teacher-forced per run")
    p.add_argument("--mmap-tokens", type=int, default=24,
                   help="tokens of the mmap run (seconds each under the cap)")
    p.add_argument("--depth", type=int, default=2, help="read-ahead depth of the overlap run")
    p.add_argument("--spec-gate", type=float, default=0.0, help="its spec-gate")
    p.add_argument("--warmup", type=int, default=6, help="first tokens not timed")
    p.add_argument("--route-tokens", type=int, default=128,
                   help="tokens of the uncapped run that measures the router's skew")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--cap-frac", type=float, default=0.40, help="memory cap / file size")
    p.add_argument("--ubatch-size", type=int, default=0,
                   help="the context's prompt micro-batch (0: the engine's); a smaller one "
                        "shrinks llama.cpp's compute buffer, which a small slice's cap needs")
    p.add_argument("--cache-floor-mb", type=int, default=128,
                   help="auto cache: memory left under the cap (the engine's default is 1536)")
    p.add_argument("--runs", default="mmap,auto,next-use,auto+prefetch,"
                                      "auto+prefetch+overlap,nocache")
    p.add_argument("--run-timeout", type=float, default=400.0)
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the model file")
    p.add_argument("--pack", action="store_true",
                   help="write the model's packed experts file first (kept beside the "
                        "model; auto+prefetch+overlap-unpacked reads the model without it)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    return bench(args)


def bench(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    print("load average at start: {:.2f} {:.2f} {:.2f} (other work on the machine skews "
          "every figure)".format(*os.getloadavg()), flush=True)
    model = make_bench_model(args)
    if args.pack:
        pack(model)
    cap = None
    try:
        size = model.stat().st_size
        rates = [disk_rate(model, args, "before")]
        results: dict[str, Any] = {}
        results["routing"] = run_uncapped("routing", {"moe-stream": True, "load-all": True},
                                          model, args, args.route_tokens)
        warm_page_cache(model)
        results["compute"] = run_uncapped("compute", {"moe-stream": False,
                                                      "repack": floor_repack(model)},
                                          model, args, args.tokens)
        limit = int(size * args.cap_frac)
        cap = MemoryCap(f"bmoe-bench-{os.getpid()}", limit)
        print(f"cap: {limit / 2**30:.2f} GiB ({args.cap_frac:.0%} of {size / 2**30:.2f} GiB)",
              flush=True)
        extra = {"io-threads": args.io_threads, "cache-floor-mb": args.cache_floor_mb}
        if args.ubatch_size:
            extra.update({"ubatch-size": args.ubatch_size, "batch-size": args.ubatch_size})
        for name in args.runs.split(","):
            values = dict(RUNS[name], **(extra if name != "mmap" else {}))
            if name.startswith("auto+prefetch+overlap"):
                values.update(prefetch=args.depth, **{"spec-gate": args.spec_gate})
            run_args = args if name != "mmap" else argparse.Namespace(
                **{**vars(args), "tokens": args.mmap_tokens})
            results[name] = run_one(name, values, model, run_args, cap)
        rates.append(disk_rate(model, args, "after"))
        serial = next((results[n] for n in ("auto", "auto+huge", "next-use") if n in results),
                      None)
        burst = burst_rate(model, serial, args)
        report(results, max(rates), args, size, limit, burst)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {k: {kk: vv for kk, vv in v.items() if kk != "routing"}
                 for k, v in results.items()} | {"disk_rates": rates}, indent=1))
    finally:
        if cap is not None:
            cap.remove()
        if not args.keep:
            model.unlink(missing_ok=True)
            Path(str(model) + ".bmoe-packed").unlink(missing_ok=True)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


def disk_rate(model: Path, args: argparse.Namespace, when: str) -> float:
    rate = direct_read_rate(model, 1 << 20, 512, args.io_threads)
    print(f"disk ({when}): {rate / MIB:.0f} MiB/s (512 random 1 MiB O_DIRECT reads over "
          f"{args.io_threads} lanes)", flush=True)
    return rate


def burst_rate(model: Path, auto: dict[str, Any] | None,
               args: argparse.Namespace) -> float:
    """The disk's rate in a serial run's pattern (`auto`'s): bursts of as many experts
    as it missed per layer, each waited for (`_common.burst_read_rate`); 0 without one."""
    if auto is None or not auto.get("unit_bytes"):
        return 0.0
    n_layer = max(1, len(auto["routing"][0]) if auto.get("routing") else 1)
    per = max(1, round(auto["mib_tok"] * MIB / auto["unit_bytes"] / n_layer))
    burst, at_once = burst_read_rate(model, per, 400, args.io_threads)
    print(f"disk, a layer's misses at a time ({per} experts of the model, all their slices, "
          f"each burst waited for): {burst / MIB:.0f} MiB/s; the same reads queued at once "
          f"{at_once / MIB:.0f} MiB/s ({burst / at_once:.0%})", flush=True)
    return burst


def run_uncapped(name: str, values: dict[str, Any], model: Path, args: argparse.Namespace,
                 tokens: int) -> dict[str, Any]:
    import subprocess
    spec = {"model": str(model), "values": values, "tokens": tokens, "threads": args.threads}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    w = res["walls"][args.warmup:]
    res["median"] = statistics.median(w)
    res["p90"] = float(np.percentile(w, 90))
    what = ("bmoe, every expert resident" if name == "routing"
            else "llama.cpp, file in the page cache")
    print(f"{name:8s} (no cap, {what}) median {res['median']:.4f} s/tok  p90 {res['p90']:.4f}",
          flush=True)
    return res


def report(results: dict[str, Any], rate: float, args: argparse.Namespace, size: int,
           limit: int, burst: float = 0.0) -> None:
    auto = results.get("auto")
    compute = results["compute"]["median"]
    print()
    routing = np.array(results["routing"]["routing"])
    print(f"routing: top-quarter share {top_quarter_share(routing, args.experts):.1%}, "
          f"consecutive-token overlap {consecutive_overlap(routing):.1%} "
          f"({routing.shape[0]} tokens x {routing.shape[1]} layers, captured by the streamer)")
    floor = floor_ov = 0.0
    if auto is not None:
        trace = np.array(auto["routing"])
        unit = auto["unit_bytes"]
        units = auto["budget_bytes"] // unit
        n = trace.shape[0] - args.warmup
        belady = simulate(trace, units, "belady", args.warmup) * unit / n
        lru = simulate(trace, units, "lru", args.warmup) * unit / n
        floor = belady / rate + compute
        floor_ov = max(belady / rate, compute)
        auto.update(belady_mib=belady / MIB, lru_sim_mib=lru / MIB, floor=floor,
                    floor_overlap=floor_ov)
        print(f"cache: auto {auto['budget_bytes'] / MIB:.0f} MiB = {units} experts of "
              f"{unit / MIB:.1f} MiB; per token an offline optimal cache (Belady) reads "
              f"{belady / MIB:.1f} MiB, LRU (simulated) {lru / MIB:.1f} MiB, the LRU engine "
              f"{auto['mib_tok']:.1f} MiB")
        print(f"floors: serial {belady / MIB:.1f} MiB at {rate / MIB:.0f} MiB/s + compute "
              f"{compute:.4f} s = {floor:.4f} s/tok; overlapped max(read, compute) = "
              f"{floor_ov:.4f} s/tok")
        dense = auto.get("dense_bytes", 0)
        print(f"load target: dense {dense / MIB:.0f} MiB / {rate / MIB:.0f} MiB/s + 1 s = "
              f"{dense / rate + 1:.2f} s (the whole file / rate: {size / rate:.2f} s)")
    print()
    print(f"{'run':22s} {'s/tok med':>9s} {'p90':>7s} {'tok/s':>6s} {'MiB/tok':>7s} "
          f"{'hit %':>5s} {'x mmap':>6s} {'x auto':>6s} {'/floor':>6s} {'/ovfl':>6s} "
          f"{'/own':>5s} {'load s':>6s} {'rd MiB/s':>8s} {'/disk':>5s} {'/burst':>6s}")
    base = results.get("mmap", {}).get("median")
    for name in RUNS:
        r = results.get(name)
        if r is None:
            continue
        xm = f"{base / r['median']:.1f}" if base else "-"
        xa = f"{auto['median'] / r['median']:.2f}" if auto else "-"
        xf = f"{r['median'] / floor:.2f}" if floor else "-"
        xo = f"{r['median'] / floor_ov:.2f}" if floor_ov else "-"
        hit = f"{r['hit_pct']:.1f}" if r["hit_pct"] >= 0 else "-"
        # against its own overlapped floor: its bytes at the disk's rate, or compute
        own = max(r["mib_tok"] * MIB / rate, compute) if name != "mmap" else 0.0
        r["own_floor"] = own
        xw = f"{r['median'] / own:.2f}" if own else "-"
        print(f"{name:22s} {r['median']:9.4f} {r['p90']:7.4f} {1 / r['median']:6.2f} "
              f"{r['mib_tok']:7.1f} {hit:>5s} {xm:>6s} {xa:>6s} {xf:>6s} {xo:>6s} "
              f"{xw:>5s} {r['load_s']:6.1f} {engine_rate(r, rate, burst)}")
    print("(/floor, /ovfl: against the floors above, from Belady's bytes; /own: against the "
          "run's own overlapped floor, max(its MiB/tok at the disk's rate, compute))")
    print(f"(rd MiB/s: the engine's expert bytes / the time it waited for them, runs whose "
          f"reads are not overlapped with compute; /disk: that against the disk's "
          f"{rate / MIB:.0f} MiB/s, {args.io_threads} lanes of 1 MiB O_DIRECT reads; /burst: "
          f"against the disk's own rate for a layer's misses at a time, "
          f"{burst / MIB:.0f} MiB/s)")
    print(f"(cap {limit / 2**30:.2f} GiB on a {size / 2**30:.2f} GiB file; {args.tokens} "
          f"tokens per run ({args.mmap_tokens} for mmap), the first {args.warmup} not timed; "
          f"{args.threads} compute threads, {args.io_threads} read lanes; overlap run: depth "
          f"{args.depth}, spec-gate {args.spec_gate}; compute floor {compute:.4f} s/tok)")


def engine_rate(r: dict[str, Any], disk: float, burst: float = 0.0) -> str:
    """The engine's achieved read rate beside the disk's (and the disk's in bursts of a
    layer's misses), as table cells."""
    rate = r.get("read_rate", 0.0)
    if not rate or r.get("summary", {}).get("overlap"):
        return f"{'-':>8s} {'-':>5s} {'-':>6s}"
    b = f"{rate / burst:6.0%}" if burst else f"{'-':>6s}"
    return f"{rate / MIB:8.0f} {rate / disk:5.0%} {b}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
