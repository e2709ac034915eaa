"""What the expert cache's bookkeeping costs per token, by policy and model shape.

    python bench/cache_cost.py                 # about a minute, no model needed
    python bench/cache_cost.py --layers 12,36,48 --experts 128 --top-k 4,8 --cache-frac 0.4

The streamed decode asks the cache once per MoE layer per token (`admit`: hits, misses
and victims) and, with read-ahead at depth 2, twice more (`admit_spec` for the next two
layers' guessed experts). That is Python on the engine thread while llama.cpp waits, so
it counts against every token. This runs the engine's own `ExpertCache` over synthetic
routing (a Zipf-skewed choice of experts per layer, the read-ahead's guesses drawn at
random so that they often miss and evict), after a warm-up that fills the cache, and
prints the best of 4 timed passes in ms per token for each policy. The baseline, measured
in the same run, is the default policy (`reuse`) with its bookkeeping in numpy (`numpy
pick`: the victims by a mask, a partition and a sort over the evictable units, `reuse`'s
learning and scoring by a dozen numpy calls per admit, as the cache did before
`bmoe.native.cachepick`); the other rows run those parts in C. `reuse, C parts` calls
them one by one from Python; `reuse` makes each admission one C call (`cachepick.Book`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bmoe.engine.experts.cache import ExpertCache, native_pick  # noqa: E402

UNIT = 1 << 20
PASSES = 4


class NumpyPick(ExpertCache):
    """The cache's bookkeeping all in numpy (what `BMOE_CACHE_PICK=python` does)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._pick = None
        self._book = None


class CParts(ExpertCache):
    """`reuse`'s parts in C, called one by one from Python (no `cachepick.Book`): the
    cache as it was before an admission became one C call."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._book = None


def routing(n_layer: int, n_expert: int, k: int, tokens: int, seed: int
            ) -> list[list[tuple[np.ndarray, list[np.ndarray]]]]:
    """Per token and layer: the routed experts and the guesses for the next two layers."""
    rng = np.random.default_rng(seed)
    perm = [rng.permutation(n_expert) for _ in range(n_layer)]   # each layer its favourites
    out = []
    for _ in range(tokens):
        row = []
        for layer in range(n_layer):
            ids = np.unique(perm[layer][(rng.zipf(1.3, 4 * k) - 1) % n_expert])[:k]
            guesses = [np.unique(rng.integers(0, n_expert, k)) for _ in range(2)]
            row.append((ids, guesses))
        out.append(row)
    return out


def per_token(make: type[ExpertCache], policy: str, trace: list, n_layer: int,
              n_expert: int, frac: float, warm: int) -> tuple[float, int]:
    cache = make(np.full(n_layer, UNIT), n_expert, budget=int(n_layer * n_expert * frac) * UNIT,
                 policy=policy)

    def run(tokens: list) -> None:
        for tok in tokens:
            for layer, (ids, guesses) in enumerate(tok):
                cache.admit(layer, ids)
                for j, guess in zip((layer + 1, layer + 2), guesses, strict=True):
                    if j < n_layer:
                        cache.admit_spec(j, guess)

    run(trace[:warm])
    n = (len(trace) - warm) // PASSES
    best = float("inf")
    for p in range(PASSES):
        t0 = time.perf_counter()
        run(trace[warm + p * n: warm + (p + 1) * n])
        best = min(best, (time.perf_counter() - t0) / n)
    return best, cache.evictions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="12,36,48", help="MoE layers, comma-separated")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", default="4,8", help="experts per token, comma-separated")
    ap.add_argument("--cache-frac", type=float, default=0.4,
                    help="the share of all experts the cache holds")
    ap.add_argument("--tokens", type=int, default=400, help="timed tokens (after 200 warm-up)")
    args = ap.parse_args(argv)
    if native_pick() is None:
        raise SystemExit("the extension bmoe.native.cachepick is not built "
                         "(pip install -e . builds it)")
    variants = [("reuse, numpy pick", NumpyPick, "reuse"), ("lru, numpy pick", NumpyPick, "lru"),
                ("lru", ExpertCache, "lru"), ("next-use", ExpertCache, "next-use"),
                ("reuse, C parts", CParts, "reuse"), ("reuse", ExpertCache, "reuse")]
    print(f"{'shape':28s} {'policy':20s} {'ms/token':>8s} {'x base':>6s} {'evictions':>9s}")
    for n_layer in (int(x) for x in args.layers.split(",")):
        for k in (int(x) for x in args.top_k.split(",")):
            trace = routing(n_layer, args.experts, k, 200 + args.tokens, seed=n_layer * 100 + k)
            shape = f"{n_layer} x {args.experts}, top-{k}, {args.cache_frac:.0%}"
            base = None
            for name, make, policy in variants:
                t, ev = per_token(make, policy, trace, n_layer, args.experts,
                                  args.cache_frac, 200)
                base = base or t
                print(f"{shape:28s} {name:20s} {t * 1e3:8.2f} {t / base:6.2f} {ev:9d}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
