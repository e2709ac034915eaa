"""The planner's probes: what this machine and this model file can do, measured.

Theory of operation
-------------------
Each probe answers with ``Figure``s: a value, its ``source`` (``measured``, ``derived``,
``policy``, ``operator``, ``unprobed``) and a sentence that says what was measured. A
probe that cannot measure says ``unprobed`` and why; it never invents a number.

* ``probe_memory`` (``bmoe.machine``'s, the one reader) — MemAvailable, the memory
  cgroup's limit (v1 or v2, the tightest on the path to the root) and the headroom under
  it, and what the loaded model holds; ``memory_figures`` says them as figures.
* ``probe_storage`` — random O_DIRECT reads of expert-sized blocks from the model's own
  file, at the offsets of its expert tensors, over 1, 2 and 4 reader lanes, each for a
  fraction of a second. O_DIRECT reads bypass the page cache, so it is left as it was.
* ``probe_compute`` — llama.cpp's own CPU matmul (a ggml graph of one vector times a
  block of this model's expert weights, read from the file) at each candidate thread
  count: bytes of weights per second, and the thread count that gives the most.

``ModelFacts`` is the models issue's header probe (``bmoe.models.probe``) plus the tensor
list the planner needs (the expert tensors' offsets, the KV-cache shape).
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.experts.memory import PAGE, AnonBuffer, PageSupply, page_ceil
from ..engine.experts.reader import ExpertReader, Read
from ..machine import MemoryFacts as MemoryFacts      # the planner's inputs name them
from ..machine import probe_memory as probe_memory
from ..models.probe import Header, ModelProbe, TensorInfo, Unreadable, read_file_header
from .matmul import MatmulBench, MatmulUnavailable

MIB = 1 << 20
GIB = 1 << 30
ALIGN = 4096
STORAGE_SECONDS_PER_LANE = 0.24    # each lane count reads for this long, over the rounds
STORAGE_ROUNDS = 3                 # lane counts and batch sizes are measured in this many
                                   # interleaved rounds: a disk whose rate drifts within
                                   # seconds (a virtual disk's host cache) favours none
STORAGE_LANES = (1, 2, 4)
STORAGE_BATCHES = (1, 2, 4, 8, 16)  # reads per batch: one layer's misses, then a wait
STORAGE_SECONDS_PER_BATCHES = 0.36  # each lane count's batches are timed for this long
STORAGE_TYPICAL_BATCH = 8           # reads a layer's misses make: what lanes are chosen by
STORAGE_MIN_BLOCK = 64 * 1024
STORAGE_MAX_BLOCK = 8 * MIB
COMPUTE_SECONDS_PER_COUNT = 0.3    # each thread count multiplies for this long
COMPUTE_WEIGHT_BYTES = 16 * MIB    # weights per matmul: more than a CPU's caches
COMPUTE_ROUNDS = 3                 # each thread count is measured this often, interleaved
COMPUTE_CLOSE = 0.87               # fewer threads win unless more are 15 % faster: on a
                                   # shared machine each extra thread can stall a decode


@dataclass
class Figure:
    value: float
    source: str            # measured | derived | policy | operator | unprobed
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "text": self.text}


# --- the model ----------------------------------------------------------------------------

@dataclass
class ModelFacts:
    path: Path
    size: int
    probe: ModelProbe
    tensors: tuple[TensorInfo, ...] = ()
    data_start: int = 0
    kv: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    def expert_tensors(self) -> list[TensorInfo]:
        return [t for t in self.tensors if "_exps." in t.name and len(t.dims) == 3]

    def dense_active_bytes(self) -> int:
        """Dense bytes one token multiplies: all but the embedding table, whose one row
        is read (unless the output layer is tied to it)."""
        names = {t.name for t in self.tensors}
        embd = sum(t.nbytes for t in self.tensors if t.name == "token_embd.weight")
        tied = "output.weight" not in names
        return self.probe.dense_bytes - (0 if tied else embd)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per context token (F16 K and V in every layer)."""
        arch = self.probe.arch
        n_layer = self.probe.n_layer or self.probe.block_count
        heads = _first_int(self.kv.get(f"{arch}.attention.head_count"))
        heads_kv = _first_int(self.kv.get(f"{arch}.attention.head_count_kv")) or heads
        embd = self.probe.n_embd
        k_len = _first_int(self.kv.get(f"{arch}.attention.key_length")) or (
            embd // heads if heads else 0)
        v_len = _first_int(self.kv.get(f"{arch}.attention.value_length")) or k_len
        return n_layer * heads_kv * (k_len + v_len) * 2

    def ctx_train(self) -> int:
        return _first_int(self.kv.get(f"{self.probe.arch}.context_length"))


def _first_int(v: Any) -> int:
    if isinstance(v, list):
        v = max((x for x in v if isinstance(x, int)), default=0)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """The probe of one model file; an unreadable one has ``probe.readable`` False."""
    p = Path(path)
    try:
        size = p.stat().st_size
        header: Header = read_file_header(p)
        probe = ModelProbe.of([header])
    except Unreadable as e:
        return ModelFacts(p, 0, ModelProbe.unreadable(e.reason))
    except OSError as e:
        return ModelFacts(p, 0, ModelProbe.unreadable(
            f"the file could not be read ({e.strerror or 'input/output error'})"))
    except Exception:  # noqa: BLE001 - a hostile header must never take the planner down
        return ModelFacts(p, 0, ModelProbe.unreadable("the header could not be read"))
    return ModelFacts(p, size, probe, header.tensors, header.header_bytes, header.kv)


# --- memory ---------------------------------------------------------------------------------

def memory_figures(m: MemoryFacts) -> dict[str, Figure]:
    """The memory facts (`bmoe.machine`) as the plan's figures."""
    out = {"memory-total": Figure(m.total, "measured", "the machine's memory"),
           "memory-available": Figure(m.available, "measured" if m.available
                                      else "unprobed", "MemAvailable in /proc/meminfo")}
    if m.cgroup_limit is not None:
        out["cgroup-limit"] = Figure(m.cgroup_limit, "measured",
                                     "this process's memory cgroup limit")
    out["memory-budget"] = Figure(m.budget, "derived", _budget_text(m))
    return out


def _budget_text(m: MemoryFacts) -> str:
    where = ("the memory cgroup's headroom" if m.cgroup_bound else "MemAvailable")
    text = f"{m.budget // MIB} MiB: {where}"
    if m.loaded_held:
        text += f", plus the {m.loaded_held // MIB} MiB the loaded model holds"
    return text


# --- storage --------------------------------------------------------------------------------

@dataclass
class StorageFacts:
    block: int = 0
    rates: dict[int, float] = field(default_factory=dict)   # lanes -> bytes/s
    # reads per batch -> seconds per batch, over `batch_lanes` lanes, each batch waited
    # for before the next (as the engine reads one layer's misses, then computes)
    batch_s: dict[int, float] = field(default_factory=dict)
    batch_lanes: int = 0
    odirect: bool = True
    reason: str = ""                                        # why unprobed
    # lanes -> (reads per batch -> seconds per batch): the engine's own reader
    lane_batch_s: dict[int, dict[int, float]] = field(default_factory=dict)

    @property
    def best_lanes(self) -> int:
        """The fewest lanes within 5 % of the fastest: by the engine reader's batches of a
        layer's typical misses when measured (what decode waits for), else by the
        full-queue rate."""
        timed = {n: t[STORAGE_TYPICAL_BATCH] for n, t in self.lane_batch_s.items()
                 if t.get(STORAGE_TYPICAL_BATCH)}
        if timed:
            best = min(timed.values())
            return min(n for n, t in timed.items() if t <= best / 0.95)
        if not self.rates:
            return 0
        top = max(self.rates.values())
        return min(n for n, r in self.rates.items() if r >= 0.95 * top)

    def rate(self, lanes: int | None = None) -> float:
        if not self.rates:
            return 0.0
        if lanes is None:
            return self.rates[self.best_lanes]
        below = [n for n in self.rates if n <= lanes]
        return self.rates[max(below)] if below else self.rates[min(self.rates)]

    def batch_seconds(self, reads: float) -> float:
        """Seconds to read `reads` blocks as one waited-for batch (interpolated between the
        measured batch sizes, linear beyond the largest); 0 when not measured."""
        if not self.batch_s or reads <= 0:
            return 0.0
        sizes = sorted(self.batch_s)
        if reads <= sizes[0]:
            return self.batch_s[sizes[0]] * reads / sizes[0]
        for a, b in zip(sizes, sizes[1:], strict=False):
            if reads <= b:
                w = (reads - a) / (b - a)
                return self.batch_s[a] * (1 - w) + self.batch_s[b] * w
        return self.batch_s[sizes[-1]] * reads / sizes[-1]

    def figure(self) -> Figure:
        if not self.rates:
            return Figure(0, "unprobed", self.reason or "storage was not measured")
        lanes = self.best_lanes
        how = "random O_DIRECT reads" if self.odirect else "random reads (buffered: the " \
              "file system refused direct ones)"
        text = (f"{self.rate() / MIB:.0f} MiB/s: {how} of {self.block // 1024} KiB "
                f"expert blocks of this model's file over {lanes} lane"
                f"{'s' if lanes > 1 else ''}")
        typical = self.lane_batch_s.get(lanes, {}).get(STORAGE_TYPICAL_BATCH)
        if typical:
            text += (f"; {STORAGE_TYPICAL_BATCH} blocks read together as the engine reads a "
                     f"layer's misses: {typical * 1000:.1f} ms")
        return Figure(round(self.rate()), "measured", text)

    def to_json(self) -> dict[str, Any]:
        return {"block": self.block, "odirect": self.odirect,
                "rates": {str(k): round(v) for k, v in sorted(self.rates.items())},
                "batch_ms": {str(k): round(v * 1000, 3) for k, v in sorted(self.batch_s.items())},
                "batch_lanes": self.batch_lanes,
                "lane_batch_ms": {str(n): {str(k): round(v * 1000, 3) for k, v in sorted(t.items())}
                                  for n, t in sorted(self.lane_batch_s.items())},
                "best_lanes": self.best_lanes, "reason": self.reason}


def expert_block(facts: ModelFacts) -> int:
    """One expert's slice of one expert tensor, 4 KiB-aligned, within the probe's bounds."""
    tensors = facts.expert_tensors()
    if tensors and facts.probe.n_expert:
        block = tensors[0].nbytes // facts.probe.n_expert
    else:
        block = min(MIB, facts.size // 4)
    block = -(-block // ALIGN) * ALIGN
    return max(STORAGE_MIN_BLOCK, min(STORAGE_MAX_BLOCK, block))


def _regions(facts: ModelFacts, block: int) -> list[tuple[int, int]]:
    """(start, length) of the file regions to read from: the expert tensors, or the file."""
    return [r for group in _layer_regions(facts, block) for r in group]


def _layer_regions(facts: ModelFacts, block: int) -> list[list[tuple[int, int]]]:
    """The expert tensors' regions grouped by layer (a layer's misses are read from its
    own tensors: gate, up and down of the missed experts), or the file as one group."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for t in facts.expert_tensors():
        start = facts.data_start + t.offset
        start = -(-start // ALIGN) * ALIGN
        end = (facts.data_start + t.offset + t.nbytes) // ALIGN * ALIGN
        if end - start >= block:
            layer = t.name.split(".")[1] if t.name.startswith("blk.") else t.name
            groups.setdefault(layer, []).append((start, end - start))
    if not groups and facts.size >= block:
        return [[(0, facts.size // ALIGN * ALIGN)]]
    return list(groups.values())


def probe_storage(facts: ModelFacts, lanes: tuple[int, ...] = STORAGE_LANES,
                  seconds: float = STORAGE_SECONDS_PER_LANE, seed: int | None = None,
                  cancel: threading.Event | None = None,
                  huge_pages: bool = False) -> StorageFacts:
    """Reads land in memory of the kind the engine reads into: with `huge_pages` (the
    engine's `huge-pages`), pages carved from transparent huge pages (a virtual disk can
    pay per physically contiguous run of the memory a read fills: see
    `memory.PageSupply`), else pages faulted in one by one."""
    block = expert_block(facts)
    regions = _regions(facts, block)
    if not regions:
        return StorageFacts(block, reason="the file is smaller than one block to read")
    try:
        fd = os.open(facts.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        odirect = hasattr(os, "O_DIRECT")
    except OSError:
        try:
            fd = os.open(facts.path, os.O_RDONLY)
        except OSError as e:
            return StorageFacts(block, reason="the model's file could not be opened "
                                f"({e.strerror or 'input/output error'})")
        odirect = False
    out = StorageFacts(block, odirect=odirect)
    rng = random.Random(seed)
    done = {n: 0 for n in lanes}
    spent = {n: 0.0 for n in lanes}
    try:
        for _ in range(STORAGE_ROUNDS):        # interleaved: a drifting rate favours none
            for n in lanes:
                if cancel is not None and cancel.is_set():
                    break
                got = _read_for(fd, regions, block, n, seconds / STORAGE_ROUNDS, rng,
                                huge_pages)
                if got is None:
                    out.reason = "the model's file could not be read with direct reads"
                    return StorageFacts(block, odirect=odirect, reason=out.reason)
                done[n] += got[0]
                spent[n] += got[1]
        out.rates = {n: done[n] / spent[n] for n in lanes if spent[n] > 0}
    finally:
        os.close(fd)
    if out.rates and not (cancel is not None and cancel.is_set()):
        out.lane_batch_s = _batches(facts, tuple(out.rates), odirect, rng, cancel, huge_pages)
        out.batch_lanes = out.best_lanes
        out.batch_s = dict(out.lane_batch_s.get(out.batch_lanes, {}))
    return out


def _pick(regions: list[tuple[int, int]], block: int, r: random.Random) -> int:
    """A random whole block of a random region, on the region's block grid: one expert's
    slice as the engine reads it (an expert tensor's slices follow each other)."""
    start, length = r.choice(regions)
    return start + r.randrange(max(1, length // block)) * block


def _slices(facts: ModelFacts) -> list[list[tuple[int, int, int]]]:
    """Each MoE layer's expert tensors as (file offset of the data, bytes of one expert's
    slice, experts): where the engine reads a layer's misses from."""
    layers: dict[str, list[tuple[int, int, int]]] = {}
    n = facts.probe.n_expert
    for t in facts.expert_tensors():
        if n and t.nbytes >= n:
            layer = t.name.split(".")[1] if t.name.startswith("blk.") else t.name
            layers.setdefault(layer, []).append((facts.data_start + t.offset, t.nbytes // n, n))
    return list(layers.values())


def _batches(facts: ModelFacts, lanes: tuple[int, ...], odirect: bool, rng: random.Random,
             cancel: threading.Event | None, huge_pages: bool) -> dict[int, dict[int, float]]:
    """Seconds per batch of n reads through the engine's own reader
    (`ExpertReader.read_all`: the reads spread over its lanes, the batch waited for before
    the next), made as decode makes one layer's misses: a random layer, random experts of
    it, each expert's slice of its gate, up and down tensors at the slice's own offset and
    length (the reader widens them to whole pages as it does the engine's); for each lane
    count, the median batch of each size, in interleaved rounds. The reads land in pages
    held from the start, of the kind the engine's misses land in (a victim's, moved over,
    or fresh ones from its `PageSupply`): a fresh page costs a fault, and scattered pages
    cost a virtual disk per run. {} when it cannot read."""

    layers = _slices(facts)
    if not layers:
        return {}
    largest = max(s for layer in layers for _, s, _ in layer)
    stride = page_ceil(largest) + PAGE              # one read's widened pages, whatever phase
    slots = max(STORAGE_BATCHES)
    times: dict[int, dict[int, list[float]]] = {n: {k: [] for k in STORAGE_BATCHES}
                                                for n in lanes}
    supply = PageSupply(enabled=huge_pages)
    # One slot per read, twice over; a read of file offset o lands at its slot's start
    # (the reader places slice byte 0 at data + at - o % PAGE). Each read first takes
    # over the pages its slot holds in the other half, as a miss takes over a victim's
    # (moved in the lane: `Read.moves`); edge pages are faulted in once, as the
    # engine's (shared with the neighbouring slices) are.
    buf = AnonBuffer(0, 2 * slots * stride)
    readers: dict[int, ExpertReader] = {}
    per_cell = STORAGE_SECONDS_PER_BATCHES / STORAGE_ROUNDS / len(STORAGE_BATCHES)
    held = [0] * slots                 # which half holds each slot's pages: 0 or `slots`
    try:
        supply.commit(buf, slots * stride)
        for n in lanes:
            readers[n] = ExpertReader(str(facts.path), n, odirect)
        for _ in range(STORAGE_ROUNDS):
            for n, reader in readers.items():
                for k in STORAGE_BATCHES:
                    if cancel is not None and cancel.is_set():
                        return {}
                    deadline = time.perf_counter() + per_cell
                    cell = times[n][k]
                    while time.perf_counter() < deadline or not cell:
                        layer = rng.choice(layers)
                        experts = rng.sample(range(layer[0][2]), min(layer[0][2],
                                                                       -(-k // len(layer))))
                        reads: list[Read] = []
                        for off, size, _ in layer:
                            for e in experts:
                                o, i = off + e * size, len(reads)
                                if i == k:
                                    break
                                src, dst = held[i], slots - held[i]      # 0 or `slots`
                                held[i] = dst
                                lo = (PAGE if o % PAGE else 0)       # the slice's interior
                                hi = (o % PAGE + size) // PAGE * PAGE
                                moves = (((src + i) * stride + lo + buf.base,
                                          (dst + i) * stride + lo + buf.base, hi - lo),)
                                reads.append(Read(o, size, buf, (dst + i) * stride + o % PAGE,
                                                  moves if hi > lo else ()))
                        cell.append(reader.read_all(reads)[1])
    except OSError:
        return {}
    finally:
        for reader in readers.values():
            reader.close()
        buf.close()
        supply.close()
    return {n: {k: statistics.median(v) for k, v in t.items() if v} for n, t in times.items()}


def _read_for(fd: int, regions: list[tuple[int, int]], block: int, lanes: int,
              seconds: float, rng: random.Random,
              huge_pages: bool = False) -> tuple[int, float] | None:
    """(bytes, seconds) of random block reads over ``lanes`` threads for ``seconds``, each
    lane into memory of the engine's kind (see `probe_storage`)."""

    seeds = [rng.randrange(1 << 30) for _ in range(lanes)]
    done = [0] * lanes
    failed: list[str] = []
    supply = PageSupply(enabled=huge_pages)
    bufs = [AnonBuffer(0, block) for _ in range(lanes)]
    for b in bufs:
        supply.commit(b)
    deadline = time.perf_counter() + seconds

    def lane(i: int) -> None:
        r = random.Random(seeds[i])
        view = bufs[i].view[:block]
        try:
            while time.perf_counter() < deadline:
                done[i] += os.preadv(fd, [view], _pick(regions, block, r))
        except OSError as e:
            failed.append(e.strerror or "error")
        finally:
            view.release()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(i,), name=f"bmoe-plan-read-{i}")
               for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in bufs:
        b.close()
    supply.close()
    if failed:
        return None
    return sum(done), max(1e-9, time.perf_counter() - t0)


# --- compute --------------------------------------------------------------------------------

@dataclass
class ComputeFacts:
    rates: dict[int, float] = field(default_factory=dict)    # threads -> weight bytes/s
    type_name: str = ""
    reason: str = ""
    cores: int = 0                 # the cores this process may use
    load: float = 0.0              # the 1-minute load average when measured
    others: float | None = None    # cores other programs kept busy during the probe

    @property
    def busy_elsewhere(self) -> float:
        """Cores other programs use: measured over the probe when /proc allows, else the
        load average less this process's own probe. The load average is a minute's
        moving average: it still counts a program that ended seconds ago (in a
        benchmark, the previous run), so it is only the fallback."""
        if self.others is not None:
            return self.others
        return max(0.0, self.load - 1.0)

    @property
    def spare_cores(self) -> int:
        """The cores other programs leave free: all of them on a quiet machine, fewer as
        other programs keep cores busy (at least one)."""
        if not self.cores:
            return 0
        return max(1, min(self.cores, int(self.cores - self.busy_elsewhere + 0.5)))

    @property
    def best_threads(self) -> int:
        if not self.rates:
            return 0
        top = max(self.rates.values())
        return min(n for n, r in self.rates.items() if r >= COMPUTE_CLOSE * top)

    def rate(self, threads: int | None = None) -> float:
        if not self.rates:
            return 0.0
        if threads is None:
            return self.rates[self.best_threads]
        if threads in self.rates:
            return self.rates[threads]
        below = [n for n in self.rates if n <= threads]
        base = max(below) if below else min(self.rates)
        return self.rates[base]

    def figure(self) -> Figure:
        if not self.rates:
            return Figure(0, "unprobed", self.reason or "compute was not measured")
        n = self.best_threads
        return Figure(round(self.rate()), "measured",
                      f"{self.rate() / GIB:.1f} GiB/s of {self.type_name} weights through "
                      f"llama.cpp's matmul with {n} thread{'s' if n > 1 else ''}")

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "best_threads": self.best_threads,
                "rates": {str(k): round(v) for k, v in sorted(self.rates.items())},
                "cores": self.cores, "load": round(self.load, 2),
                "others": None if self.others is None else round(self.others, 2),
                "spare_cores": self.spare_cores, "reason": self.reason}


def thread_candidates(limit: int | None = None) -> tuple[int, ...]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    n = min(limit or 64, usable or os.cpu_count() or 1)
    picks = {1, 2, 4, n // 2, n} | ({8} if n >= 8 else set())
    return tuple(sorted(k for k in picks if 1 <= k <= n))


def probe_compute(facts: ModelFacts, threads: tuple[int, ...] | None = None,
                  seconds: float = COMPUTE_SECONDS_PER_COUNT,
                  cancel: threading.Event | None = None) -> ComputeFacts:
    tensor = _compute_tensor(facts)
    if tensor is None:
        return ComputeFacts(reason="the model has no matrix to multiply")
    try:
        weights = _weights_from_file(facts, tensor)
        bench = MatmulBench(tensor.type, tensor.dims[0], weights)
    except MatmulUnavailable as e:
        return ComputeFacts(reason=str(e))
    except OSError as e:
        return ComputeFacts(reason="the model's weights could not be read "
                            f"({e.strerror or 'input/output error'})")
    out = ComputeFacts(type_name=bench.type_name, cores=max(thread_candidates()),
                       load=os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    counts = threads or thread_candidates()
    runs: dict[int, list[float]] = {n: [] for n in counts}
    cpu_before = cpu_times()
    try:
        for _ in range(COMPUTE_ROUNDS):       # interleaved, so a quiet moment favours none
            for n in counts:
                if cancel is not None and cancel.is_set():
                    break
                runs[n].append(bench.rate(n, seconds / COMPUTE_ROUNDS))
        out.rates = {n: statistics.median(r) for n, r in runs.items() if r}
        out.others = cpu_used_elsewhere(cpu_before, cpu_times())
    except MatmulUnavailable as e:
        out.rates.clear()
        out.reason = str(e)
    finally:
        bench.close()
    return out


@dataclass(frozen=True)
class CpuTimes:
    wall: float          # monotonic seconds
    busy: float          # CPU seconds every core of the machine spent busy
    own: float           # CPU seconds this process spent, all its threads


def cpu_times() -> CpuTimes | None:
    """The machine's and this process's CPU time so far (Linux /proc), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        # cpu user nice system idle iowait irq softirq steal ...
        ticks = [int(x) for x in fields[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]
        times = os.times()
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return CpuTimes(time.monotonic(), busy / hz, times.user + times.system)


def cpu_used_elsewhere(a: CpuTimes | None, b: CpuTimes | None) -> float | None:
    """Cores other programs kept busy between two readings (None when unmeasurable or
    the span is too short to mean anything)."""
    if a is None or b is None or b.wall - a.wall < 0.2:
        return None
    return max(0.0, ((b.busy - a.busy) - (b.own - a.own)) / (b.wall - a.wall))


def _compute_tensor(facts: ModelFacts) -> TensorInfo | None:
    experts = facts.expert_tensors()
    if experts:
        return max(experts, key=lambda t: t.nbytes)
    mats = [t for t in facts.tensors if len(t.dims) == 2 and t.name.startswith("blk.")]
    return max(mats, key=lambda t: t.nbytes) if mats else None


def _weights_from_file(facts: ModelFacts, t: TensorInfo) -> bytes:
    """Up to COMPUTE_WEIGHT_BYTES of the tensor's own bytes, whole rows."""
    row = t.nbytes // max(1, _rows(t))
    n_rows = max(1, min(_rows(t), COMPUTE_WEIGHT_BYTES // max(1, row)))
    want = row * n_rows
    with open(facts.path, "rb") as f:
        f.seek(facts.data_start + t.offset)
        data = f.read(want)
    if len(data) < want:
        raise OSError(5, "the file ends inside a tensor")
    return data


def _rows(t: TensorInfo) -> int:
    n = 1
    for d in t.dims[1:]:
        n *= d
    return n
