"""Replacement policies of the expert cache against the offline optimum, on recorded routing.

    python bench/cache_policies.py                  # about a minute, no model needed
    python bench/cache_policies.py --capture MODEL.gguf --out routing.npy

A trace is the routing the streamer captures (`ExpertStreamer.record_routing`): for every
single-token decode, [layers, k] expert ids. `--capture` teacher-forces the benchmark's
text through a model with every expert resident (`load-all`) and saves it. The default
trace, `bench/routing-bench.npy`, is that capture on `stream_vs_mmap.py`'s benchmark MoE
(24 layers x 64 experts, top-4, router skew 1.5, context mix 1.5; 436 tokens).

Every policy runs the engine's own `ExpertCache` (same admissions, same victims, a layer's
routed set never split) over the trace, at the cache sizes asked (in units, a unit is one
expert of one layer); Belady (offline optimal: evict the unit used again furthest in the
future) is `_common.simulate`. Units read are counted from token `--warmup` on (the
cache starts cold), and printed as units per token, MiB per token and x Belady.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import simulate  # noqa: E402

from bmoe.engine.experts.cache import ExpertCache  # noqa: E402

# (label, policy, decay)
CANDIDATES = (
    ("LRU (the engine before)", "lru", 0.0),
    ("LFU, decay 0.05", "lfu", 0.05),
    ("LFU, decay 0.2", "lfu", 0.2),
    ("next-use, decay 0.05", "next-use", 0.05),
    ("next-use, decay 0.1", "next-use", 0.1),
    ("next-use, decay 0.2 (default)", "next-use", 0.2),
    ("next-use, decay 0.4", "next-use", 0.4),
)


def run_policy(trace: np.ndarray, capacity: int, policy: str, decay: float,
               count_from: int) -> int:
    """Units the engine's cache reads from token `count_from` on."""
    n_tok, n_layer, _ = trace.shape
    n_expert = int(trace.max()) + 1
    cache = ExpertCache(np.ones(n_layer, dtype=np.int64), n_expert, capacity, policy, decay)
    reads = 0
    for t in range(n_tok):
        for layer in range(n_layer):
            adm = cache.admit(layer, np.unique(trace[t, layer]))
            if t >= count_from:
                reads += len(adm.misses)
    return reads


def table(trace: np.ndarray, capacities: list[int], warmup: int, unit_mib: float) -> str:
    n = trace.shape[0] - warmup
    lines = [f"trace: {trace.shape[0]} tokens x {trace.shape[1]} layers, top-{trace.shape[2]};"
             f" counted from token {warmup}; unit {unit_mib:g} MiB"]
    head = "| policy | " + " | ".join(f"{c} units: MiB/tok (x Belady)" for c in capacities)
    lines += [head + " |", "|---" * (len(capacities) + 1) + "|"]
    belady = {c: simulate(trace, c, "belady", warmup) for c in capacities}
    rows = [("Belady (offline optimum)", belady)]
    for label, policy, decay in CANDIDATES:
        rows.append((label, {c: run_policy(trace, c, policy, decay, warmup)
                             for c in capacities}))
    for label, reads in rows:
        cells = [f"{reads[c] / n * unit_mib:.1f} ({reads[c] / max(1, belady[c]):.2f})"
                 for c in capacities]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capture(model: Path, out: Path, threads: int) -> None:
    import threading

    from stream_vs_mmap import TEXT

    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session

    s = Session(model, {"temp": 0, "ctx-size": 1024, "threads": threads, "moe-stream": True,
                        "load-all": True}, streamer_factory)
    try:
        st = s.streamer
        assert st is not None
        st.record_routing = True
        tokens = s.tokenize(TEXT)
        for i in range(1, len(tokens) + 1):
            st.token_begin()
            s.prefill(tokens[:i], threading.Event())
            st.token_end()
        np.save(out, np.array(st.routing))
    finally:
        s.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(Path(__file__).with_name("routing-bench.npy")),
                   help="routing .npy ([tokens, layers, k])")
    p.add_argument("--capture", help="a model to capture a trace from (then --out)")
    p.add_argument("--out", default="routing.npy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--capacity", default="256,508,768", help="cache sizes in units")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--unit-mib", type=float, default=3.0, help="bytes of one unit, for MiB")
    args = p.parse_args(argv)
    if args.capture:
        capture(Path(args.capture), Path(args.out), args.threads)
        return 0
    trace = np.load(args.trace)
    caps = [int(c) for c in args.capacity.split(",")]
    print(table(trace, caps, args.warmup, args.unit_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
