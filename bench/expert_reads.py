"""The engine's expert reads against the disk's, on the same slices, in one run.

    sudo .venv/bin/python bench/expert_reads.py [--model FILE] [--lanes 4] [--tokens 60]

Replays a routing trace (default: bench/routing-bench.npy, captured from the benchmark MoE
of `stream_vs_mmap.py`) through the engine's own read path with no llama.cpp in it: an
`ExpertStreamer` with its buffers, its LRU cache of `--cache-mb` and its reader, whose
`ensure(layer, ids)` is what the graph callback calls per layer. Every read the engine
issues is recorded (file extent, widened to pages as O_DIRECT reads it), and the same
extents are then read the way the disk bench reads (`_common.direct_read_rate`): one
stream over the lanes into buffers committed beforehand, so

  engine       what `ensure` waits for, per layer (its `io_s`), bytes / seconds
  disk         the same extents, all at once over the lanes, pages committed
  disk/layer   the same extents, one layer's at a time (a barrier per layer, as the
               engine waits), pages committed: the cost of the queue depth alone

with the engine's figure as a share of the disk's. `--chunk` splits each engine read into
pieces of at most that many KiB (the reader's `read-chunk-kb`). Page cache dropped first;
O_DIRECT bypasses it anyway.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, drop_caches  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path("~/.cache/bmoe-bench/bench-24x64-top4-f16-e1024-f512.gguf").expanduser()

Extent = tuple[int, int]          # (page-aligned file offset, page-multiple length)


def headless_streamer(model: Path, values: dict[str, Any]) -> Any:
    """An ExpertStreamer with buffers, cache and reader, and no llama.cpp."""
    from bmoe.engine.experts.budget import Budget
    from bmoe.engine.experts.cache import ExpertCache
    from bmoe.engine.experts.layout import read_layout
    from bmoe.engine.experts.memory import PageSupply
    from bmoe.engine.experts.reader import ExpertReader
    from bmoe.engine.experts.streamer import ExpertStreamer

    layout = read_layout(model)
    st = ExpertStreamer(model, layout, values)
    st._make_buffers()
    st._layer_ids = list(layout.layers)
    budget = int(values["cache-mb"]) * MIB
    unit = np.array([layout.unit_bytes(i) for i in range(layout.n_layer)])
    st.cache = ExpertCache(unit, layout.n_expert, budget, "lru")
    st.budget = Budget(budget, "fixed", 0)
    st.reader = ExpertReader(str(model), int(values["io-threads"]), True,
                             chunk=int(values.get("read-chunk-kb", 0)) * 1024)
    st.reader.mode = str(values.get("reader-mode", "aio"))
    if values.get("huge-pages", False):
        st.reader.supply = PageSupply()
    return st


def replay_engine(model: Path, trace: np.ndarray, values: dict[str, Any], warmup: int,
                  on_warm: Any = None) -> tuple[float, int, list[list[Extent]]]:
    """(seconds waited, bytes, the extents of each layer's reads) after `warmup` tokens."""
    from bmoe.engine.experts.memory import page_ceil, page_floor

    st = headless_streamer(model, values)
    reader = st.reader
    groups: list[list[Extent]] = []
    real = reader.read_all

    def recording(reads: list[Any]) -> tuple[int, float]:
        groups.append([(page_floor(r.offset),
                        min(page_ceil(r.offset + r.length), reader.file_size)
                        - page_floor(r.offset)) for r in reads])
        return real(reads)

    reader.read_all = recording
    try:
        for t in range(trace.shape[0]):
            if t == warmup:
                groups.clear()
                if on_warm is not None:
                    on_warm()
                io0, b0 = st._total.io_s, st._total.read_bytes
            for layer in range(trace.shape[1]):
                st.ensure(layer, np.unique(trace[t, layer].astype(np.int64)))
        return st._total.io_s - io0, st._total.read_bytes - b0, [g for g in groups if g]
    finally:
        reader.read_all = real
        st.close()


def read_extents(model: Path, groups: list[list[Extent]], lanes: int, per_layer: bool
                 ) -> tuple[float, int]:
    """The disk bench's way: O_DIRECT preadv over `lanes` threads into committed buffers."""
    from bmoe.engine.experts.memory import AnonBuffer, PageSupply

    biggest = max(n for g in groups for _, n in g)
    fd = os.open(model, os.O_RDONLY | os.O_DIRECT)
    supply = PageSupply()
    bufs = [AnonBuffer(0, biggest) for _ in range(lanes)]
    for b in bufs:
        supply.commit(b)

    def work(i: int, extents: list[Extent]) -> int:
        got = 0
        for off, n in extents[i::lanes]:
            view = bufs[i].view[:n]
            try:
                got += os.preadv(fd, [view], off)
            finally:
                view.release()
        return got

    batches = groups if per_layer else [[e for g in groups for e in g]]
    try:
        with ThreadPoolExecutor(lanes) as pool:
            t0 = time.perf_counter()
            total = 0
            for extents in batches:
                ordered = sorted(extents, key=lambda e: -e[1])
                total += sum(pool.map(work, range(lanes), [ordered] * lanes))
            return time.perf_counter() - t0, total
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
        supply.close()


def reader_on_committed(model: Path, groups: list[list[Extent]], lanes: int
                        ) -> tuple[float, int]:
    """The engine's reader (its lanes, its spread, its preadv) on the recorded groups, into
    committed pages nobody moves: what the engine's dispatch costs without its pages."""
    from bmoe.engine.experts.memory import AnonBuffer, PageSupply
    from bmoe.engine.experts.reader import ExpertReader, Read

    slot = max(n for g in groups for _, n in g)
    most = max(len(g) for g in groups)
    buf = AnonBuffer(0, slot * most)
    supply = PageSupply()
    supply.commit(buf)
    reader = ExpertReader(str(model), lanes, True)
    try:
        secs, total = 0.0, 0
        for g in groups:
            n, s = reader.read_all([Read(off, n, buf, i * slot) for i, (off, n) in enumerate(g)])
            secs += s
            total += n
        return secs, total
    finally:
        reader.close()
        buf.close()
        supply.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--trace", type=Path, default=HERE / "routing-bench.npy")
    p.add_argument("--tokens", type=int, default=60, help="tokens of the trace replayed")
    p.add_argument("--warmup", type=int, default=10, help="first tokens not counted")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--disk-lanes", type=int, default=0,
                   help="lanes of the disk's figures (default: --lanes)")
    p.add_argument("--cache-mb", type=int, default=1200)
    p.add_argument("--chunk-kb", type=int, default=0,
                   help="engine reads split into pieces of at most this (0: whole slices)")
    p.add_argument("--no-huge-pages", action="store_true")
    p.add_argument("--variants", default="lanes,aio",
                   help="the reader's modes to run, comma-separated: lanes (page moves in "
                        "the lanes, before each read: the engine before issue 33), aio (moves in "
                        "the caller, then every read submitted at once: the engine now), pipe "
                        "(moves in the caller, each read dispatched as its pages are in "
                        "place), first (every move before any read is dispatched)")
    p.add_argument("--rounds", type=int, default=2, help="engine/disk pairs, interleaved")
    args = p.parse_args(argv)
    trace = np.load(args.trace)[: args.tokens]
    values = {"io-threads": args.lanes, "cache-mb": args.cache_mb,
              "read-chunk-kb": args.chunk_kb, "huge-pages": not args.no_huge_pages}
    print(f"model {args.model.name}, trace {args.trace.name} {trace.shape[0]} tokens x "
          f"{trace.shape[1]} layers x top-{trace.shape[2]}, cache {args.cache_mb} MiB, "
          f"{args.lanes} lanes (disk {args.disk_lanes or args.lanes}), chunk {args.chunk_kb or '-'} KiB; load average "
          "{:.2f}".format(os.getloadavg()[0]), flush=True)
    for rnd in range(args.rounds):
        engines = {}
        for v in args.variants.split(","):
            drop_caches()
            secs, nbytes, groups = replay_engine(args.model, trace,
                                                 dict(values, **{"reader-mode": v}),
                                                 args.warmup)
            engines[v] = nbytes / secs
        sizes = [n for g in groups for _, n in g]
        dl = args.disk_lanes or args.lanes
        d_s, d_b = read_extents(args.model, groups, dl, per_layer=False)
        l_s, l_b = read_extents(args.model, groups, dl, per_layer=True)
        c_s, c_b = reader_on_committed(args.model, groups, args.lanes)
        disk, layer, comm = d_b / d_s, l_b / l_s, c_b / c_s
        print(f"round {rnd}: {nbytes / MIB:.0f} MiB in {len(sizes)} reads (median "
              f"{np.median(sizes) / 1024:.0f} KiB, {len(sizes) / len(groups):.1f} per layer "
              f"wait); " + ", ".join(f"engine[{v}] {e / MIB:.0f} MiB/s ({e / disk:.0%} of disk)"
                                   for v, e in engines.items())
              + f"; disk {disk / MIB:.0f} MiB/s, "
              f"disk/layer {layer / MIB:.0f} MiB/s, reader on committed pages {comm / MIB:.0f} "
              f"MiB/s; disk-per-layer/disk {layer / disk:.0%}, "
              f"committed/disk {comm / disk:.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
