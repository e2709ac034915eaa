"""How many bytes the expert cache may hold (`cache-mb`, `auto`, floor, ceiling), and
whether a prompt then fits in this process's memory.

`auto` sizes the cache once, at load, from the memory this process may still take:
the smaller of the system's MemAvailable and the headroom under the memory cgroup's
limit (`bmoe.machine.cgroup`), minus what a prompt batch needs beside the cache, minus
`cache-floor-mb`; then at least one token cycle and at most every expert's bytes, and
at most `cache-ceil-mb` when that is set.

What a prompt batch needs (`PromptNeeds`), measured at load, after llama.cpp has made
its context (so the KV cache and the dense weights are already held and counted):

* llama.cpp's compute buffer: sized for one ubatch (`n_ubatch` tokens) when the context
  is made, committed only when the first prompt batch runs — read from llama.cpp's own
  report of it (`allocs.py`), else estimated from the model's shape;
* one layer's experts: a ubatch of n tokens routes each layer to up to n·k experts, all
  of which must be in memory while that layer's expert matmuls run, so the cache holds
  that layer's set whole even when it is larger than the budget (the cache's
  `admit` never evicts the units of the current call). The experts held at a batch's
  peak are max(budget, that set);
* the edge pages (a slice's first and last page are shared with its neighbours and stay
  committed once touched) and `RUNTIME_MARGIN` for what the runtime takes while a turn
  runs.

A budget is refused before any expert is read, with the figures, when the experts held
at a batch's peak plus those needs exceed what this process may take (`cache-mb` set
too high, `load-all` on a model that does not fit, or no room left at all — the
context's KV cache too large). Below one token cycle (the bytes one token's routed
experts span over all layers) a global LRU evicts each expert before the next token
asks for it again: it hits 0 % and costs more than no cache. Such a budget is refused
unless `force-cache` is set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...machine import mem_available
from ...machine.cgroup import cgroup_memory
from ..errors import LoadError

MIB = 1 << 20
PAGE = 4096
AUTO = "auto"
# What the process takes while a turn runs beyond the compute buffer, the experts and the
# edge pages: Python's objects for the prompt and the answer, the CPU backend's work
# buffer (llama.cpp allocates it beside the compute buffer, when a graph runs), the lanes'
# malloc arenas, page tables. Measured here (huge pages off, so that what is counted is
# held, not a split huge page waiting for reclaim): 2.5-9 MiB over those figures for
# prompts of up to 8,000 tokens, CLI and server, on 12- and 24-layer MoEs.
RUNTIME_MARGIN = 32 * MIB


@dataclass(frozen=True)
class PromptNeeds:
    """What a prompt batch takes beside the expert cache, bytes (see the module doc)."""

    n_ubatch: int = 0
    compute: int = 0            # llama.cpp's compute buffer for one ubatch
    compute_source: str = ""    # "llama.cpp" (its report at context creation) | "estimate"
    batch_layer: int = 0        # the experts one ubatch can route one layer to (largest layer)
    edges: int = 0              # edge pages of every expert slice
    runtime: int = 0            # RUNTIME_MARGIN
    kv: int | None = None       # the context's KV cache (held from the load on), if known

    @property
    def beside(self) -> int:
        """Bytes a batch needs beside the experts."""
        return self.compute + self.edges + self.runtime


@dataclass(frozen=True)
class Room:
    """What this process may still take, bytes, and what says so."""

    avail: int
    source: str                 # "memory cgroup" | "MemAvailable"
    limit: int = 0              # the cgroup's limit (0 without one)
    held: int = 0               # what the cgroup held that reclaim cannot take back


@dataclass(frozen=True)
class Budget:
    bytes: int          # 0: no cache
    mode: str           # "off" | "fixed" | "auto" | "all"
    available: int      # what this process could still take at load (bytes)
    peak: int = 0       # the experts held at a prompt batch's peak, bytes
    needs: PromptNeeds = field(default_factory=PromptNeeds)


def memory_room(extra_held: int = 0) -> Room:
    """The smaller of MemAvailable and the cgroup's headroom; `extra_held` is memory the
    cgroup counts as reclaimable that the engine needs (dense weights on the mapping)."""
    avail = mem_available()
    cg = cgroup_memory()
    if cg is not None and cg.headroom - extra_held < avail:
        return Room(cg.headroom - extra_held, "memory cgroup", cg.limit, cg.held + extra_held)
    return Room(avail, "MemAvailable")


def resolve(values: Mapping[str, Any], *, token_cycle: int, all_bytes: int,
            extra_held: int = 0, needs: PromptNeeds | None = None,
            room: Room | None = None, will_load: int | None = None) -> Budget:
    """The cache budget from the settings; LoadError for one below a token cycle, and for
    one whose prompt batches would take more memory than this process may.

    `will_load` makes it the check before llama.cpp loads the model: the bytes the load
    will take (the dense weights' copies) are not held yet, so they come off the room.
    """
    needs = needs or PromptNeeds()
    room = room or memory_room(extra_held)
    free = room.avail - needs.beside - (will_load or 0)   # the experts' room at their peak
    layer = min(needs.batch_layer, all_bytes)
    force = bool(values.get("force-cache", False))
    raw = values.get("cache-mb", 0)
    if values.get("load-all"):
        size, mode, key = all_bytes, "all", "{load-all}"
    elif raw == AUTO:
        floor = int(values.get("cache-floor-mb", 1536) or 0) * MIB
        ceil = int(values.get("cache-ceil-mb", 0) or 0) * MIB
        size = min(max(free - floor, token_cycle), all_bytes)
        if ceil > 0:
            size = min(size, ceil)
        if size < token_cycle and not force:
            raise LoadError(_too_small("{cache-ceil-mb}", ceil, token_cycle))
        mode, key = "auto", "{cache-mb}"
    elif int(raw or 0) <= 0:
        size, mode, key = 0, "off", "{cache-mb}"
    else:
        size = min(int(raw) * MIB, all_bytes)
        if size < token_cycle and not force:
            raise LoadError(_too_small("{cache-mb}", int(raw) * MIB, token_cycle))
        mode, key = "fixed", "{cache-mb}"
    # no cache still holds one token cycle while decoding, one layer's set in a batch
    peak = max(size or min(token_cycle, all_bytes), layer)
    if peak > free:
        raise LoadError(_no_room(mode, key, size, peak, free, room, needs, token_cycle,
                                 layer, will_load))
    return Budget(size, mode, room.avail, peak, needs)


def _too_small(key: str, size: int, cycle: int) -> str:
    return (f"{key} is {size / MIB:.0f} MiB, below one token cycle of this model "
            f"({cycle / MIB:.1f} MiB: the experts one token reads over all layers). A cache "
            "that small evicts every expert before it is used again: it hits 0 % and is "
            "slower than none. Raise it, set {cache-mb} to 0 (no cache) or auto, or set "
            "{force-cache} to measure it anyway.")


def _mib(n: int) -> str:
    return f"{max(0, n) // MIB:,} MiB"


def _no_room(mode: str, key: str, size: int, peak: int, free: int, room: Room,
             needs: PromptNeeds, cycle: int, layer: int, will_load: int | None) -> str:
    when = "after the load" if will_load is None else "before the load"
    where = (f"the memory cgroup's limit is {_mib(room.limit)} and it held "
             f"{_mib(room.held)} {when}" if room.source == "memory cgroup"
             else f"the system's MemAvailable {when}")
    kv = f", the context's KV cache {_mib(needs.kv)} of it" if needs.kv else ""
    if will_load is not None:
        kv = (f"; the load will take {_mib(will_load)} of it for the dense weights, and "
              "the context's KV cache beside")
    compute = (f"llama.cpp's compute buffer {_mib(needs.compute)}, " if will_load is None
               else "")
    beside = (f"a prompt batch of {needs.n_ubatch} tokens needs {_mib(needs.beside)} beside "
              f"the experts ({compute}edge pages {_mib(needs.edges)}, {_mib(needs.runtime)} "
              "for the runtime" + (", and llama.cpp's compute buffer, known once the context "
                                   "is made)" if will_load is not None else ")"))
    what = {"all": f"{{load-all}} holds every expert ({_mib(size)})",
            "fixed": f"{{cache-mb}} is {_mib(size)}",
            "auto": f"{{cache-mb}} auto needs at least one token cycle ({_mib(cycle)})",
            "off": f"with {{cache-mb}} 0 the experts in use still take {_mib(peak)}"}[mode]
    text = (f"This model's prompts would not fit in memory: {what}, and a batch's routing "
            f"can need one layer's experts at once ({_mib(layer)}), so the experts "
            f"would hold {_mib(peak)} at a batch's peak; {beside}; this process may take "
            f"{_mib(room.avail)} more ({where}{kv}), which leaves {_mib(free)} or less for "
            "the experts. ")
    least = max(min(cycle, peak), layer)
    if mode in ("fixed", "all") and free >= least:
        fit = f"{free // MIB} MiB or less" if will_load is None else (
            f"less than {free // MIB} MiB")
        return text + (f"Lower {key} to {fit}, or set {{cache-mb}} to auto." if
                       mode == "fixed" else f"Turn {key} off, or set {{cache-mb}} to "
                       f"{fit} or auto.")
    return text + ("Lower {ctx-size} (the KV cache is held from the load on), or give this "
                   "process more memory.")


# -- the figures, from the model's shape ---------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """What the compute buffer of a ubatch scales with."""

    n_embd: int
    n_ff_exp: int
    n_expert_used: int
    n_vocab: int


def shape_of(kv: Mapping[str, Any], tensors: Iterable[Any]) -> BatchShape:
    """The shape from a GGUF header's metadata and tensor list (`models.probe.Header`)."""
    arch = str(kv.get("general.architecture") or "")

    def num(key: str) -> int:
        v = kv.get(f"{arch}.{key}")
        if isinstance(v, list):
            v = max((x for x in v if isinstance(x, int)), default=0)
        return v if isinstance(v, int) and not isinstance(v, bool) else 0

    n_ff, n_vocab = num("expert_feed_forward_length"), 0
    for t in tensors:
        if t.name == "token_embd.weight" and len(t.dims) >= 2:
            n_vocab = int(t.dims[1])
        if not n_ff and "ffn_gate_exps" in t.name and len(t.dims) == 3:
            n_ff = int(t.dims[1])
    return BatchShape(num("embedding_length"), n_ff, num("expert_used_count"), n_vocab)


def estimate_compute(shape: BatchShape, n_ubatch: int, n_ctx: int) -> int:
    """llama.cpp's CPU compute buffer for a ubatch, from the model's shape, bytes.

    An upper estimate of what its allocator reserves (flash attention on, llama.cpp's
    default on the CPU): per token the F32 activations of a routed FFN (gate, up, their
    product and the down projections of k experts), the residual stream, and the logits
    of every output (llama.cpp reserves one per token of the batch); per token and
    context position the F16 attention mask. Against llama.cpp's own figure on four
    shapes (n_embd 128-2048, 8-128 experts, top-4/8, contexts 512-16384) it was 1.0-2.3x.
    """
    k, ff, embd = shape.n_expert_used, shape.n_ff_exp, shape.n_embd
    per_token = 4 * (4 * k * ff + 2 * k * embd + 2 * embd + shape.n_vocab) + 2 * n_ctx
    return n_ubatch * per_token + MIB


def edge_bytes(slices: Iterable[tuple[int, int, int]]) -> int:
    """Bytes of the edge pages of expert tensors given as (file offset, slice bytes,
    experts): the pages not wholly inside one slice, which stay committed once touched."""
    total = 0
    for offset, size, n in slices:
        phase = offset % PAGE
        pages = -(-(phase + size * n) // PAGE)
        interior = 0
        for e in range(n):
            lo, hi = -(-(phase + e * size) // PAGE), (phase + (e + 1) * size) // PAGE
            interior += max(0, hi - lo)
        total += (pages - interior) * PAGE
    return total


def batch_layer_bytes(unit_bytes: Sequence[int], n_expert: int, k: int, n_ubatch: int) -> int:
    """The experts one ubatch can route the largest layer to: min(n_expert, n·k) units."""
    if not unit_bytes:
        return 0
    return max(unit_bytes) * min(n_expert, max(1, n_ubatch) * max(1, k))
