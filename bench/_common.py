"""Helpers of the benchmarks: memory cgroups, the disk's read rate, offline cache bounds."""

from __future__ import annotations

import bisect
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bmoe.machine import cgroup  # noqa: E402

MIB = 1 << 20


# -- memory cgroup: the engine's own (v1 or v2), so a bench caps as the server measures --

MemoryCap = cgroup.MemoryCap


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# -- the disk ------------------------------------------------------------------------------

def direct_read_rate(path: Path, chunk: int, count: int, lanes: int, seed: int = 0) -> float:
    """Bytes/s of `count` random O_DIRECT reads of `chunk` bytes over `lanes` threads,
    into pages carved from transparent huge pages where the kernel has them: physically
    contiguous, which a virtual disk can read up to twice as fast as pages faulted in one
    by one, so this is the disk's best rate (the engine reads into plain pages unless
    `huge-pages` is on)."""
    from bmoe.engine.experts.memory import AnonBuffer, PageSupply
    size = path.stat().st_size
    rng = random.Random(seed)
    offsets = [rng.randrange(0, (size - chunk) // 4096) * 4096 for _ in range(count)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    supply = PageSupply()
    bufs = [AnonBuffer(0, chunk) for _ in range(lanes)]
    for b in bufs:
        supply.commit(b)

    def work(i: int) -> int:
        view = bufs[i].view[:chunk]
        try:
            return sum(os.preadv(fd, [view], off) for off in offsets[i::lanes])
        finally:
            view.release()

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(lanes) as pool:
            total = sum(pool.map(work, range(lanes)))
        return total / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
        supply.close()


def burst_read_rate(path: Path, per_burst: int, count: int, lanes: int,
                    seed: int = 0) -> tuple[float, float]:
    """(bytes/s in bursts, bytes/s all queued at once) of `count` random experts of the
    model at `path` (every slice of each: its gate, up and down), read by the engine's C
    lanes with O_DIRECT into pages carved from transparent huge pages: in bursts of
    `per_burst` experts, each waited for before the next is queued (what a layer's misses
    are when nothing reads ahead: the engine's `auto` run), and the same reads queued all
    at once. The page cache is dropped before each. The ratio is what the wait per layer
    costs the disk itself, before the engine does anything."""
    from bmoe.engine.experts.layout import read_layout
    from bmoe.engine.experts.memory import AnonBuffer, PageSupply
    from bmoe.engine.experts.reader import native_lanes
    readlanes = native_lanes()
    if readlanes is None:
        raise SystemExit("the burst bench needs the C read lanes (bmoe.native.readlanes)")
    lay = read_layout(path)
    size = path.stat().st_size
    rng = random.Random(seed)
    layers = sorted(lay.layers)
    units = [(rng.choice(layers), rng.randrange(lay.n_expert)) for _ in range(count)]
    tensors: dict[int, list[Any]] = {}
    for t in lay.experts:
        tensors.setdefault(t.layer, []).append(t)
    room = max(t.slice_bytes for t in lay.experts) + 2 * 4096
    per_unit = max(len(ts) for ts in tensors.values())
    buf = AnonBuffer(0, room * per_unit * max(1, per_burst))
    supply = PageSupply()
    supply.commit(buf)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffered = os.open(path, os.O_RDONLY)
    lanes_c = readlanes.Lanes(direct, buffered, size, lanes, False,
                              lambda *_: OSError("a read of the burst bench failed"))

    def spec(group: list[tuple[int, int]]) -> list[int]:
        out: list[int] = []
        for i, (layer, e) in enumerate(group):
            for j, t in enumerate(tensors[layer]):
                off = t.offset + e * t.slice_bytes
                at = buf.base + (i * per_unit + j) * room + off % 4096   # the file's phase
                out += (off, t.slice_bytes, at, buf.base, buf.base + buf.size, 0)
        return out

    def timed(burst: int) -> float:
        drop_caches()
        total, t0 = 0, time.perf_counter()
        for i in range(0, len(units), burst):
            group = units[i:i + burst]
            # all at once: concurrent reads may share memory (only the rate is wanted)
            g = lanes_c.submit(spec(group) if burst <= per_burst else
                               [x for u in group for x in spec([u])], 0, True)
            if not lanes_c.wait([g], 60.0) or g.error is not None:
                raise SystemExit("the burst bench's reads failed or hung")
            total += g.nbytes
        return total / (time.perf_counter() - t0)

    try:
        return timed(max(1, per_burst)), timed(len(units))
    finally:
        lanes_c.close()
        os.close(direct)
        os.close(buffered)
        buf.close()
        supply.close()


# -- routing statistics and offline cache simulations ---------------------------------------

def top_quarter_share(routing: np.ndarray, n_expert: int) -> float:
    """routing [tokens, layers, k]: mean over layers of the top quarter's share of routings."""
    shares = []
    for layer in range(routing.shape[1]):
        counts = np.bincount(routing[:, layer].ravel(), minlength=n_expert)
        top = np.sort(counts)[::-1][: max(1, n_expert // 4)]
        shares.append(top.sum() / counts.sum())
    return float(np.mean(shares))


def consecutive_overlap(routing: np.ndarray) -> float:
    """Mean share of a layer's experts that the previous token used too."""
    k = routing.shape[2]
    same = [len(set(a) & set(b)) / k
            for t in range(1, routing.shape[0])
            for a, b in zip(routing[t], routing[t - 1], strict=True)]
    return float(np.mean(same))


def _requests(routing: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
    out = []
    for t in range(routing.shape[0]):
        for layer in range(routing.shape[1]):
            ids = sorted(set(routing[t, layer].tolist()))
            out.append((t, [(layer, int(e)) for e in ids]))
    return out


Unit = tuple[int, int]


def simulate(routing: np.ndarray, capacity: int, policy: str, count_from: int) -> int:
    """Units read from token `count_from` on, for a cache of `capacity` units.

    `policy` "lru" is the engine's; "belady" evicts the unit used again furthest in the
    future (offline optimal). As in the engine, a layer's routed set is never split.
    """
    reqs = _requests(routing)
    uses: dict[Unit, list[int]] = {}
    for p, (_, units) in enumerate(reqs):
        for u in units:
            uses.setdefault(u, []).append(p)
    resident: dict[Unit, int] = {}      # unit -> last use
    reads = 0
    for p, (t, units) in enumerate(reqs):
        if t >= count_from:
            reads += sum(1 for u in units if u not in resident)
        for u in units:
            resident[u] = p
        over = len(resident) - capacity
        if over > 0:
            cands = [u for u in resident if u not in units]
            key = resident.__getitem__ if policy == "lru" else _next_use(uses, p)
            cands.sort(key=key, reverse=policy != "lru")
            for u in cands[:over]:
                del resident[u]
    return reads


def _next_use(uses: dict[Unit, list[int]], p: int) -> Callable[[Unit], int]:
    def next_use(u: Unit) -> int:
        lst = uses[u]
        i = bisect.bisect_right(lst, p)
        return lst[i] if i < len(lst) else sys.maxsize
    return next_use
