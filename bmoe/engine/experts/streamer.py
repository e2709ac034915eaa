"""The expert streamer: llama.cpp computes, the streamer decides what is in memory.

Theory of operation
-------------------
At load (`configure_model_params`, `attach`), with the model mapped by llama.cpp with its
extra (repacking) buffer types off, so that weights keep the file's layout:

1. every expert tensor gets an anonymous, lazily committed buffer of its full size
   (`memory.AnonBuffer`); nothing is read into it yet;
2. the expert pages of llama.cpp's file mapping are dropped (they were populated by the
   load and are never read again); with `dense-weights anon` the dense pages are
   replaced in place by anonymous copies, so page-cache pressure cannot evict them;
3. the cache budget is resolved (`budget.resolve`) against what a prompt batch needs
   beside it — llama.cpp's compute buffer for a ubatch (its own figure, heard from its
   log while the context was made: `allocs.py`), the one layer's experts a batch can
   route to, the edge pages — and with `load-all` every expert is read now.

During every graph evaluation llama.cpp calls the graph callback for each node, first to
ask whether we want its data, then (for the nodes we said yes to) with the data computed.
The callback is the native one (`bmoe/native/evalcb.c`, wired by `evalcb.py`) when the
extension loads and passes its layout check: it answers every ask itself, forwards only
the MUL_MAT_ID asks to `_bind_native` while tensors remain unbound, and calls
`_route_native` once per MoE layer with the routing's shape and address. Otherwise (or
with `BMOE_EVAL_CALLBACK=python`) it is `_eval`, a ctypes callback entered for every node.
`load_info["eval_callback"]` says which. Once every expert is resident for good (the
model fits the cache: budget ≥ all experts, no read-ahead), the native callback stops
calling `_route_native`: it checks each routing's ids and counts its distinct experts
(the cache's hits, credited at `token_end`/`prefill_end`) itself, and copies a one-token
graph's ids into rows Python reads at `token_end` for the routing record, so a token
enters Python not at all. Either way:

* `ffn_moe_topk-<l>` (a VIEW of the router's argsort, I32 [n_expert_used, n_tokens], rows
  nb[1] apart): we say yes; with the data we take the union of the routed ids, let the
  cache decide hits, misses and victims, and read the misses over the reader's lanes,
  all before llama.cpp goes on to the layer's expert matmuls. A missed slice takes over
  a victim's committed pages (moved in the lane just before its read, see
  `memory.move_pages`); victims nobody took are freed.
* a `MUL_MAT_ID` node whose weight (`src[0]`) is an expert tensor not yet rebound: in the
  ask phase, before the node runs, its `->data` is pointed at our buffer. This happens
  during the first evaluation, after that layer's routing was already read into the
  buffer. Once all are rebound the streamer stops looking at MUL_MAT_ID nodes.

Read-ahead (`prefetch` N > 0, with a cache): after a decode step's layer l has its
experts, the streamer guesses layers l+1 .. l+N (`predict.Predictor`: the next routers
applied to layer l's router input), admits the guesses the cache lacks (`admit_spec`)
and queues one read group per guessed expert on the lanes (`reader.LaneQueue`) behind
the real routing's reads. With `overlap` the callback returns at once and llama.cpp
computes while the lanes read; without it, the callback waits for the guesses too. When
a layer's routing arrives, a guessed expert still in flight is promoted and waited on
(never read twice); a wrong guess is only bandwidth. In-flight units are pinned (never
victims), and a victim whose pages a queued read will take over (`_pending_out`) is not
read into again until that read has run.

A failure inside the callback (an I/O error) cannot raise through llama.cpp: the
callback stops the graph (returns false), records the message, and the session turns it
into an EngineError after llama_decode returns (`failure()`).

Telemetry is accumulated per token (`token_begin`/`token_end`) and per prefill
(`prefill_begin`/`prefill_end`): read time, bytes, bookkeeping time, hits, evictions.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from ...models.probe import read_file_header
from . import evalcb, ggml, nopopulate, packed
from .allocs import ContextAllocs, LogTap
from .budget import (
    MIB,
    RUNTIME_MARGIN,
    Budget,
    PromptNeeds,
    batch_layer_bytes,
    edge_bytes,
    estimate_compute,
    resolve,
    shape_of,
)
from .cache import DEFAULT_POLICY, Admission, ExpertCache, NoCache
from .predict import (Predictor, batch_guess, read_router_biases, read_routers, router_input,
                      router_rows)
from .layout import ExpertTensor, Layout
from .memory import (
    PAGE,
    AnonBuffer,
    FileMapping,
    MappingProbe,
    PageSupply,
    drop_mapped,
    folio_note,
    map_count,
    max_map_count,
    page_ceil,
    page_floor,
    page_runs,
    pin_anonymous,
    resident_fraction,
)
from .reader import (FRESH, ExpertReader, LaneQueue, NativeLaneQueue, QueuedGroup, Read,
                     ReadError, native_lanes)
from .repack import GGML_TYPE_MXFP4, RepackUnavailable, packer, row_bytes

_TOPK = b"ffn_moe_topk-"
_LOAD_ALL_CHUNK = 16 << 20
PREFILL_BATCH = 512          # the session's PREFILL_CHUNK: tokens per ubatch at most
FILL_PRIO = 1 << 20          # a background fill's reads: after every token's and guess's
_DENSE_SAMPLE_S = 0.5       # mincore over the dense pages at most this often
SLOTS_ENV = "BMOE_EXPERT_SLOTS"   # "0": no expert slots (`_start_slots`), where they work
KEEP_ENV = "BMOE_PROMPT_KEEP"     # "1": prompt batches keep layers (`_start_prompt_keep`)
RESERVE_ENV = "BMOE_PAGE_RESERVE"  # "0": no pages committed ahead of the first fill
# families whose MoE graph reads the routing only in the weights' gather and the expert
# matmuls (no per-expert biases): checked on their graphs (docs/expert-cache.md)
SLOT_ARCHS = frozenset({"qwen3moe"})


class _Counters:
    __slots__ = ("io_s", "mgmt_s", "stall_s", "read_bytes", "hits", "misses", "evictions",
                 "rereads", "experts_read", "spec_bytes", "spec_units", "spec_useful",
                 "spec_wasted_bytes", "guessed", "guess_hits", "routed")

    def __init__(self) -> None:
        self.io_s = self.mgmt_s = self.stall_s = 0.0
        self.read_bytes = self.hits = self.misses = self.evictions = self.rereads = 0
        self.experts_read = 0
        self.spec_bytes = self.spec_units = self.spec_useful = self.spec_wasted_bytes = 0
        self.guessed = self.guess_hits = self.routed = 0


class ExpertStreamer:
    """The session's `Streamer` for a GGUF file with routed experts."""

    def __init__(self, path: Path, layout: Layout, values: dict[str, Any]) -> None:
        self.path = Path(path)
        self.layout = layout
        self.values = dict(values)
        self.dense_mode = str(values.get("dense-weights", "anon"))
        self._record_routing = False          # keep every decode token's routing
        self.local_below: int | None = None   # layers from here on are an RPC helper's
        self._expert_bytes = 0
        self._layer_ids: list[int] = []
        self.routing: list[np.ndarray] = []   # [n_layer_with_experts, n_expert_used] per token
        self.cache: ExpertCache | NoCache | None = None
        self.budget = Budget(0, "off", 0)
        self.reader: ExpertReader | None = None
        self.mapping: FileMapping | None = None
        self._probe: MappingProbe | None = None
        self._buffers: dict[str, AnonBuffer] = {}
        self._by_layer: dict[int, tuple[tuple[ExpertTensor, AnonBuffer], ...]] = {}
        self._plan_table = np.zeros((0, 5), dtype=np.int64)    # _make_buffers fills them
        self._plan_starts = np.zeros(1, dtype=np.int64)
        self._tensor_of: dict[bytes, ExpertTensor] = {}
        self._unbound: set[bytes] = set()
        # repacked experts (`_start_packs`, repack.py): whether the kernel choice allows
        # them (asked only of a model with MXFP4 experts), and per repacked tensor its row
        # bytes and the kernels its bind hands it
        self._repack_choice: Callable[[], tuple[bool, str]] | None = None
        self._pack_rows: dict[str, int] = {}
        self._pack_kernels: dict[bytes, int] = {}
        # the model's packed experts file (packed.py): used where one matches, unless
        # `packed-experts` is off; its (inode, size, mtime) once it is read from
        self._packed_allowed = bool(self.values.get("packed-experts", True))
        self._packed_id: tuple[int, int, int] | None = None
        self._dense_runs: list[tuple[int, int]] = []
        self._dense_frac = -1.0
        self._dense_at = 0.0
        self._failure: str | None = None
        self._file_id: tuple[int, int, int] | None = None
        self._token = _Counters()
        self._turn = _Counters()      # prefill of the current turn
        self._total = _Counters()
        self._in_prefill = False
        self._route_row: dict[int, np.ndarray] = {}
        self.prefetch = max(0, int(values.get("prefetch", 0) or 0))
        self.spec_gate = float(values.get("spec-gate", 0.0) or 0.0)
        self.overlap = bool(values.get("overlap", False))
        self.fill = bool(values.get("cache-fill", True))
        self.prefill_ahead = bool(values.get("prefill-ahead", True))
        self._batch_routers: dict[int, np.ndarray] | None = None   # set: prefill reads ahead
        self._batch_biases: dict[int, np.ndarray] = {}      # their biases (gpt-oss)
        self._filling: set[tuple[int, int]] = set()    # units a background fill reads
        self._reserve: threading.Thread | None = None    # `_start_page_reserve`'s thread
        self._reserve_stop = threading.Event()
        self._fill_units = 0                             # units the fill queued in all
        self._fill_bytes = 0                             # bytes it has read so far
        self.predictor: Predictor | None = None
        self.queue: LaneQueue | NativeLaneQueue | None = None
        self._inflight: dict[tuple[int, int], QueuedGroup] = {}     # units read ahead
        self._pending_out: dict[tuple[int, int], QueuedGroup] = {}  # pages a read will take
        self._spec: np.ndarray = np.zeros((0, 0), dtype=bool)     # read ahead, not yet used
        self._guess: dict[int, np.ndarray] = {}                   # this token's guesses
        # a prompt's ubatches as Session.decode announces its chunks (`batch_begin`):
        # (tokens, output rows, the next ubatch's tokens or 0) each, in order; and the one
        # computing, taken when its first streamed layer is routed
        self._ubatches: list[tuple[int, int, int]] = []
        self._ub: tuple[int, int, int] | None = None
        # whether the model's last layer runs only a ubatch's output rows (llama.cpp's
        # graphs cut the other rows before it in most families; gpt-oss's runs them all):
        # learned at the first ubatch with fewer outputs than rows, taken as cut until then
        self._last_cut: bool | None = None
        self._busy_at = 0.0
        self._src_unit: dict[int, tuple[int, int]] = {}
        # expert slots (`_start_slots`): the slot each expert of a layer is read into
        self._perm: np.ndarray | None = None          # [n_layer, n_expert] -> slot
        self._slot_share = 0                            # units a layer keeps in decode
        self._slot_swaps = 0                            # misses read into a victim's slot
        self._slot_taken: set[tuple[int, int]] = set()  # the last admission's: in place
        self._slot_in_place: set[int] = set()           # its misses read into those
        self._slots_checked = False                     # the graph's MoE nodes looked at
        self._slots_in_c = False                        # the rewrite in the C callback
        self.slots_note = "off"
        # the layers a prompt batch takes no room from (`_start_prompt_keep`)
        self._prompt_keep: np.ndarray | None = None
        self.keep_note = "off"
        self._populating = False
        self._cb = lc.ggml_backend_sched_eval_callback(self._eval)
        self.native: evalcb.NativeCallback | None = None
        self._native_resident = False     # routings counted in C: every expert resident
        self._folded_hits = 0             # of the C side's resident_hits
        self._rec_rows: np.ndarray | None = None   # the C side's routing rows, while resident
        self.load_info: dict[str, Any] = {}
        self.n_ubatch = 0                 # the context's, from configure_context_params
        self.n_ctx = 0
        self._tap: LogTap | None = None   # hears llama.cpp's buffer sizes while it makes one

    def keep_layers_below(self, first_remote: int) -> bool:
        """Stream only the experts of layers below `first_remote` (the ones after it are
        held by RPC helpers, in their memory); False when none is left here."""
        local = tuple(t for t in self.layout.experts if t.layer < first_remote)
        if not local:
            return False
        self.local_below = first_remote
        self.layout = replace(self.layout, experts=local,
                              routers=tuple(r for r in self.layout.routers
                                            if r[0] < first_remote))
        return True

    @property
    def record_routing(self) -> bool:
        return self._record_routing

    @record_routing.setter
    def record_routing(self, on: bool) -> None:
        # may be set from another thread (the server's planner): read per token; while
        # resident the native callback writes the rows, read at token_end
        self._record_routing = bool(on)

    # -- Streamer protocol: loading ---------------------------------------------------

    def configure_model_params(self, params: Any) -> None:
        self._check_before_load()
        ggml.check_layout()
        params.load_mode = lc.LLAMA_LOAD_MODE_MMAP
        params.use_extra_bufts = False
        self._probe = MappingProbe(self.path)
        why = nopopulate.begin(self.path)
        self._populating = not why
        self.load_info["load_reads"] = "dense weights only" if not why else why

    def configure_context_params(self, params: Any) -> None:
        self.n_ubatch = int(params.n_ubatch or params.n_batch or 0)
        self.n_ctx = int(params.n_ctx or 0)
        self._tap = LogTap()
        self._tap.start()
        why = "python: forced by BMOE_EVAL_CALLBACK=python" if evalcb.forced_python() else ""
        if not why:
            try:
                self.native = evalcb.NativeCallback(self._route_native, self._bind_native)
                if self.local_below is not None:
                    self.native.local_layers(self.local_below)
            except evalcb.NativeUnavailable as e:
                why = f"python: {e}"
        if self.native is not None:
            params.cb_eval = self.native.fn
            params.cb_eval_user_data = self.native.user_data
            self.load_info["eval_callback"] = "native"
        else:
            params.cb_eval = self._cb
            params.cb_eval_user_data = None
            self.load_info["eval_callback"] = why

    def attach(self, model: Any, ctx: Any) -> None:
        t0 = time.monotonic()
        allocs = self._end_tap()
        self._end_load()
        assert self._probe is not None, "configure_model_params was not called"
        self.mapping = self._probe.find()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._settle_file_pages(fd)
        finally:
            os.close(fd)
        held = self.layout.dense_bytes if self.dense_mode == "mmap" else 0
        cycle, total = self.layout.token_cycle_bytes, self.layout.expert_bytes
        self.budget = resolve(self.values, token_cycle=cycle, all_bytes=total, extra_held=held,
                              needs=self.prompt_needs(allocs))
        self.load_info["prompt_needs"] = _needs_info(self.budget)
        self._make_buffers()
        self._expert_bytes = self.layout.expert_bytes
        self._layer_ids = list(self.layout.layers)      # the layers streamed here
        unit = np.array([self.layout.unit_bytes(i) for i in range(self.layout.n_layer)])
        policy = str(self.values.get("cache-policy") or DEFAULT_POLICY)
        self.cache = (NoCache(self.layout.n_layer, unit, cycle) if self.budget.bytes == 0
                      else ExpertCache(unit, self.layout.n_expert, self.budget.bytes, policy))
        self.reader = ExpertReader(str(self.path), int(self.values.get("io-threads", 4) or 1),
                                   bool(self.values.get("o-direct", True)))
        st = os.fstat(self.reader.buffered_fd)
        self._file_id = (st.st_ino, st.st_size, st.st_mtime_ns)   # file_problem() compares
        # Each slice that ever received moved pages becomes its own mapping (and so does
        # the edge page between two slices): stay well inside the kernel's map limit.
        slices = sum(t.n_expert for t in self.layout.experts)
        self.reader.recycle = 2 * slices + map_count() < 0.8 * max_map_count()
        # Contiguous pages pay on every later read into them: when the cache turns over.
        # A cache that holds every expert reads each once, and committing huge pages can
        # cost more than faulting in pages freed moments ago (on a VM that hands freed
        # 2 MiB blocks back to its host, each is backed anew: ~3 ms per MiB measured).
        # Huge pages only when asked for; in any cache that turns over, a victim's pages
        # beyond what a miss takes (units differ in size by layer) are kept for the next
        # miss that needs more, not freed: on the Qwen3-30B-A3B slice that spared ~1,100
        # page faults a token (fresh pages zero-filled in the lanes).
        if (self.reader.recycle and self.budget.mode != "all"
                and self.budget.bytes < self.layout.expert_bytes):
            self.reader.supply = PageSupply(
                enabled=bool(self.values.get("huge-pages", False)),
                park_limit=max((self.layout.unit_bytes(i) for i in self.layout.layers),
                               default=0),     # one unit: inside the runtime margin
                reserve_limit=self.budget.bytes)
        supply = self.reader.supply
        if self.budget.bytes < self.layout.expert_bytes and (supply is None
                                                             or not supply.enabled):
            self.load_info["page_folios"] = folio_note()
        self._start_packs()      # before any read: the lanes repack from the first one
        if self.budget.mode == "all":
            self._load_all()
        elif self.prefetch and isinstance(self.cache, ExpertCache):
            if self.budget.bytes < self.layout.expert_bytes:
                self._start_prefetch()
            else:           # once read, every expert stays: guessing would only cost
                self.load_info["predictor"] = "off: every expert fits the cache"
        if (self.fill and isinstance(self.cache, ExpertCache) and self.budget.mode != "all"
                and self.budget.bytes >= self._expert_bytes):
            self._start_fill()
        if (self.prefill_ahead and self.budget.mode != "all"
                and self.budget.bytes < self._expert_bytes):
            self._start_prefill_ahead()
        self._start_prompt_keep()
        self._start_slots()      # after every start of the queue: slots read on it
        self._start_page_reserve()
        self.load_info["attach_s"] = round(time.monotonic() - t0, 3)

    def prompt_needs(self, allocs: ContextAllocs) -> PromptNeeds:
        """What a prompt batch needs beside the cache (budget.py): llama.cpp's compute
        buffer as it reported it (else estimated from the model's shape), the experts one
        ubatch can route a layer to (plus what read-ahead may have in flight), the edge
        pages of every slice."""
        lay = self.layout
        n_ub = self.n_ubatch or 1
        compute, source = allocs.compute, "llama.cpp"
        if compute is None:
            header = read_file_header(self.path)
            compute = estimate_compute(shape_of(header.kv, header.tensors), n_ub, self.n_ctx)
            source = "estimate"
        layer = self._batch_layer_bytes(n_ub)
        layer += self.prefetch * lay.n_expert_used * max(
            (lay.unit_bytes(i) for i in lay.layers), default=0)
        edges = edge_bytes((t.offset, t.slice_bytes, t.n_expert) for t in lay.experts)
        return PromptNeeds(n_ub, compute, source, layer, edges, RUNTIME_MARGIN, allocs.kv)

    def _batch_layer_bytes(self, n_ub: int) -> int:
        """The experts a batch of `n_ub` tokens can route one layer to (the largest layer)."""
        lay = self.layout
        return batch_layer_bytes([lay.unit_bytes(i) for i in lay.layers], lay.n_expert,
                                 lay.n_expert_used, n_ub)

    def _check_before_load(self) -> None:
        """Refuse, before llama.cpp reads anything, a budget that cannot fit even without
        what only the context will tell (its KV cache and compute buffer): the dense
        weights' copies, the experts at a batch's peak, the edge pages, the margin."""
        lay = self.layout
        n_ub = min(int(self.values.get("ctx-size") or 4096),
                   int(self.values.get("ubatch-size") or PREFILL_BATCH),
                   int(self.values.get("batch-size") or PREFILL_BATCH))
        needs = PromptNeeds(n_ub, 0, "", self._batch_layer_bytes(n_ub),
                            edge_bytes((t.offset, t.slice_bytes, t.n_expert)
                                       for t in lay.experts), RUNTIME_MARGIN)
        copies = lay.dense_bytes if self.dense_mode == "anon" else 0
        held = lay.dense_bytes if self.dense_mode == "mmap" else 0
        resolve(self.values, token_cycle=lay.token_cycle_bytes, all_bytes=lay.expert_bytes,
                extra_held=held, needs=needs, will_load=copies)

    def _end_tap(self) -> ContextAllocs:
        tap, self._tap = self._tap, None
        return tap.stop() if tap is not None else ContextAllocs()

    def _start_fill(self) -> None:
        """Every expert fits the cache: queue them all on the lanes at the lowest priority.
        The load stays dense bytes ÷ disk rate; a token's own reads jump this queue, and
        a routed expert still queued here is promoted and waited on (never read twice).
        Once all are in, the native callback counts routings without Python."""
        assert self.reader is not None and isinstance(self.cache, ExpertCache)
        if self.queue is None:
            self.queue = self.reader.start_queue()
        if self._spec.size == 0:
            self._spec = np.zeros((self.layout.n_layer, self.layout.n_expert), dtype=bool)
        cache, queued = self.cache, 0
        for e in range(self.layout.n_expert):      # expert-major: every layer fills evenly
            for layer in self._layer_ids:
                if cache.resident[layer, e] or cache.pinned[layer, e]:
                    continue
                adm = cache.admit_spec(layer, np.array([e], dtype=np.int64), chance=0.0)
                if not len(adm.misses):
                    continue
                g = self.queue.submit(self._reads_for(layer, adm.misses, {}), FILL_PRIO)
                self._inflight[(layer, e)] = g
                cache.pinned[layer, e] = True
                self._filling.add((layer, e))
                queued += 1
        self._fill_units = queued
        self.load_info["cache_fill"] = f"{queued} experts queued"

    @property
    def _planned(self) -> bool:
        """Whether a layer's reads are planned and queued in C (`Lanes.plan_submit`): the
        queue's lanes are C and reads are not cut in pieces (else `_victim_pages` +
        `_reads_for` in Python, the same reads)."""
        q = self.queue
        return (isinstance(q, NativeLaneQueue) and self.reader is not None
                and not self.reader.chunk and self._perm is None)

    def _plan_submit(self, layer: int, misses: np.ndarray, victims: list[tuple[int, int]],
                     split: bool, prio: int) -> tuple[list[QueuedGroup], list[Any]]:
        """The reads of `layer`'s misses planned and queued in one C call: the groups (one,
        or one per miss with `split`; none without misses) and per group the victims
        whose pages its reads take."""
        assert self.reader is not None and isinstance(self.queue, NativeLaneQueue)
        v = np.array(victims, dtype=np.int64).reshape(-1, 2)
        supply = self.reader.supply       # fresh pages where no victim's are spare
        groups, taken = self.queue.lanes.plan_submit(
            self._plan_table, self._plan_starts, layer,
            np.ascontiguousarray(misses, dtype=np.int64), v, self.reader.recycle, split,
            prio, True, supply.give if supply is not None else None,
            supply.take if supply is not None else None)
        return groups, taken

    def _start_prefetch(self) -> None:
        assert self.reader is not None
        n_layer = self.layout.n_layer
        routers = read_routers(self.layout)
        biases = read_router_biases(self.layout)
        self.predictor = Predictor(routers, n_layer, self.layout.n_expert_used, self.prefetch,
                                   self.spec_gate, biases)
        self._spec = np.zeros((n_layer, self.layout.n_expert), dtype=bool)
        self.queue = self.reader.start_queue()
        where = ""
        if self.native is not None and routers and self.native.guess(
                routers, n_layer, self.layout.n_expert, self.prefetch,
                self.layout.n_expert_used, self.spec_gate, biases):
            where = ", guessed in C (bfloat16 routers)"
        with_bias = f" with {len(biases)} routers' biases" if biases else ""
        self.load_info["predictor"] = (
            f"router, {len(routers)} of {n_layer} layers{with_bias}{where}"
            if routers else "previous token")

    def allow_repack(self, choice: Callable[[], tuple[bool, str]]) -> None:
        """How the session's kernel choice is asked whether llama.cpp's repacked kernels
        may run here: `choice()` -> (allowed, why), called only for a model with MXFP4
        experts (it may run the kernel probe)."""
        self._repack_choice = choice

    def _start_packs(self) -> None:
        """Repacked experts (repack.py): MXFP4 expert slices rewritten in llama.cpp's
        CPU_REPACK layout as they are read, and run by its repacked kernels. Where a
        cache turns over, every read must be whole slices written exactly (a direct
        read's first and last pages would put the file's bytes over a neighbouring
        expert already repacked): the C lanes' queue with exact reads, which repack each
        read before its group finishes. Without a cache, or with every expert read at
        load, the streamer repacks what it waited for."""
        lay = self.layout
        cands = [t for t in lay.experts if t.ggml_type == GGML_TYPE_MXFP4]
        if not cands:
            self.load_info["expert_repack"] = "off: no MXFP4 experts"
            return
        assert self.reader is not None
        allowed, why = self._repack_choice() if self._repack_choice else (False, "not asked")
        queued = isinstance(self.cache, ExpertCache) and self.budget.mode != "all"
        kernels: dict[str, int] = {}
        why = "" if allowed else (why or "the kernel choice keeps them off")
        if not why and self.local_below is not None:
            why = "split over RPC helpers (not checked there)"
        elif not why and self.reader.chunk:
            why = "reads are cut in pieces"
        elif not why and native_lanes() is None:
            why = "needs the C read lanes (bmoe.native.readlanes), which are off or not built"
        if not why:
            try:
                p = packer()
                kernels = {t.name: p.kernels_for(t.ggml_type, t.ne0, t.ne1, t.n_expert)
                           for t in cands}
            except RepackUnavailable as e:
                why = str(e)
        if why:
            self.load_info["expert_repack"] = f"off: {why}"
            return
        # the model's packed experts file, where one matches: read already repacked
        found, note = (packed.find(lay, {t.name for t in cands}) if self._packed_allowed
                       else (None, "off"))
        if found is not None:
            self.reader.reopen(str(found.path))
            self._packed_id = found.file_id
        self.load_info["packed_experts"] = (f"on: {found.path.name}" if found is not None
                                            else note)
        if queued:
            self.queue = self.reader.start_queue()
            assert isinstance(self.queue, NativeLaneQueue)
            if self._spec.size == 0:      # what the queued path keeps of guesses in flight
                self._spec = np.zeros((lay.n_layer, lay.n_expert), dtype=bool)
            if found is None:
                self.queue.lanes.set_packs([
                    (buf.base, buf.base + buf.size, buf.base + buf.phase, row_bytes(t.ne0))
                    for t in cands for buf in (self._buffers[t.name],)])
            self.queue.lanes.exact = True
        self._pack_rows = {} if found is not None else {t.name: row_bytes(t.ne0)
                                                        for t in cands}
        self._pack_kernels = {t.name.encode(): kernels[t.name] for t in cands}
        self.load_info["expert_repack"] = (
            f"on: {len(cands)} of {len(lay.experts)} expert tensors (MXFP4) in llama.cpp's "
            "repacked 8x8 layout, run by its CPU_REPACK kernels"
            + (", read repacked from the packed experts file" if found is not None
               else ", repacked by the read lanes" if queued else ""))

    def _pack_slices(self, t: ExpertTensor, e0: int, e1: int) -> None:
        """Experts e0..e1-1 of `t`, read in the file's layout, repacked in place (a tensor
        that is not repacked is left as it is)."""
        rows = self._pack_rows.get(t.name)
        if not rows or e1 <= e0:
            return
        buf, s = self._buffers[t.name], t.slice_bytes
        area = (ctypes.c_char * ((e1 - e0) * s)).from_address(buf.data + e0 * s)
        native = native_lanes()
        assert native is not None
        native.pack_mxfp4(area, rows)

    def _start_slots(self) -> None:
        """Expert slots (on where they work; `BMOE_EXPERT_SLOTS=0` off): a missed expert
        is read into the room of a victim of its own layer as it is, and the layer's
        routing is rewritten to the slots (`_slot_rewrite`), instead of the victim's
        pages being moved to the expert's own place. No page moves (their TLB flushes),
        no spare pages; the layers keep their share of the cache for one token's experts
        (`ExpertCache.admit_own`), a prompt batch still takes room from any layer (those
        pages move, into the slot).

        Needs a cache that turns over; the C lanes' queue (their exact reads: a slot's
        neighbours are other experts than the file's), which read-ahead or a prompt's
        read-ahead starts (so a serial run, without read-ahead, has slots too); slices
        of whole pages (a direct read lands in any slot only then); and a model family
        whose routing is read by nothing but the weights' gather and the expert matmuls
        (`SLOT_ARCHS`; the first graph is checked again)."""
        lay, why = self.layout, ""
        if os.environ.get(SLOTS_ENV, "").strip() == "0":
            why = f"{SLOTS_ENV}=0"
        elif not isinstance(self.cache, ExpertCache):
            why = "no cache"
        elif self.budget.mode == "all" or self.budget.bytes >= self._expert_bytes:
            why = "the cache holds every expert"
        elif not isinstance(self.queue, NativeLaneQueue):
            why = "needs the C read lanes' queue (read-ahead or a prompt's read-ahead)"
        elif any(t.slice_bytes % PAGE for t in lay.experts):
            why = "an expert slice is not whole pages"
        elif lay.arch not in SLOT_ARCHS:
            why = f"not checked for {lay.arch or 'this family'}"
        if why:
            self.slots_note = f"off: {why}"
            return
        assert isinstance(self.cache, ExpertCache) and isinstance(self.queue, NativeLaneQueue)
        self.queue.lanes.exact = True
        supply = self.reader.supply if self.reader is not None else None
        if supply is not None and supply.enabled:
            # huge pages asked for: a slot's pages are committed once and read into at
            # every miss after, so their slower faults are paid once (no judgement)
            supply.once = True
            supply.note = "on: expert slots commit each slot's pages once"
        self._perm = np.tile(np.arange(lay.n_expert, dtype=np.int64), (lay.n_layer, 1))
        # the routing rewritten in C, where the native callback runs (numpy otherwise)
        self._slots_in_c = self.native is not None and self.native.slots(self._perm)
        per_round = sum(lay.unit_bytes(i) for i in self._layer_ids)
        self._slot_share = int(self.budget.bytes // max(1, per_round))
        self.slots_note = (f"on: {self._slot_share} experts a layer, the routing rewritten "
                           f"{'in C' if self._slots_in_c else 'with numpy'}")

    def _slot_admit(self, layer: int, ids: np.ndarray, spec: bool) -> Admission:
        """The cache's admission: a prompt's takes no room from the kept layers
        (`_start_prompt_keep`), a decode guess's takes it anywhere, and with slots on one
        token's experts are kept to the layer's own units; then each miss paired with a
        victim of its own layer takes over its slot."""
        cache = self.cache
        assert isinstance(cache, ExpertCache)
        perm = self._perm
        batch = len(ids) > self.layout.n_expert_used
        if self._in_prefill and self._prompt_keep is not None and (batch or perm is None):
            adm = cache.admit_keeping(layer, ids, self._prompt_keep, spec)
        elif perm is None or batch:
            adm = cache.admit_spec(layer, ids) if spec else cache.admit(layer, ids)
        else:
            adm = cache.admit_own(layer, ids, self._slot_share, spec)
        if perm is None:
            return adm
        own = [ve for vl, ve in adm.victims if vl == layer]
        self._slot_taken.clear()
        self._slot_in_place.clear()
        row = perm[layer]
        for e, v in zip(adm.misses.tolist(), own, strict=False):
            row[e], row[v] = row[v], row[e]
            self._slot_taken.add((layer, v))     # its pages stay, for e
            self._slot_in_place.add(e)
        self._slot_swaps += len(self._slot_in_place)
        return adm

    def _slot_rewrite(self, node: int, layer: int, k: int, n: int, row: int,
                      data: int) -> None:
        """The layer's routing, rewritten in place from experts to their slots, and the
        router's probabilities permuted to match (their gather reads them by the same
        ids after this)."""
        assert self._perm is not None
        if self._slots_in_c and self.native is not None:
            if self.native.rewrite(node, layer) != 0:
                raise RuntimeError(f"layer {layer}'s routing could not be rewritten to the "
                                   "expert slots (an unexpected layout or id)")
            return
        perm = self._perm[layer]
        probs_at, stride = self._probs_of(node)
        flat = np.ctypeslib.as_array(
            (ctypes.c_int32 * ((n - 1) * row // 4 + k)).from_address(data))
        ids = np.lib.stride_tricks.as_strided(flat, shape=(n, k), strides=(row, 4))
        ne = self.layout.n_expert
        pflat = np.ctypeslib.as_array(
            (ctypes.c_float * ((n - 1) * stride // 4 + ne)).from_address(probs_at))
        probs = np.lib.stride_tricks.as_strided(pflat, shape=(n, ne), strides=(stride, 4))
        out = np.empty((n, ne), dtype=np.float32)
        out[:, perm] = probs
        probs[:] = out
        ids[:] = perm[ids]

    def _check_slots(self, node: int) -> None:
        """The first routing seen: where the graph is not as expert slots expect, they
        go off for good, before any expert has left its own place."""
        self._slots_checked = True
        try:
            self._probs_of(node)
        except RuntimeError as e:
            assert self._perm is not None and not self._slot_swaps
            self._perm = None
            if self._slots_in_c and self.native is not None:
                self.native.slots(None)
            self._slots_in_c = False
            if isinstance(self.queue, NativeLaneQueue):
                self.queue.lanes.exact = bool(self._pack_kernels)   # repacked: still exact
            self.slots_note = f"off: {e}"

    def _probs_of(self, node: int) -> tuple[int, int]:
        """(address, row stride) of the router probabilities the routing node `node` was
        sorted from: topk is a view of argsort, whose source is ffn_moe_probs-<l>."""
        tt = ggml.tensor_at(node)
        arg = ggml.tensor_at(tt.view_src) if tt.view_src else None
        src = int(arg.src[0] or 0) if arg is not None else 0
        pt = ggml.tensor_at(src) if src else None
        if (pt is None or not ggml.name_of(src).startswith(b"ffn_moe_probs-")
                or int(pt.type) != ggml.GGML_TYPE_F32 or int(pt.ne[0]) != self.layout.n_expert
                or not pt.data or int(pt.nb[0]) != 4):
            raise RuntimeError("the router's probabilities are not where expert slots "
                               "expect them")
        return int(pt.data), int(pt.nb[1])

    def _start_prefill_ahead(self) -> None:
        """A prompt batch reads layer l+1's experts while layer l computes (see
        `_prefill_ahead`): the lanes on the queue, the next routers for the guess."""
        assert self.reader is not None
        if not isinstance(self.cache, ExpertCache):
            self.load_info["prefill_ahead"] = "off: no expert cache"
            return
        one = self._batch_layer_bytes(self.n_ubatch or 1)
        if self.budget.bytes < 2 * one:
            # the layer computing holds its set; the next one's would have no room
            self.load_info["prefill_ahead"] = (
                f"off: the cache ({self.budget.bytes / MIB:.0f} MiB) holds fewer than two "
                f"layers' experts of a prompt batch ({one / MIB:.0f} MiB each)")
            return
        if self.queue is None:
            self.queue = self.reader.start_queue()
        if self._spec.size == 0:
            self._spec = np.zeros((self.layout.n_layer, self.layout.n_expert), dtype=bool)
        routers = self.predictor.routers if self.predictor is not None else read_routers(
            self.layout)
        self._batch_routers = routers
        self._batch_biases = (self.predictor.biases if self.predictor is not None
                              else read_router_biases(self.layout))
        self.load_info["prefill_ahead"] = (
            f"the next layer's experts, guessed by its router ({len(routers)} of "
            f"{self.layout.n_layer} layers)" if routers else
            "the next layer's experts (every one, when a batch routes to that many)")

    def _start_page_reserve(self) -> None:
        """Commit the cache's pages in the background after the load (`PageSupply.reserve`),
        so that the first fill's misses take committed pages instead of faulting fresh
        ones in the read lanes: a server's first long prompt is the agent's prefix. The
        thread runs at the lowest CPU priority, to yield the cores to a prompt that comes
        first (on the gpt-oss-120b slice that prompt was level with and without it); its
        lanes fault in what is not committed yet. Not with huge pages (the supply commits
        those itself), nor in a cache that never turns over."""
        supply = self.reader.supply if self.reader is not None else None
        why = ""
        if os.environ.get(RESERVE_ENV, "1") == "0":
            why = f"off: {RESERVE_ENV}=0"
        elif not isinstance(self.cache, ExpertCache) or self.budget.bytes <= 0:
            why = "off: no expert cache"
        elif supply is None:
            why = "off: the cache does not turn over, or its pages are not recycled"
        elif supply.enabled:
            why = "off: huge pages commit the cache's pages"
        if why:
            self.load_info["page_reserve"] = why
            return
        assert supply is not None and isinstance(self.cache, ExpertCache)
        cache = self.cache

        def room() -> int:
            return (int(self.budget.bytes) - int(cache.resident_bytes) - supply.parked_bytes
                    - supply.reserve_left)

        def run() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
            t0 = time.monotonic()
            try:
                done, why = supply.reserve(room, self._reserve_stop)
            except Exception:       # never left at "committing": misses fault pages in
                done, why = supply.reserved_bytes, "stopped by an internal error"
            self.load_info["page_reserve"] = (
                f"{round(done / MIB)} MiB committed in {time.monotonic() - t0:.1f} s "
                f"({why})")

        self.load_info["page_reserve"] = "committing"
        self._reserve = threading.Thread(target=run, name="bmoe-reserve", daemon=True)
        self._reserve.start()

    def _start_prompt_keep(self) -> None:
        """Prompt batches keep the first streamed layers (`ExpertCache.admit_keeping`):
        as many as the cache holds beside two layers of a batch's experts (the layer
        computing and the next one read ahead). A long prompt's later ubatches then find
        those layers cached instead of reading every layer again, and so does the next
        prompt: its first layers compute at once (an agent's next request, its prefix
        cached, starts there). Off unless `BMOE_PROMPT_KEEP=1`: on the gpt-oss-120b slice
        it cut an agent's second request's reads by a quarter and its waits to nothing,
        yet that request took longer in 3 alternated pairs of runs (docs/benchmarks.md,
        session 34), for a reason not found yet."""
        lay = self.layout
        why = ""
        one = self._batch_layer_bytes(self.n_ubatch or 1)
        k = 0
        if os.environ.get(KEEP_ENV, "").strip().lower() not in ("1", "on", "yes", "true"):
            why = f"not asked for ({KEEP_ENV}=1)"
        elif not isinstance(self.cache, ExpertCache):
            why = "no cache"
        elif self.budget.mode == "all" or self.budget.bytes >= self._expert_bytes:
            why = "the cache holds every expert"
        else:
            k = min(len(self._layer_ids) - 1, self.budget.bytes // max(1, one) - 2)
            if k < 1:
                why = (f"the cache ({self.budget.bytes / MIB:.0f} MiB) holds fewer than three "
                       f"layers' experts of a prompt batch ({one / MIB:.0f} MiB each)")
        if why:
            self.keep_note = self.load_info["prompt_keeps"] = f"off: {why}"
            return
        keep = np.zeros(lay.n_layer, dtype=bool)
        keep[self._layer_ids[:k]] = True
        self._prompt_keep = keep
        first, last = self._layer_ids[0], self._layer_ids[k - 1]
        self.keep_note = (f"on: layer {first}" if k == 1 else f"on: layers {first}-{last}") \
            + f" ({k} of {len(self._layer_ids)}, {k * one / MIB:.0f} MiB)"
        self.load_info["prompt_keeps"] = self.keep_note

    def _settle_file_pages(self, fd: int) -> None:
        """Drop the expert pages llama.cpp's load brought in; pin the dense ones if asked."""
        assert self.mapping is not None
        size = self.layout.file_size
        self._dense_runs = page_runs(list(self.layout.dense), size)
        if self.dense_mode == "anon":
            self.load_info["dense_copied_mib"] = round(
                pin_anonymous(self.mapping, self._dense_runs, fd) / MIB, 1)
        interior = [(page_ceil(t.offset), page_floor(t.offset + t.nbytes))
                    for t in self.layout.experts]
        interior = [(a, b) for a, b in interior if b > a]
        drop_mapped(self.mapping, interior)
        for a, b in interior:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        if self.dense_mode == "anon":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _make_buffers(self) -> None:
        by_layer: dict[int, list[tuple[ExpertTensor, AnonBuffer]]] = {}
        for t in self.layout.experts:
            buf = AnonBuffer(t.offset, t.nbytes)
            self._buffers[t.name] = buf
            by_layer.setdefault(t.layer, []).append((t, buf))
            self._tensor_of[t.name.encode()] = t
        self._by_layer = {layer: tuple(v) for layer, v in by_layer.items()}
        self._unbound = set(self._tensor_of)
        # the same, as the C read planner takes it: rows (file offset, slice bytes, buffer
        # base, page phase, buffer size) layer by layer, and each layer's first row
        rows, starts = [], [0]
        for layer in range(self.layout.n_layer):
            rows += [(t.offset, t.slice_bytes, buf.base, buf.phase, buf.size)
                     for t, buf in self._by_layer.get(layer, ())]
            starts.append(len(rows))
        self._plan_table = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self._plan_starts = np.array(starts, dtype=np.int64)

    def _load_all(self) -> None:
        assert self.reader is not None and isinstance(self.cache, ExpertCache)
        reads = []
        for t in self.layout.experts:
            buf = self._buffers[t.name]
            start = t.offset
            while start < t.offset + t.nbytes:
                end = min(t.offset + t.nbytes, page_floor(start + _LOAD_ALL_CHUNK))
                if end <= start:
                    end = t.offset + t.nbytes
                dst, n = buf.interior(start - t.offset, end - t.offset)
                fresh = ((FRESH, dst, n),) if n and self.reader.supply is not None else ()
                reads.append(Read(start, end - start, buf, start - t.offset, fresh))
                start = end
        n, secs = self.reader.read_all(reads)
        for t in self.layout.experts:
            self._pack_slices(t, 0, t.n_expert)
        self.cache.fill()
        self.load_info.update(load_all_mib=round(n / MIB, 1), load_all_s=round(secs, 3))

    # -- the graph callback -----------------------------------------------------------

    def _eval(self, t: int, ask: bool, _user: Any) -> bool:
        try:
            if ask:
                op = ggml.op_of(t)
                if op == ggml.GGML_OP_VIEW:
                    name = ggml.name_of(t)
                    return name.startswith(_TOPK) and self._is_local(name)
                if op == ggml.GGML_OP_MUL_MAT_ID and self._unbound:
                    self._bind(t)
                return False
            self._route(t)
            return True
        except BaseException as e:  # noqa: BLE001 - nothing may raise through llama.cpp
            self._fail(e)
            return False

    def _fail(self, e: BaseException) -> None:
        """Record the first failure of this graph (a read's own message is for a person)."""
        if self._failure is None:
            self._failure = (e.message if isinstance(e, ReadError)
                             else f"Expert streaming failed: {e}")

    def file_problem(self) -> str | None:
        """Why the model file cannot be streamed from any more, if it cannot: a read
        timed out (the reader is broken), or the file at the model's path (or its packed
        experts file, where the experts are read from it) is not the one loaded
        (replaced, cut short, or written over since). Checked before each turn."""
        reader = self.reader
        if reader is None:
            return None
        if reader.broken is not None:
            return reader.broken.message
        if self._file_id is not None:
            why = _changed(str(self.path), self._file_id)
            if why:
                return why
        if self._packed_id is not None:
            why = _changed(reader.path, self._packed_id, "packed experts file")
            if why:
                return why
        return None

    def _is_local(self, topk_name: bytes) -> bool:
        """Whether the layer of an `ffn_moe_topk-<l>` node is held here (not by a helper)."""
        if self.local_below is None:
            return True
        tail = topk_name[len(_TOPK):]
        return tail.isdigit() and int(tail) < self.local_below

    def _bind_native(self, node: int) -> int:
        """The native callback's MUL_MAT_ID ask: rebind; how many tensors remain unbound
        (at 0 the C side stops asking). A failure is recorded and keeps it asking."""
        try:
            if self._unbound:
                self._bind(node)
            return len(self._unbound)
        except BaseException as e:  # noqa: BLE001 - nothing may raise through llama.cpp
            self._fail(e)
            return max(1, len(self._unbound))

    def _route_native(self, node: int, layer: int, k: int, n: int, row: int,
                      data: int) -> bool:
        """The native callback's data phase of `ffn_moe_topk-<layer>`; false stops the graph."""
        try:
            if layer < 0:
                raise RuntimeError(f"unexpected routing node {ggml.name_of(node)!r}")
            self._routed(node, layer, k, n, row, data)
            if not self._native_resident and self._all_resident_for_good():
                self._enter_resident()
            return True
        except BaseException as e:  # noqa: BLE001 - nothing may raise through llama.cpp
            self._fail(e)
            return False

    def _all_resident_for_good(self) -> bool:
        """Every expert is in memory and nothing will evict or read one: the model fits
        the cache, no read-ahead, every tensor rebound (asked per routed layer until it
        holds: the cheap checks first, the layout's figures read once at attach)."""
        cache = self.cache
        return (isinstance(cache, ExpertCache) and self.predictor is None
                and not self._unbound and self.budget.bytes >= self._expert_bytes
                and bool(cache.resident[self._layer_ids].all()) and not cache.pinned.any())

    def _enter_resident(self) -> None:
        """Let the native callback count the routings itself (no Python per layer)."""
        assert self.native is not None
        self._native_resident = self.native.resident(True, self.layout.n_layer,
                                                      self.layout.n_expert)
        if self._native_resident:      # a routing record is written in C from now on
            self._rec_rows = np.full((self.layout.n_layer, self.layout.n_expert_used), -1,
                                     dtype=np.int32)
            if not self.native.record(self._rec_rows):
                self.native.resident(False)
                self._native_resident = False

    def _leave_resident(self) -> None:
        if self._native_resident and self.native is not None:
            self._fold_resident()
            self.native.resident(False)
            self.native.record(None)
            self._native_resident = False

    def _native_routing_row(self) -> None:
        """The layers the native callback routed this token, into ``_route_row``."""
        rows = self._rec_rows
        if rows is None:
            return
        for layer in np.flatnonzero(rows[:, 0] >= 0):
            self._route_row.setdefault(int(layer), rows[layer].copy())

    def _fold_resident(self) -> None:
        """Credit the hits the native callback counted on its own to the cache and the
        current counters (every routed expert was resident: all hits)."""
        if not self._native_resident or self.native is None:
            return
        total = int(self.native.stats()["resident_hits"])
        hits, self._folded_hits = total - self._folded_hits, total
        if hits and isinstance(self.cache, ExpertCache):
            self.cache.hits += hits
            for c in (self._turn if self._in_prefill else self._token, self._total):
                c.hits += hits

    def _bind(self, node: int) -> None:
        weight = ggml.tensor_at(node).src[0]
        name = ggml.name_of(weight)
        if name not in self._unbound:
            return
        t = self._tensor_of[name]
        slot = ctypes.c_void_p.from_address(weight + ggml.OFF_DATA)
        assert self.mapping is not None
        if slot.value != self.mapping.base + t.offset:
            raise RuntimeError(f"{t.name} is not at its file offset in llama.cpp's mapping "
                               "(was the model loaded with repacking buffer types?)")
        slot.value = self._buffers[t.name].data
        kernels = self._pack_kernels.get(name)
        if kernels:
            packer().adopt(weight, kernels)
        self._unbound.discard(name)

    def _route(self, node: int) -> None:
        tt = ggml.tensor_at(node)
        layer = int(ggml.name_of(node)[len(_TOPK):])
        self._routed(node, layer, int(tt.ne[0]), int(tt.ne[1]), int(tt.nb[1]), tt.data or 0)

    def _routed(self, node: int, layer: int, k: int, n: int, row: int, data: int) -> None:
        """Layer `layer`'s routing, I32 [k, n] with rows `row` bytes apart at `data`."""
        ub = self._ub
        if (self._last_cut is None and ub is not None and ub[1] < ub[0]
                and layer == self.layout.n_layer - 1):
            self._last_cut = n <= ub[1]
        if n == 0 or k == 0:
            return        # the last layer of a prefill chunk that outputs no logits
        if not data or row < 4 * k or row % 4:
            raise RuntimeError(f"layer {layer}'s routing has an unexpected layout")
        if n == 1:        # a decode step: a few ids, cheaper as a list than through numpy
            one = (ctypes.c_int32 * k).from_address(data)[:]
            ids = np.array([one], dtype=np.int32)
            used = np.array(sorted(set(one)), dtype=np.int32)
        else:
            flat = np.ctypeslib.as_array(
                (ctypes.c_int32 * ((n - 1) * row // 4 + k)).from_address(data))
            ids = np.lib.stride_tricks.as_strided(flat, shape=(n, k), strides=(row, 4)).copy()
            used = np.unique(ids)
        if used[0] < 0 or used[-1] >= self.layout.n_expert:
            raise RuntimeError(f"layer {layer} routed to expert ids outside "
                               f"0..{self.layout.n_expert - 1}")
        if self.record_routing and n == 1:
            self._route_row[layer] = ids[0]
        if self._perm is not None and not self._slots_checked:
            self._check_slots(node)
        self.ensure(layer, used)
        if self._batch_routers is not None and n > 1:
            if self._layer_ids and layer == self._layer_ids[0]:
                self._take_ubatch(n)
            self._prefill_ahead(layer, node, n)
        if self.predictor is not None and n == 1:
            self.predictor.last[layer] = ids[0].astype(np.int64)
            self._read_ahead(layer, node)
        if self._perm is not None:
            self._slot_rewrite(node, layer, k, n, row, data)

    def ensure(self, layer: int, ids: np.ndarray) -> Admission:
        """Make experts `ids` of `layer` resident (the cache's hits, reads for its misses)."""
        if self.reader is not None:
            self.reader.check()          # a read timed out before: nothing reads any more
        if self.queue is not None:
            return self._ensure_queued(layer, ids)
        assert self.cache is not None and self.reader is not None
        t0 = time.perf_counter()
        adm = self._slot_admit(layer, ids, False) if isinstance(self.cache, ExpertCache) \
            else self.cache.admit(layer, ids)
        spare = self._victim_pages(adm.victims)
        reads = self._reads_for(layer, adm.misses, spare)
        for length, pages in spare.items():      # victims whose pages no miss took over
            for buf, addr in pages:
                buf.release_at(addr, length)
        t1 = time.perf_counter()
        try:
            nbytes, io_s = self.reader.read_all(reads)
        except BaseException:
            self._forget(layer, adm.misses)
            raise
        if self._pack_rows:        # no cache here (`_start_packs`): every miss read whole
            for t, _buf in self._by_layer.get(layer, ()):
                for e in adm.misses.tolist():
                    self._pack_slices(t, e, e + 1)
        self._count(t1 - t0, io_s, nbytes, adm)
        return adm

    # -- read-ahead ------------------------------------------------------------------

    def _ensure_queued(self, layer: int, ids: np.ndarray) -> Admission:
        """`ensure` with the lanes on the queue: wait for guesses in flight, read the rest
        at priority 0."""
        assert isinstance(self.cache, ExpertCache) and self.queue is not None
        t0 = time.perf_counter()
        self._sweep()
        waits = [g for e in ids.tolist()
                 if (g := self._pending_out.get((layer, e))) is not None and not g.finished()]
        for g in waits:              # a miss whose old pages a queued read still takes
            self.queue.promote(g)
        self._wait(waits)
        adm = self._slot_admit(layer, ids, False)
        c = self._token if not self._in_prefill else self._turn
        self._score_guess(layer, ids, c)
        used = self._spec[layer, ids]
        for cc in (c, self._total):
            cc.spec_useful += int(used.sum())
        self._spec[layer, ids] = False
        waits = [g for e in ids.tolist() if (g := self._inflight.get((layer, e))) is not None]
        self._note_victims(adm.victims, c)
        mine: list[QueuedGroup]
        if self._planned:
            mine, _ = self._plan_submit(layer, adm.misses, adm.victims, False, 0)
            t1 = time.perf_counter()
        else:
            spare = self._victim_pages(adm.victims)
            reads = self._reads_for(layer, adm.misses, spare)
            for length, pages in spare.items():
                for buf, addr in pages:
                    buf.release_at(addr, length)
            t1 = time.perf_counter()
            mine = [self.queue.submit(reads, 0)]
        for g in waits:
            self.queue.promote(g)
        failed = self._wait([*mine, *waits])
        stall = time.perf_counter() - t1
        if failed is not None:
            self._forget(layer, adm.misses)
            self._sweep()
            raise failed
        self._count(t1 - t0, stall, sum(g.nbytes for g in mine), adm)
        for cc in (c, self._total):
            cc.stall_s += stall
        return adm

    def _wait(self, groups: list[QueuedGroup]) -> BaseException | None:
        """Wait for `groups`; a group not done within the reader's timeout breaks it."""
        assert self.reader is not None and self.queue is not None
        if not self.queue.wait(groups, self.reader.timeout_s):
            return self.reader.give_up()
        return next((g.error for g in groups if g.error is not None), None)

    def _score_guess(self, layer: int, ids: np.ndarray, c: _Counters) -> None:
        guess = self._guess.pop(layer, None)
        if guess is None:
            return
        routed = set(ids.tolist())
        hit = sum(e in routed for e in guess.tolist())
        for cc in (c, self._total):
            cc.guessed += len(guess)
            cc.guess_hits += hit
            cc.routed += len(ids)

    def _note_victims(self, victims: list[tuple[int, int]], c: _Counters) -> None:
        """Guesses evicted before any routing used them: wasted reads."""
        for vl, ve in victims:
            if self._spec[vl, ve]:
                self._spec[vl, ve] = False
                for cc in (c, self._total):
                    cc.spec_wasted_bytes += self.layout.unit_bytes(vl)

    def _read_ahead(self, layer: int, node: int) -> None:
        """Guess the next layers' experts (in C when the native callback guesses: it has
        made them before this routing reached Python) and queue reads of those the cache
        lacks."""
        assert self.predictor is not None and self.queue is not None
        t0 = time.perf_counter()
        c = self._turn if self._in_prefill else self._token
        rows = self.native.guess_rows if self.native is not None else None
        if rows is not None and not self.predictor.invert:
            guesses = self.predictor.from_rows(layer, rows)
        else:
            guesses = self.predictor.guesses(layer, router_input(ggml.tensor_at(node), layer))
        groups = []
        for j, guess in guesses:
            self._guess[j] = guess
            groups += self._queue_guess(j, guess, 1 + j - layer, c)
        for cc in (c, self._total):
            cc.mgmt_s += time.perf_counter() - t0
        if not self.overlap and groups:
            t1 = time.perf_counter()
            self._wait(groups)
            for cc in (c, self._total):
                cc.io_s += time.perf_counter() - t1
            self._sweep()

    def _prefill_ahead(self, layer: int, node: int, n: int) -> None:
        """A prompt batch's layer `layer` has its experts: queue the reads of the next
        layer's, guessed for the whole batch (`predict.batch_guess`), and return, so
        that they are read while this layer computes; the next layer's routing waits
        only for what is still in flight. Room is made without touching this layer's
        experts (the cache's `admit_spec`); what does not fit is read on demand. At the
        last layer, where it runs every row (`_last_cut` False), the next ubatch's first
        layer is queued instead."""
        assert self._batch_routers is not None and self.queue is not None
        nxt = next((j for j in self._layer_ids if j > layer), None)
        t0 = time.perf_counter()
        c = self._turn if self._in_prefill else self._token
        ub = self._ub
        if nxt is None:         # the last layer, running every row: the next ubatch's
            if ub is not None and ub[2] and self._last_cut is False:     # first layer
                self._ahead_first(ub[2])
                for cc in (c, self._total):
                    cc.mgmt_s += time.perf_counter() - t0
            return
        if ub is not None and nxt == self.layout.n_layer - 1 and self._last_cut is not False:
            # llama.cpp's last layer runs only the batch's output rows (its last ones), in
            # most families (`_last_cut`)
            n = ub[1]
            if n == 0:          # none: nothing to read for it; the next ubatch's first
                if ub[2]:       # layer instead, while this one finishes
                    self._ahead_first(ub[2])
                for cc in (c, self._total):
                    cc.mgmt_s += time.perf_counter() - t0
                return
        router = self._batch_routers.get(nxt)
        h = router_rows(ggml.tensor_at(node), layer) if router is not None else None
        if h is not None and n < len(h):
            h = h[len(h) - n:]
        guess = batch_guess(router, h, self.layout.n_expert_used, self.layout.n_expert, n,
                            self._batch_biases.get(nxt))
        if len(guess):
            self._guess[nxt] = guess
            self._queue_guess(nxt, guess, 1, c)
        for cc in (c, self._total):
            cc.mgmt_s += time.perf_counter() - t0

    def _take_ubatch(self, n: int) -> None:
        """A prompt batch of `n` tokens reached the first streamed layer: the ubatch
        `batch_begin` announced, if it is that one (else the announcements are dropped)."""
        if self._ubatches and self._ubatches[0][0] == n:
            self._ub = self._ubatches.pop(0)
        else:
            self._ubatches.clear()
            self._ub = None

    def _ahead_first(self, n: int) -> None:
        """Queue the first streamed layer's experts for a coming ubatch of `n` tokens,
        before any of its routing is known: every expert, when the batch routes to at least
        twice as many choices as the layer has (a uniform routing then uses 86 % of them,
        a 500-token batch with top-4 of 128 all but none); else nothing."""
        lay = self.layout
        if not self._layer_ids or n * lay.n_expert_used < 2 * lay.n_expert:
            return
        j = self._layer_ids[0]
        guess = np.arange(lay.n_expert, dtype=np.int64)
        self._guess[j] = guess
        self._queue_guess(j, guess, 1, self._turn if self._in_prefill else self._token)

    def _queue_guess(self, j: int, guess: np.ndarray, prio: int,
                     c: _Counters) -> list[QueuedGroup]:
        """Admit layer `j`'s guessed experts the cache lacks (as far as room can be made)
        and queue one read group per expert at `prio`, pinned until read."""
        assert self.queue is not None and isinstance(self.cache, ExpertCache)
        todo = [e for e in guess.tolist() if (j, e) not in self._inflight
                and (j, e) not in self._pending_out]
        if not todo:
            return []
        groups: list[QueuedGroup] = []
        adm = self._slot_admit(j, np.array(todo, dtype=np.int64), True)
        self._note_victims(adm.victims, c)
        for cc in (c, self._total):
            cc.evictions += len(adm.victims)
        if self._planned:            # queued, and one lane woken, by the one call
            groups, taken = self._plan_submit(j, adm.misses, adm.victims, True, prio)
            pinned, inflight, pending = self.cache.pinned, self._inflight, self._pending_out
            for e, g, units in zip(adm.misses.tolist(), groups, taken, strict=True):
                inflight[(j, e)] = g
                pinned[j, e] = True
                for u in units:          # victims whose pages these reads take
                    pending[u] = g
            self._spec[j, adm.misses] = True
            return groups
        spare = self._victim_pages(adm.victims)
        for e in adm.misses.tolist():
            reads = self._reads_for(j, np.array([e]), spare)
            g = self.queue.submit(reads, prio, wake=False)
            self._inflight[(j, e)] = g
            self.cache.pinned[j, e] = True
            self._spec[j, e] = True
            self._note_pending(reads, g)
            groups.append(g)
        for length, pages in spare.items():
            for buf, addr in pages:
                buf.release_at(addr, length)
        if groups:
            self.queue.wake()        # one wake-up; the lanes wake each other for the rest
        return groups

    def _note_pending(self, reads: list[Read], g: QueuedGroup) -> None:
        """The units whose pages `reads` take over (from the last `_victim_pages`) wait
        for `g` before anything is read into them again."""
        for r in reads:
            for src, _, _ in r.moves:
                if src != FRESH:
                    self._pending_out[self._unit_at(src)] = g

    def _unit_at(self, addr: int) -> tuple[int, int]:
        """The (layer, expert) whose interior pages start at `addr`."""
        return self._src_unit[addr]

    def _sweep(self) -> None:
        """Unpin the guesses whose reads are done; a failed one is simply not resident."""
        assert isinstance(self.cache, ExpertCache)
        done = [u for u, g in self._inflight.items() if g.finished()]
        c = self._token if not self._in_prefill else self._turn
        for u in done:
            g = self._inflight.pop(u)
            self.cache.pinned[u] = False
            if g.error is not None:
                self._spec[u] = False
                self._filling.discard(u)
                self._forget(u[0], np.array([u[1]]))
                continue
            if u in self._filling:            # background fill: no token's read
                self._filling.discard(u)
                self._fill_bytes += g.nbytes
                self._total.read_bytes += g.nbytes
                continue
            for cc in (c, self._total):
                cc.spec_bytes += g.nbytes
                cc.read_bytes += g.nbytes
                cc.spec_units += 1
        for u in [u for u, g in self._pending_out.items() if g.finished()]:
            del self._pending_out[u]

    def _victim_pages(self, victims: list[tuple[int, int]]
                      ) -> dict[int, list[tuple[AnonBuffer, int]]]:
        """The victims' interior pages, by length: to hand on to misses, or to free."""
        spare: dict[int, list[tuple[AnonBuffer, int]]] = {}
        self._src_unit.clear()
        perm = self._perm
        for vl, ve in victims:
            if perm is not None and (vl, ve) in self._slot_taken:
                continue                         # a miss reads into its slot as it is
            at = int(perm[vl, ve]) if perm is not None else ve
            for t, buf in self._by_layer.get(vl, ()):
                s = t.slice_bytes
                addr, n = buf.interior(at * s, (at + 1) * s)
                if n:
                    spare.setdefault(n, []).append((buf, addr))
                    self._src_unit[addr] = (vl, ve)
        return spare

    def _reads_for(self, layer: int, misses: np.ndarray,
                   spare: dict[int, list[tuple[AnonBuffer, int]]]) -> list[Read]:
        """One read per run of consecutive missed experts in each expert tensor of `layer`;
        each slice takes over a victim's pages where one is spare (moved in the lane)."""
        if not len(misses):
            return []
        if self._perm is not None:
            return self._slot_reads(layer, misses, spare)
        runs: list[list[int]] = []
        for e in misses.tolist():
            if runs and runs[-1][1] == e:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        recycle = self.reader is not None and self.reader.recycle
        fresh = self.reader is not None and self.reader.supply is not None
        reads = []
        for t, buf in self._by_layer.get(layer, ()):
            s = t.slice_bytes
            for e0, e1 in runs:
                moves: list[tuple[int, int, int]] = []
                for e in range(e0, e1) if recycle else ():
                    moves += _slice_moves(buf, e * s, (e + 1) * s, spare, fresh)
                reads.append(Read(t.offset + e0 * s, (e1 - e0) * s, buf, e0 * s, tuple(moves)))
        return reads

    def _slot_reads(self, layer: int, misses: np.ndarray,
                    spare: dict[int, list[tuple[AnonBuffer, int]]]) -> list[Read]:
        """`_reads_for` with expert slots: one read per missed slice, into its slot; a
        miss that took over a victim's slot reads over its pages as they are, the others
        take spare pages (a victim of another layer's) or fresh ones as `_reads_for`."""
        assert self._perm is not None
        row = self._perm[layer]
        recycle = self.reader is not None and self.reader.recycle
        fresh = self.reader is not None and self.reader.supply is not None
        reads = []
        for t, buf in self._by_layer.get(layer, ()):
            s = t.slice_bytes
            for e in misses.tolist():
                at = int(row[e])
                moves: list[tuple[int, int, int]] = []
                if e not in self._slot_in_place and recycle:
                    moves = _slice_moves(buf, at * s, (at + 1) * s, spare, fresh)
                reads.append(Read(t.offset + e * s, s, buf, at * s, tuple(moves)))
        return reads

    def _forget(self, layer: int, ids: np.ndarray) -> None:
        """Reads of `ids` failed: they are not resident, and their pages go back."""
        if isinstance(self.cache, ExpertCache):
            self.cache.resident[layer, ids] = False
            self.cache.resident_bytes -= int(self.cache.unit_bytes[layer]) * len(ids)
        elif isinstance(self.cache, NoCache):
            self.cache.forget(layer)
        perm = self._perm
        for t, buf in self._by_layer.get(layer, ()):
            s = t.slice_bytes
            for e in ids.tolist():
                at = int(perm[layer, e]) if perm is not None else e
                buf.release(at * s, (at + 1) * s)

    def _count(self, mgmt_s: float, io_s: float, nbytes: int, adm: Admission) -> None:
        for c in (self._turn if self._in_prefill else self._token, self._total):
            c.mgmt_s += mgmt_s
            c.io_s += io_s
            c.read_bytes += nbytes
            c.hits += adm.hits
            c.misses += len(adm.misses)
            c.evictions += len(adm.victims) if self.budget.bytes else 0
            c.rereads += adm.rereads
            c.experts_read += len(adm.misses)

    # -- Streamer protocol: per token and per turn ------------------------------------

    def prefill_begin(self) -> None:
        self._turn = _Counters()
        self._in_prefill = True
        self._ubatches.clear()
        self._ub = None

    def batch_begin(self, n_tokens: int, n_outputs: int, n_after: int) -> None:
        """Session.decode's chunk about to run: `n_tokens` tokens, the last `n_outputs` of
        them with logits, `n_after` tokens of the same prompt in later chunks. llama.cpp
        splits a chunk of one sequence into ubatches of n_ubatch in order. A prompt's
        read-ahead (`_prefill_ahead`) then reads nothing for the rows the model's last
        layer skips (it runs only the output rows), and reads each ubatch's first layer
        before its routing: from the chunk's start, and while the ubatch before it computes
        its last layers."""
        self._ubatches.clear()
        self._ub = None
        if n_tokens <= 1 or self._batch_routers is None or self.queue is None:
            return
        try:
            ub = self.n_ubatch if self.n_ubatch > 0 else n_tokens
            first_out = n_tokens - max(0, min(n_outputs, n_tokens))
            starts = list(range(0, n_tokens, ub))
            for s in starts:
                e = min(n_tokens, s + ub)
                after = min(ub, n_tokens - e) if e < n_tokens else min(ub, max(0, n_after))
                self._ubatches.append((e - s, max(0, e - max(s, first_out)), after))
            t0 = time.perf_counter()
            self._ahead_first(self._ubatches[0][0])
            c = self._turn if self._in_prefill else self._token
            for cc in (c, self._total):
                cc.mgmt_s += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - read at routing, as any failure
            self._fail(e)

    def prefill_end(self) -> None:
        self._fold_resident()
        self._in_prefill = False
        self._ubatches.clear()
        self._ub = None

    def token_begin(self) -> None:
        self._token = _Counters()
        self._route_row.clear()
        if self._rec_rows is not None:
            self._rec_rows.fill(-1)
        self._guess.clear()
        if self.queue is not None:
            self._busy_at = self.queue.busy_s

    def token_end(self) -> dict[str, Any]:
        self._fold_resident()
        c = self._token
        if self.record_routing and self._native_resident:
            self._native_routing_row()
        if self.record_routing and self._route_row:
            rows = self._route_row
            self.routing.append(np.array([rows[layer] for layer in sorted(rows)]))
        overlap = self.queue is not None and self.overlap
        io_s = self.queue.busy_s - self._busy_at if overlap and self.queue else c.io_s
        return {
            "io_ms": round(io_s * 1000.0, 3),
            "stall_ms": round(c.stall_s * 1000.0, 3) if overlap else 0.0,
            "mgmt_ms": round(c.mgmt_s * 1000.0, 3),
            "overlap": overlap,
            "read_mib": round(c.read_bytes / MIB, 4),
            "experts_read": c.experts_read,
            "cache_hit_pct": self._hit_pct(),
            "cache_budget_mib": round(self.budget.bytes / MIB, 1),
            "cache_resident_mib": round(self._resident_bytes() / MIB, 1),
            "evictions": c.evictions,
            "rereads": c.rereads,
            "dense_resident_frac": self.dense_resident_frac(),
            "odirect": bool(self.reader and self.reader.odirect),
            **self._spec_figures(c),
        }

    def _spec_figures(self, c: _Counters) -> dict[str, Any]:
        if self.predictor is None and self._batch_routers is None:
            return {}
        return {
            "spec_read_mib": round(c.spec_bytes / MIB, 4),
            "spec_wasted_mib": round(c.spec_wasted_bytes / MIB, 4),
            "spec_prefetched": c.spec_units,
            "spec_useful": c.spec_useful,
            "spec_recall_pct": _pct(c.guess_hits, c.routed),
            "spec_precision_pct": _pct(c.guess_hits, c.guessed),
        }

    def summary(self) -> dict[str, Any]:
        self._fold_resident()
        cache = self.cache
        total = self._total
        return {
            "cache_hit_pct": self._hit_pct(),
            "prefill_read_mib": round(self._turn.read_bytes / MIB, 3),
            "prefill_io_s": round(self._turn.io_s, 4),
            "prefill_ahead": self._batch_routers is not None,
            "prefill_ahead_mib": round(self._turn.spec_bytes / MIB, 3),
            "prefill_stall_s": round(self._turn.stall_s, 4),
            "overlap": self.queue is not None and self.overlap,
            "prefetch": self.prefetch if self.predictor is not None else 0,
            "spec_gate": self.spec_gate,
            "spec_recall_pct": (_pct(total.guess_hits, total.routed)
                                if self.predictor is not None else -1),
            "spec_precision_pct": (_pct(total.guess_hits, total.guessed)
                                   if self.predictor is not None else -1),
            "spec_read_mib": round(total.spec_bytes / MIB, 2),
            "spec_prefetched": total.spec_units,
            "spec_useful": total.spec_useful,
            "spec_wasted_mib": round(total.spec_wasted_bytes / MIB, 2),
            "cache_fill": self._fill_state(),
            "cache_fill_read_mib": round(self._fill_bytes / MIB, 1),
            "cache_policy": self.cache.policy if isinstance(self.cache, ExpertCache) else "",
            "cache_resident_mib": round(self._resident_bytes() / MIB, 1),
            "cache_budget_mib": round(self.budget.bytes / MIB, 1),
            "cache_mode": self.budget.mode,
            "cache_evictions": cache.evictions if isinstance(cache, ExpertCache) else 0,
            "cache_rereads": cache.rereads if isinstance(cache, ExpertCache) else 0,
            "cache_discarded": 0,
            "token_demand_mib": round(self.layout.token_cycle_bytes / MIB, 2),
            "session_read_mib": round(total.read_bytes / MIB, 2),
            "odirect": bool(self.reader and self.reader.odirect),
            "odirect_fallback": self.reader.fallback_reason if self.reader else "",
            "io_threads": self.reader.lanes if self.reader else 0,
            "huge_pages": bool(self.reader and self.reader.supply
                               and self.reader.supply.enabled),
            "huge_pages_mib": round(self.reader.supply.given_bytes / MIB, 1)
            if self.reader and self.reader.supply else 0.0,
            "huge_pages_note": self.reader.supply.note
            if self.reader and self.reader.supply else "",
            "pages_reused_mib": round(self.reader.supply.reused_bytes / MIB, 1)
            if self.reader and self.reader.supply else 0.0,
            "pages_reserved_mib": round(self.reader.supply.reserve_given_bytes / MIB, 1)
            if self.reader and self.reader.supply else 0.0,
            "expert_slots": self.slots_note,
            "prompt_keeps": self.keep_note,
            "slot_swaps": self._slot_swaps,
            "dense_weights": self.dense_mode,
            "dense_resident_frac": self.dense_resident_frac(),
        }

    def _fill_state(self) -> str:
        """off (no background fill), filling, or done."""
        if not self._fill_units:
            return "off"
        busy = any(not g.finished() for u in list(self._filling)
                   if (g := self._inflight.get(u)) is not None)
        return "filling" if busy else "done"

    def stats(self) -> dict[str, Any]:
        """Totals since load (for benchmarks and tests; per-token figures are token_end's)."""
        self._fold_resident()
        c = self._total
        return {"read_bytes": c.read_bytes, "io_s": c.io_s, "mgmt_s": c.mgmt_s,
                "stall_s": c.stall_s, "spec_bytes": c.spec_bytes,
                "spec_units": c.spec_units, "spec_useful": c.spec_useful,
                "spec_wasted_bytes": c.spec_wasted_bytes, "guessed": c.guessed,
                "guess_hits": c.guess_hits, "routed": c.routed,
                "lane_busy_s": self.queue.busy_s if self.queue else 0.0,
                "hits": c.hits, "misses": c.misses, "evictions": c.evictions,
                "rereads": c.rereads, "resident_bytes": self._resident_bytes(),
                "budget_bytes": self.budget.bytes,
                "moved_bytes": self.reader.moved_bytes if self.reader else 0,
                "fresh_bytes": self.reader.supply.given_bytes
                if self.reader and self.reader.supply else 0,
                **self._callback_stats()}

    def _callback_stats(self) -> dict[str, Any]:
        """The native callback's counts: every node's ask (answered in C) and the calls
        into Python (MUL_MAT_ID asks while binding, one routing per MoE layer)."""
        if self.native is None:
            return {}
        st = self.native.stats()
        return {"cb_asks": st["asks"], "cb_bind_calls": st["bind_calls"],
                "cb_route_calls": st["route_calls"], "cb_binding": st["binding"],
                "cb_resident_routes": st["resident_routes"], "cb_resident": st["resident"],
                "cb_guessed": st["guessed"], "cb_guess_missing": st["guess_missing"]}

    def failure(self) -> str | None:
        """The message of a failure inside the graph callback since the last call, if any."""
        message, self._failure = self._failure, None
        return message

    def _hit_pct(self) -> float:
        return self.cache.hit_pct if isinstance(self.cache, ExpertCache) else -1

    def _resident_bytes(self) -> int:
        return int(self.cache.resident_bytes) if self.cache is not None else 0

    def dense_resident_frac(self) -> float:
        now = time.monotonic()
        if self.mapping is not None and now - self._dense_at >= _DENSE_SAMPLE_S:
            self._dense_at = now
            try:
                self._dense_frac = round(resident_fraction(self.mapping, self._dense_runs), 4)
            except OSError:
                self._dense_frac = -1.0
        return self._dense_frac

    def _end_load(self) -> None:
        if self._populating:
            nopopulate.end(self.path)
            self._populating = False

    def close(self) -> None:
        self._end_tap()
        self._end_load()
        self._reserve_stop.set()
        if self._reserve is not None:
            self._reserve.join()         # one chunk at most: then the supply may close
            self._reserve = None
        self.queue = None
        if self.reader is not None:
            # the buffers close after the reader's lanes (later, if a read is stuck)
            self.reader.close(list(self._buffers.values()))
            self.reader = None
        else:
            for buf in self._buffers.values():
                buf.close()
        self._buffers.clear()
        self._by_layer.clear()


def _slice_moves(buf: AnonBuffer, start: int, end: int,
                 spare: dict[int, list[tuple[AnonBuffer, int]]],
                 fresh: bool) -> list[tuple[int, int, int]]:
    """The page moves that commit the interior of `buf[start:end]` before its read: a
    victim's spare pages where one fits (`take_spare`), fresh ones from the supply for
    the rest when there is one."""
    dst, n = buf.interior(start, end)
    taken = take_spare(spare, n) if n else None
    moves: list[tuple[int, int, int]] = []
    m = 0
    if taken is not None:
        src, m = taken
        moves.append((src, dst, m))
    if n > m and fresh:
        moves.append((FRESH, dst + m, n - m))
    return moves


def take_spare(spare: dict[int, list[tuple[AnonBuffer, int]]], n: int) -> tuple[int, int] | None:
    """A victim's pages for a slice whose interior pages are `n` bytes: (address, bytes to
    move), or None when no victim is spare. One of the same length first; else the
    nearest larger one (its pages past `n` are freed here: handing them on would make two
    queued reads take pages of one victim, which the streamer's `_pending_out` cannot
    wait for); else the largest smaller one (the slice's other pages are fresh or faulted
    in by the read). A slice's interior is a page longer or shorter with its phase in the
    file (gpt-oss-120b's 4.2 MiB slices have 1,074 or 1,075 pages): taking only equal
    lengths freed half the victims and took fresh pages for half the misses, every token.
    """
    pages = spare.get(n)
    if pages:
        return pages.pop()[1], n
    lengths = [k for k, v in spare.items() if v]
    if not lengths:
        return None
    larger = [k for k in lengths if k > n]
    k = min(larger) if larger else max(lengths)
    buf, src = spare[k].pop()
    if k > n:
        buf.release_at(src + n, k - n)
        return src, n
    return src, k


def _needs_info(b: Budget) -> dict[str, Any]:
    n = b.needs
    return {"n_ubatch": n.n_ubatch, "compute_mib": round(n.compute / MIB, 2),
            "compute_source": n.compute_source, "batch_layer_mib": round(n.batch_layer / MIB, 1),
            "edges_mib": round(n.edges / MIB, 1), "runtime_mib": round(n.runtime / MIB, 1),
            "kv_mib": round(n.kv / MIB, 1) if n.kv is not None else None,
            "available_mib": round(b.available / MIB, 1), "peak_mib": round(b.peak / MIB, 1)}


def _pct(a: int, b: int) -> float:
    return round(100.0 * a / b, 2) if b else -1.0


def _changed(path: str, file_id: tuple[int, int, int], kind: str = "model file") -> str | None:
    """Why the file at `path` is no longer the one with `file_id` (inode, size, mtime),
    or None while it is."""
    try:
        now = os.stat(path)
    except OSError as e:
        return (f"The {kind} {path} cannot be read any more "
                f"({e.strerror}). Put it back and load the model again.")
    ino, size, mtime = file_id
    if (now.st_ino, now.st_size, now.st_mtime_ns) == (ino, size, mtime):
        return None
    if now.st_ino != ino:
        what = "was replaced by another file"
    elif now.st_size != size:
        what = f"changed size ({size} bytes when loaded, {now.st_size} now)"
    else:
        what = "was written to"
    return (f"The {kind} {path} {what} since the model was loaded, so its "
            "experts cannot be read from it any more. Load the model again once the "
            "file is whole.")
