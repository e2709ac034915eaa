"""Do reads into contiguous memory pay? `huge-pages` on against off, in the same run.

    sudo .venv/bin/python bench/huge_pages.py            # about 2 minutes here

1. `reads`  — random 1 MiB O_DIRECT reads of the benchmark MoE's expert slices through
              the engine's reader (2 lanes, batches of 8), alternating between a buffer
              whose pages were faulted in one by one and one whose pages came from the
              engine's `PageSupply` (transparent huge pages): MiB/s of each, and the
              physically contiguous runs per read where /proc/self/pagemap shows them.
2. `decode` — the engine streaming the benchmark MoE of bench/plan_accuracy.py with a
              cache of `--cache-mb`, teacher-forcing `--tokens` tokens, `huge-pages` on
              and off in turn (`--runs` each): median s/token once the cache is full,
              and the read rate of its misses.

Needs root for drop_caches and the frame numbers (the rest runs without).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, drop_caches  # noqa: E402


def reads(model: Path, rounds: int) -> None:
    from bmoe.engine.experts.memory import PAGE, AnonBuffer, PageSupply, physical_runs
    from bmoe.engine.experts.reader import ExpertReader, Read
    from bmoe.planner.probes import _slices, model_facts

    layers = _slices(model_facts(model))
    size = layers[0][0][1]
    stride = -(-size // PAGE) * PAGE + PAGE
    supply = PageSupply()
    bufs = {"scattered": AnonBuffer(0, 8 * stride), "huge pages": AnonBuffer(0, 8 * stride)}
    bufs["scattered"].array[::PAGE] = 0
    if not supply.commit(bufs["huge pages"]):
        print("reads: the kernel gives no transparent huge pages here (mode never); skipped")
        return
    reader = ExpertReader(str(model), 2, True)
    rng = random.Random(1)
    spent = dict.fromkeys(bufs, 0.0)
    for _ in range(rounds):
        for name, buf in bufs.items():
            layer = rng.choice(layers)
            batch = []
            for i in range(8):
                off, sz, n = layer[i % len(layer)]
                o = off + rng.randrange(n) * sz
                batch.append(Read(o, sz, buf, i * stride + o % PAGE))
            spent[name] += reader.read_all(batch)[1]
    reader.close()
    base = rounds * 8 * size / MIB / spent["scattered"]
    for name, buf in bufs.items():
        rate = rounds * 8 * size / MIB / spent[name]
        r = [physical_runs(buf.base + i * stride, stride - PAGE) for i in range(8)]
        where = f", {statistics.median(r)} runs per read" if r[0] is not None else ""
        print(f"reads  {name:11s} {rate:6.0f} MiB/s ({rate / base:.2f}x scattered){where}",
              flush=True)
    for b in bufs.values():
        b.close()
    supply.close()


def decode_once(model: Path, huge: bool, args: argparse.Namespace) -> dict[str, Any]:
    from plan_accuracy import TEXT
    from bmoe.engine import params
    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session

    drop_caches()
    values = {**params.defaults(server=True), "temp": 0, "moe-stream": True,
              "cache-mb": args.cache_mb, "threads": 2, "io-threads": 2, "ctx-size": 4096,
              "huge-pages": huge, "cache-fill": False}
    s = Session(model, values, streamer_factory)
    st: Any = s.streamer
    tokens = s.tokenize(TEXT)[: args.tokens]
    cancel = threading.Event()
    walls, start, io0, b0 = [], None, 0.0, 0
    for i in range(1, len(tokens) + 1):
        t = time.perf_counter()
        s.prefill(tokens[:i], cancel)
        walls.append(time.perf_counter() - t)
        now = st.stats()
        if start is None and i >= 4 and now["resident_bytes"] >= 0.95 * now["budget_bytes"]:
            start, io0, b0 = i, now["io_s"], now["read_bytes"]
    now, summary = st.stats(), st.summary()
    s.close()
    start = start or len(walls)
    mib = (now["read_bytes"] - b0) / MIB
    wait = now["io_s"] - io0
    return {"median": statistics.median(walls[start:]), "fill_s": sum(walls[:start]),
            "start": start, "rate": mib / wait if wait else 0.0,
            "huge": summary["huge_pages"], "fresh_mib": now["fresh_bytes"] / MIB}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.expanduser("~/.cache/bmoe-bench"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--cache-mb", type=int, default=165)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=150, help="batches of each kind in `reads`")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    import plan_accuracy
    model = plan_accuracy.make_model(args)
    try:
        reads(model, args.rounds)
        got: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        for _ in range(args.runs):
            for huge in (True, False):
                r = decode_once(model, huge, args)
                got[huge].append(r)
                print(f"decode huge-pages {'on ' if huge else 'off'}: {r['median']:.4f} s/token "
                      f"from token {r['start'] + 1}, misses read at {r['rate']:.0f} MiB/s; "
                      f"the {r['start']} tokens filling the cache took {r['fill_s']:.2f} s "
                      f"(fresh pages from the supply: {r['fresh_mib']:.0f} MiB)", flush=True)
        on = statistics.median(r["median"] for r in got[True])
        off = statistics.median(r["median"] for r in got[False])
        print(f"\ndecode median s/token: on {on:.4f}, off {off:.4f}: {off / on:.2f}x the speed "
              f"with huge pages; read rate {statistics.median(r['rate'] for r in got[True]):.0f}"
              f" vs {statistics.median(r['rate'] for r in got[False]):.0f} MiB/s")
    finally:
        if not args.keep:
            model.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
