"""What the expert streamer's graph callback costs per token: the Python one against the
native one (bmoe/native/evalcb.c), on the benchmark MoE of stream_vs_mmap.py.

    .venv/bin/python bench/evalcb_cost.py --dir DIR [--keep] [--tokens 64] [--threads 1]

Writes (or with --keep reuses) stream_vs_mmap.py's benchmark model in DIR (qwen3moe 24
layers x 64 experts, top-4, F16, 4.65 GiB), then teacher-forces the same English text
token by token in two sessions, one after the other, in this process:

  off       llama.cpp on mmap, no streamer and no callback, the file in the page cache
  streamed  bmoe streaming with every expert read at load (`load-all`: no reads while
            decoding, so the difference is the callback), cycling token by token through
            `native` (the C callback; every expert resident, so the routings are counted
            in C), `python` (the C side forwards every node to the streamer's Python
            callback `_eval`: the Python path plus one C call) and `native+route` (the C
            callback calling Python once per MoE layer, as when experts stream), so all
            three see the same machine load and KV length

The first --warmup tokens of each session are not timed. It prints each mode's median
s/token against `off`, the paired differences python - native and native+route - native
(medians over adjacent triples), and the nodes per token the callback was asked about and the
calls into Python the native one made. Needs about 10 GiB of memory: the page cache of
the file, then 4.5 GiB of experts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stream_vs_mmap import TEXT, make_bench_model, warm_page_cache  # noqa: E402


MODES = ("native", "python", "native+route")


def teacher_force(s: Any, tokens: list[int], before: Any = None) -> list[float]:
    """One decode per token (the KV holds tokens[:i-1]); `before(i)` runs before each."""
    cancel = threading.Event()
    walls = []
    for i in range(1, len(tokens) + 1):
        if before is not None:
            before(i)
        t = time.perf_counter()
        s.prefill(tokens[:i], cancel)
        walls.append(time.perf_counter() - t)
    return walls


def run_off(model: Path, tokens: list[int], args: argparse.Namespace) -> list[float]:
    from bmoe.engine.session import Session

    warm_page_cache(model)
    s = Session(model, {"temp": 0, "ctx-size": 1024, "threads": args.threads})
    try:
        return teacher_force(s, tokens)
    finally:
        s.close()


def run_streamed(model: Path, tokens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from bmoe.engine.experts import ExpertStreamer, streamer_factory
    from bmoe.engine.session import Session

    values = {"temp": 0, "ctx-size": 1024, "threads": args.threads, "moe-stream": True,
              "load-all": True, "io-threads": 4}
    t0 = time.monotonic()
    s = Session(model, values, streamer_factory)
    load_s = time.monotonic() - t0
    st = s.streamer
    try:
        assert isinstance(st, ExpertStreamer)
        if st.native is None:
            raise SystemExit(f"the native callback is not running: {st.load_info}")
        native = st.native
        modes: list[str] = []
        counts: list[dict[str, Any]] = []

        def before(i: int) -> None:
            counts.append(native.stats())
            mode = MODES[i % len(MODES)]
            native.forward(st._cb if mode == "python" else None)
            # a routing record keeps every layer's routing going to Python
            st.record_routing = mode == "native+route"
            if mode == "native" and not st._native_resident:
                st._enter_resident()
            modes.append(mode)

        walls = teacher_force(s, tokens, before)
        counts.append(native.stats())
        native.forward(None)
        asks = [b["asks"] - a["asks"] for a, b in itertools.pairwise(counts)]
        routes = [b["route_calls"] - a["route_calls"] for a, b in itertools.pairwise(counts)]
        return {"load_s": load_s, "walls": walls, "modes": modes, "asks": asks,
                "routes": routes, "load_info": st.load_info}
    finally:
        s.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.path.expanduser("~/.cache/bmoe-bench"))
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the model file")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64, help="tokens teacher-forced per session")
    p.add_argument("--warmup", type=int, default=4, help="first tokens not timed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    # stream_vs_mmap's model, same shape and seed
    args.experts, args.top_k, args.embd, args.ff_exp, args.dtype = 64, 4, 1024, 512, "f16"
    args.router_skew, args.context_mix = 1.5, 1.5
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    model = make_bench_model(args)
    from bmoe.engine.session import Session
    probe = Session(model, {"ctx-size": 256, "threads": 1})
    tokens = probe.tokenize(TEXT)[: args.tokens]
    probe.close()

    off = run_off(model, tokens, args)[args.warmup:]
    res = run_streamed(model, tokens, args)
    w = args.warmup
    walls, modes = res["walls"][w:], res["modes"][w:]
    by = {m: [t for t, mm in zip(walls, modes, strict=True) if mm == m] for m in MODES}
    # adjacent triples (each mode once) give paired differences
    triples = [dict(zip(modes[i:i + 3], walls[i:i + 3], strict=True))
               for i in range(0, len(walls) - 2, 3)]
    triples = [t for t in triples if len(t) == 3]
    pairs = [t["python"] - t["native"] for t in triples]
    route_pairs = [t["native+route"] - t["native"] for t in triples]
    asks = [a for a, m in zip(res["asks"][w:], modes, strict=True) if m == "native"]
    routes = {m: statistics.median([r for r, mm in zip(res["routes"][w:], modes, strict=True)
                                    if mm == m]) for m in ("native", "native+route")}
    m_off = statistics.median(off)
    m_nat, m_py, m_rt = (statistics.median(by[m]) for m in MODES)
    print(f"model: {model.name}; {len(tokens)} tokens per session, the first {w} not timed; "
          f"{args.threads} compute thread(s); streamed load (load-all) {res['load_s']:.1f} s")
    print(f"nodes per token asked about: {statistics.median(asks):.0f}; calls into Python "
          f"per token: native {routes['native']:.0f} (routings counted in C), "
          f"native+route {routes['native+route']:.0f} (one per MoE layer)")
    print(f"off           (no streamer, no callback)  median {m_off:.4f} s/tok  "
          f"({len(off)} tokens)")
    for name, med in (("native", m_nat), ("python", m_py), ("native+route", m_rt)):
        print(f"{name:13s} (streamed, experts in)     median {med:.4f} s/tok  "
              f"({len(by[name])} tokens)  {1000 * (med - m_off):+.1f} ms vs off")

    def q(v: list[float]) -> str:
        qs = statistics.quantiles(v, n=4)
        return (f"median {1000 * statistics.median(v):.2f} ms/token (quartiles "
                f"{1000 * qs[0]:.2f} .. {1000 * qs[2]:.2f}) over {len(v)} triples")

    print(f"paired python - native:       {q(pairs)}")
    print(f"paired native+route - native: {q(route_pairs)}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"total {time.monotonic() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"off": off, **res}, indent=1))
    if not args.keep:
        model.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
