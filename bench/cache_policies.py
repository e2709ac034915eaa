"""Replacement policies of the expert cache against the offline optimum, on recorded routing.

    python bench/cache_policies.py                  # about 2 minutes, no model needed
    python bench/cache_policies.py --trace bench/routing-small-s2-c0.npy --capacity 128,254,384
    python bench/cache_policies.py --capture MODEL.gguf --out routing.npy
    python bench/cache_policies.py --capture-small 2,0 --out bench/routing-small-s2-c0.npy
    python bench/cache_policies.py --engine-small 1,1.5 --cache-mb 24 --tokens 200

A trace is the routing the streamer captures (`ExpertStreamer.record_routing`): for every
single-token decode, [layers, k] expert ids. `--capture` teacher-forces the benchmark's
text through a model with every expert resident (`load-all`) and saves it. The default
trace, `bench/routing-bench.npy`, is that capture on `stream_vs_mmap.py`'s benchmark MoE
(24 layers x 64 experts, top-4, router skew 1.5, context mix 1.5; 436 tokens).
`--capture-small SKEW,MIX` makes a small MoE (12 layers x 64, top-4) of another router
skew and context mix with `bmoe.modelmaker` and captures it (20 s): the other routing
structures, `bench/routing-small-s1-c1.5.npy` (less skew, local context),
`routing-small-s2-c0.npy` (strong skew, no context: popularity without recency) and
`routing-small-s0-c0.npy` (a plain random router: near uniform).
`--engine-small SKEW,MIX` runs the real streamer instead of the simulator on such a
model, once per engine policy, and prints the MiB each session read.

The engine's policies (`cache-policy`: lru, lfu, next-use, reuse) run the engine's own
`ExpertCache` (same admissions, same victims, a layer's routed set never split) over the
trace, at the cache sizes asked (in units, a unit is one expert of one layer); so do
LRU-2, per-layer budgets and admission control (subclasses here). ARC is a reference
outside the engine. Belady (offline optimal: evict the unit used again furthest in the
future) is `_common.simulate`. Bounds that know part of the future show what any online
policy could still gain: `reuse` plus an oracle of the current token's next layers (a
perfect read-ahead guess), of the next token, of the next 4 and 16 tokens; and the best
fixed set in hindsight. Units read are counted from token `--warmup` on (the cache starts
cold), printed as MiB per token and x Belady measured in the same run, after the trace's
skew and reuse against uniform routing; last, each engine policy's time per admit.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import simulate, top_quarter_share  # noqa: E402

from bmoe.engine.experts.cache import Admission, ExpertCache  # noqa: E402

# (label, policy, decay): the engine's own policies
CANDIDATES = (
    ("LRU (issue 7)", "lru", 0.0),
    ("LFU, decay 0.05 / token", "lfu", 0.05),
    ("LFU, decay 0.2", "lfu", 0.2),
    ("LFU, decay 0.002 (a long window)", "lfu", 0.002),
    ("next-use, decay 0.05", "next-use", 0.05),
    ("next-use, decay 0.2 (issue 16's default)", "next-use", 0.2),
    ("**reuse (the default)**", "reuse", 0.0),
)


class _Trace:
    """A trace as the cache sees it: each (token, layer)'s routed set, and when each unit
    is used next (for the bounds that know the future)."""

    def __init__(self, trace: np.ndarray) -> None:
        self.trace = trace
        self.n_tok, self.n_layer, self.k = trace.shape
        self.n_expert = int(trace.max()) + 1
        self.sets = [[np.unique(trace[t, layer]) for layer in range(self.n_layer)]
                     for t in range(self.n_tok)]
        used = np.zeros((self.n_tok + 1, self.n_layer, self.n_expert), dtype=bool)
        for t in range(self.n_tok):
            for layer in range(self.n_layer):
                used[t, layer, self.sets[t][layer]] = True
        nxt = np.full((self.n_tok + 1, self.n_layer, self.n_expert), 1 << 40, dtype=np.int64)
        for t in range(self.n_tok - 1, -1, -1):
            nxt[t] = np.where(used[t], t, nxt[t + 1])
        self.used = used
        self.next_token = nxt         # [t, layer, e]: the first token >= t that routes it


class LookaheadCache(ExpertCache):
    """`reuse`, plus an oracle: the units routed within the next `tokens` tokens (counting
    the current token's remaining layers) are kept, the nearest longest. tokens=0 knows
    only the current token's remaining layers: the most any guess of the next layers from
    the current hidden state (the read-ahead predictor) could tell the cache."""

    def __init__(self, tr: _Trace, budget: int, tokens: int) -> None:
        super().__init__(np.ones(tr.n_layer, dtype=np.int64), tr.n_expert, budget, "reuse")
        self.tr = tr
        self.tokens = tokens
        self.t = 0

    def _keep_score(self) -> np.ndarray:
        base = super()._keep_score()
        n = self.n_layer
        layers = np.arange(n)[:, None]
        start = np.where(layers > self.last_layer, self.t, self.t + 1)
        when = self.tr.next_token[np.minimum(start, self.tr.n_tok), layers,
                                  np.arange(self.n_expert)[None, :]]
        steps = (when - self.t) * n + layers - self.last_layer        # layers from now
        horizon = max(1, self.tokens) * n if self.tokens else n - self.last_layer
        known = (steps <= horizon).ravel()
        return np.where(known, 2.0 - steps.ravel() / (horizon + 1), base)


class BypassCache(ExpertCache):
    """`reuse` with admission control: a missed unit less likely to be reused than every
    evictable resident one is read into a scratch slot and not kept. The scratch (one
    layer's k units) is taken from the budget, so the memory is the same."""

    def _take(self, layer: int, misses: np.ndarray, adm: Admission, protect_from: int,
              ok: np.ndarray | None = None) -> None:
        self.resident[layer, misses] = True
        self.loaded[layer, misses] = True
        self.resident_bytes += len(misses)
        over = self.resident_bytes - self.budget
        if over <= 0:
            return
        ok = self._evictable(protect_from)
        ok[layer * self.n_expert + misses] = True          # the new ones may give way too
        score = np.where(ok, self._keep_score(), np.inf)
        chosen = np.argpartition(score, over - 1)[:over]
        self.resident.ravel()[chosen] = False
        self.resident_bytes -= len(chosen)
        adm.victims = [divmod(int(i), self.n_expert) for i in chosen]


class Lru2Cache(ExpertCache):
    """LRU-2 (O'Neil et al. 1993): evicts the unit whose second most recent use is oldest
    (units used once first, by their last use)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.stamp2 = np.zeros_like(self.stamp)

    def admit(self, layer: int, ids: np.ndarray) -> Admission:
        ids = np.asarray(ids, dtype=np.int64)
        self.stamp2[layer, ids] = self.stamp[layer, ids]
        return super().admit(layer, ids)

    def _keep_score(self) -> np.ndarray:
        return (self.stamp2 * 1e6 + self.stamp).ravel().astype(np.float64)


def run_cache(tr: _Trace, cache: ExpertCache, count_from: int,
              per_layer: int = 0) -> tuple[int, float]:
    """Units `cache` reads from token `count_from` on, and its seconds per admit.
    per_layer > 0: each layer holds at most that many units, evicting only its own."""
    reads = 0
    t0 = time.perf_counter()
    for t in range(tr.n_tok):
        if isinstance(cache, LookaheadCache):
            cache.t = t
        for layer in range(tr.n_layer):
            if per_layer:
                cache.budget = (int(cache.resident.sum()) - int(cache.resident[layer].sum())
                                + per_layer)
                cache.stamp[:layer] += 1 << 40          # other layers: not evictable now
                cache.stamp[layer + 1:] += 1 << 40
            adm = cache.admit(layer, tr.sets[t][layer])
            if per_layer:
                cache.stamp[:layer] -= 1 << 40
                cache.stamp[layer + 1:] -= 1 << 40
            if t >= count_from:
                reads += len(adm.misses)
    return reads, (time.perf_counter() - t0) / (tr.n_tok * tr.n_layer)


def run_policy(trace: np.ndarray, capacity: int, policy: str, decay: float,
               count_from: int) -> int:
    """Units the engine's cache reads from token `count_from` on."""
    tr = _Trace(trace)
    unit = np.ones(tr.n_layer, dtype=np.int64)
    return run_cache(tr, ExpertCache(unit, tr.n_expert, capacity, policy, decay),
                     count_from)[0]


def arc(tr: _Trace, capacity: int, count_from: int) -> int:
    """ARC (Megiddo and Modha, FAST 2003) over the units in routing order; a reference
    outside the engine (a layer's set may be split, which can only help it)."""
    t1: OrderedDict[tuple[int, int], None] = OrderedDict()
    t2: OrderedDict[tuple[int, int], None] = OrderedDict()
    b1: OrderedDict[tuple[int, int], None] = OrderedDict()
    b2: OrderedDict[tuple[int, int], None] = OrderedDict()
    p, reads, c = 0, 0, capacity

    def replace(in_b2: bool) -> None:
        if t1 and ((in_b2 and len(t1) == p) or len(t1) > p):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for t in range(tr.n_tok):
        for layer in range(tr.n_layer):
            for e in tr.sets[t][layer].tolist():
                x = (layer, e)
                if x in t1:
                    del t1[x]
                    t2[x] = None
                    continue
                if x in t2:
                    t2.move_to_end(x)
                    continue
                reads += t >= count_from
                if x in b1:
                    p = min(c, p + max(len(b2) // max(len(b1), 1), 1))
                    replace(False)
                    del b1[x]
                    t2[x] = None
                elif x in b2:
                    p = max(0, p - max(len(b1) // max(len(b2), 1), 1))
                    replace(True)
                    del b2[x]
                    t2[x] = None
                else:
                    if len(t1) + len(b1) == c:
                        if len(t1) < c:
                            b1.popitem(last=False)
                            replace(False)
                        else:
                            t1.popitem(last=False)
                    elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                        if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                            b2.popitem(last=False)
                        replace(False)
                    t1[x] = None
    return reads


def best_fixed_set(tr: _Trace, capacity: int, count_from: int) -> int:
    """The offline best cache that never changes: the `capacity` units routed most often
    from `count_from` on, every other routing a read (its initial reads not counted)."""
    counts = tr.used[count_from:tr.n_tok].sum(axis=0).ravel()
    return int(np.sort(counts)[::-1][capacity:].sum())


def trace_stats(tr: _Trace, count_from: int) -> list[str]:
    """How far the routing is from uniform: skew, and reuse by distance in tokens."""
    used = tr.used[:tr.n_tok]
    uniform = tr.k / tr.n_expert
    reuse = []
    for d in (1, 2, 4, 8):
        both = (used[d:] & used[:-d]).sum()
        reuse.append(f"{d}: {both / used[:-d].sum():.2f}")
    return [f"routing: top quarter of a layer's experts takes "
            f"{top_quarter_share(tr.trace, tr.n_expert):.2f} of its routings (uniform: 0.25);"
            f" P(unit routed again d tokens later) {', '.join(reuse)} (uniform: "
            f"{uniform:.2f})"]


def bench_rows(tr: _Trace, capacities: list[int], warmup: int
               ) -> list[tuple[str, dict[int, int]]]:
    unit = np.ones(tr.n_layer, dtype=np.int64)
    rows: list[tuple[str, dict[int, int]]] = []

    def engine(label: str, make: Callable[[int], ExpertCache], per_layer: bool = False
               ) -> None:
        rows.append((label, {c: run_cache(tr, make(c), warmup,
                                          c // tr.n_layer if per_layer else 0)[0]
                             for c in capacities}))

    rows.append(("Belady (offline optimum)",
                 {c: simulate(tr.trace, c, "belady", warmup) for c in capacities}))
    for label, policy, decay in CANDIDATES:
        engine(label, lambda c, p=policy, d=decay: ExpertCache(unit, tr.n_expert, c, p, d))
    engine("LRU-2", lambda c: Lru2Cache(unit, tr.n_expert, c, "lru"))
    rows.append(("ARC (reference, outside the engine)",
                 {c: arc(tr, c, warmup) for c in capacities}))
    engine(f"reuse, per-layer budgets (each layer 1/{tr.n_layer} of the cache)",
           lambda c: ExpertCache(unit, tr.n_expert, c, "reuse"), per_layer=True)
    engine("reuse + admission control (k-unit scratch from the budget)",
           lambda c: BypassCache(unit, tr.n_expert, c - tr.k, "reuse"))
    rows.append(("best fixed set (offline: the most routed units, never changed)",
                 {c: best_fixed_set(tr, c, warmup) for c in capacities}))
    for n, what in ((0, "the current token's next layers (a perfect read-ahead guess)"),
                    (1, "the next token"), (4, "the next 4 tokens"),
                    (16, "the next 16 tokens")):
        engine(f"bound: reuse + an oracle of {what}",
               lambda c, n=n: LookaheadCache(tr, c, n))
    return rows


def table(trace: np.ndarray, capacities: list[int], warmup: int, unit_mib: float) -> str:
    tr = _Trace(trace)
    n = tr.n_tok - warmup
    lines = [f"trace: {tr.n_tok} tokens x {tr.n_layer} layers, top-{tr.k} of {tr.n_expert};"
             f" counted from token {warmup}; unit {unit_mib:g} MiB"]
    lines += trace_stats(tr, warmup)
    head = "| policy | " + " | ".join(f"{c} units: MiB/tok (x Belady)" for c in capacities)
    lines += [head + " |", "|---" * (len(capacities) + 1) + "|"]
    rows = bench_rows(tr, capacities, warmup)
    belady = rows[0][1]
    for label, reads in rows:
        cells = [f"{reads[c] / n * unit_mib:.1f} ({reads[c] / max(1, belady[c]):.2f})"
                 for c in capacities]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost(trace: np.ndarray, capacity: int, repeats: int) -> str:
    """The engine cache's time per admit (its bookkeeping and victim choice) for each
    policy, the runs alternated and the least of `repeats` kept (the CPU is shared)."""
    tr = _Trace(trace)
    unit = np.ones(tr.n_layer, dtype=np.int64)
    policies = ("lru", "next-use", "reuse")
    best = dict.fromkeys(policies, float("inf"))
    for _ in range(repeats):
        for policy in policies:
            cache = ExpertCache(unit, tr.n_expert, capacity, policy)
            best[policy] = min(best[policy], run_cache(tr, cache, 0)[1])
    return (f"time per admit at {capacity} units (least of {repeats} alternated runs): "
            + ", ".join(f"{p} {best[p] * 1e6:.0f} µs" for p in policies))


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
        routing = np.array(st.routing)
        np.save(out, routing.astype(np.uint8) if routing.max() < 256 else routing)
    finally:
        s.close()


def engine_reads(model: Path, cache_mb: int, n_tokens: int, threads: int) -> str:
    """The real streamer, not the simulator: the benchmark text teacher-forced through
    `model` from a cold cache of `cache_mb` MiB, no read-ahead, once per engine policy;
    the MiB the session read and its hit rate."""
    import threading

    from stream_vs_mmap import TEXT

    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session

    lines = [f"engine: {model.name}, cache-mb {cache_mb}, {n_tokens} tokens from a cold cache"]
    for policy in ("lru", "next-use", "reuse"):
        s = Session(model, {"temp": 0, "ctx-size": 1024, "threads": threads,
                            "moe-stream": True, "cache-mb": cache_mb, "cache-policy": policy,
                            "prefetch": 0}, streamer_factory)
        try:
            st = s.streamer
            assert st is not None
            tokens = s.tokenize(TEXT)[:n_tokens]
            for i in range(1, len(tokens) + 1):
                st.token_begin()
                s.prefill(tokens[:i], threading.Event())
                st.token_end()
            sm = st.summary()
            lines.append(f"  {policy:9} read {sm['session_read_mib']:8.1f} MiB  hits "
                         f"{sm['cache_hit_pct']:5.1f} %  evictions {sm['cache_evictions']}")
        finally:
            s.close()
    return "\n".join(lines)


def make_small(skew_mix: str, directory: Path) -> Path:
    """A small MoE (12 layers x 64 experts, top-4, n_embd 256) of the given router skew and
    context mix (`bmoe.modelmaker`), for traces of other routing structures."""
    from bmoe.modelmaker import make_model

    skew, mix = (float(x) for x in skew_mix.split(","))
    return make_model(directory / f"small-s{skew:g}-c{mix:g}.gguf", n_layer=12, n_expert=64,
                      n_expert_used=4, n_embd=256, n_ff_exp=64, n_head=4, n_head_kv=2,
                      head_dim=64, dtype="f16", router_skew=skew, context_mix=mix, seed=7)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(Path(__file__).with_name("routing-bench.npy")),
                   help="routing .npy ([tokens, layers, k])")
    p.add_argument("--capture", help="a model to capture a trace from (then --out)")
    p.add_argument("--capture-small", metavar="SKEW,MIX",
                   help="make the small MoE of this router skew and context mix, capture")
    p.add_argument("--out", default="routing.npy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--capacity", default="256,508,768", help="cache sizes in units")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--unit-mib", type=float, default=3.0, help="bytes of one unit, for MiB")
    p.add_argument("--repeats", type=int, default=5, help="runs per policy for the cost")
    p.add_argument("--engine-small", metavar="SKEW,MIX",
                   help="run the real streamer on that small MoE instead (--cache-mb, --tokens)")
    p.add_argument("--cache-mb", type=int, default=24)
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args(argv)
    if args.engine_small:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            print(engine_reads(make_small(args.engine_small, Path(d)), args.cache_mb,
                               args.tokens, args.threads))
        return 0
    if args.capture_small:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            capture(make_small(args.capture_small, Path(d)), Path(args.out), args.threads)
        return 0
    if args.capture:
        capture(Path(args.capture), Path(args.out), args.threads)
        return 0
    trace = np.load(args.trace)
    caps = [int(c) for c in args.capacity.split(",")]
    print(table(trace, caps, args.warmup, args.unit_mib))
    print(cost(trace, caps[len(caps) // 2], args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
