"""The plan: the settings decided from the probes, and the speed they should give.

Pure: ``make_plan(inputs)`` takes the measured facts and the configuration without the
plan layer, and returns a ``Plan`` whose ``to_json()`` is ``GET /api/plan``'s body.

Regimes, tried in order (a key the person set is never changed, and steers the regime):

* ``resident`` — the whole file, the KV cache and the runtime fit what this process may
  hold: plain llama.cpp on its mapping, nothing streams;
* ``experts-stream`` — a MoE this build streams whose dense weights, one token cycle of
  cache, the KV cache and the runtime fit: the rest of the memory is the expert cache;
* ``plain mmap`` — a MoE this build cannot stream: it runs from the file, and what does
  not fit is read again as tokens need it (slow, and said);
* ``will_not_fit`` — what must stay resident is more than this process may hold: a load
  is refused with the plan's sentence.

The cost model prices one decoded token: compute = the bytes a token multiplies (dense
weights but the embedding table, plus one token cycle of experts) at the measured matmul
rate, plus the streamer's per-layer overhead; reads = the token cycle's misses at the
hit rate the cache earns (the model's own LRU curve from its routing record, else the
stated default curve) at the measured read rate of the chosen lanes, added to the
compute, or beside it (the larger of the two) when read-ahead overlaps reads with
compute. After a complete
turn the server records what decode really cost; the next plan of that configuration
prices with the measurement and says so in a ``decode-cost`` note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine import params
from ..models.probe import stream_floor
from ..engine.experts.budget import batch_layer_bytes, edge_bytes, estimate_compute, shape_of
from .probes import (GIB, MIB, ComputeFacts, MemoryFacts, ModelFacts, StorageFacts,
                     memory_figures)
from .routing import RoutingRecord, cost_key, default_hit_rate, policy_hit_rate

CTX_ADVICE = 16384             # the spec's ctx advice (RunConfig::ctx_for_clients)
CTX_MAX_PLANNED = 65536        # the plan grows the context no further on its own
CTX_KV_SHARE = 0.10            # ... and only while its KV takes at most this of memory
CTX_STEP = 1024
# What a load adds beyond the weights, the KV cache and a prompt batch's needs (below):
# llama.cpp's model and context structures and the streamer's own state (measured in
# bmoe-server: 12-20 MiB for 12- and 24-layer MoEs), and the runtime margin the engine's
# own check at load leaves beside the cache (`budget.RUNTIME_MARGIN`, 32 MiB). It must
# cover both, or a planned cache-mb is refused at load.
RUNTIME_RESERVE = 64 * MIB
N_UBATCH = 512                 # tokens of one prefill batch: the session's PREFILL_CHUNK
# Streaming under a cache smaller than the experts, a prompt batch routes each layer to
# nearly every expert, so a long prompt reads the experts once per batch: the plan grows
# the batch to the largest of these whose larger compute buffer takes at most
# PREFILL_CACHE_SHARE of the cache (measured with bench/prefill.py on the 12-layer
# benchmark MoE, 4,096 tokens under a 700 MiB cache: 13.7 GB read at 512, 3.9 GB at 2,048,
# with the prompt no slower).
PREFILL_UBATCHES = (2048, 1024)
PREFILL_CACHE_SHARE = 0.125
# The streamer's cost per MoE layer and token beside the matmuls and the reads: the graph
# callback, the cache's admission, the compute threads resumed after the layer's reads.
# Measured with bench/plan_accuracy.py on the 12-layer benchmark MoE (2 cores): the time
# per token that was not read wait exceeded the rest of the compute term by a median of
# 3.6 ms over 12 runs at three caches (0.3 ms a layer above the 0.5 ms first assumed).
STREAM_LAYER_S = 0.0008
# CPU time beside the read wait for each expert a token reads: the cache's bookkeeping,
# the victim's pages moved over, the lanes handed the reads and the compute threads woken
# after them. Measured with bench/plan_accuracy.py on the 12-layer benchmark MoE (2
# cores): the time per token that was not read wait grew by 0.19 ms for each expert read
# per token, from 9.8 to 28.5 experts.
MISS_CPU_S = 0.0002
MMAP_FAULT_SLOWDOWN = 4.0      # page-fault reads against the lanes' direct reads
MIN_MEASURED_TOKENS = 8        # a measured decode cost counts from this many tokens

NOTE_LABELS = {"regime": "Streaming mode", "storage-rate": "Storage speed",
               "memory-ledger": "Memory use", "compute-rate": "Compute speed",
               "hit-curve": "Cache hit curve", "decode-cost": "Decode cost",
               "kv-budget": "Context memory", "cache-floor": "Memory left free"}
REGIME_WORDS = {"resident": "resident in memory", "experts-stream": "experts stream",
                "plain mmap": "plain mmap", "will_not_fit": "will not fit"}


@dataclass
class PlanInputs:
    facts: ModelFacts
    memory: MemoryFacts
    storage: StorageFacts
    compute: ComputeFacts
    values: dict[str, Any]                 # the config without the plan layer
    user_keys: list[str]
    record: RoutingRecord | None = None
    record_warning: str = ""
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    loaded_model: str = ""                 # a model loaded while measuring
    trial: dict[str, Any] | None = None    # the first answer's calibration verdict, if kept


@dataclass
class Decision:
    knob: str
    group: str                 # set | kept | notes
    value: Any
    value_text: str
    source: str
    brief: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"knob": self.knob, "label": label_of(self.knob), "group": self.group,
                "value": self.value, "value_text": self.value_text, "source": self.source,
                "brief": self.brief[:120], "reason": self.reason or self.brief}


def label_of(knob: str) -> str:
    try:
        return params.param(knob).label
    except KeyError:
        return NOTE_LABELS.get(knob, knob.replace("-", " ").capitalize())


@dataclass
class Plan:
    model: str
    regime: str
    sentence: str
    machine: str
    decisions: list[Decision]
    values: dict[str, Any]
    predicted: dict[str, float]
    pools: list[dict[str, Any]]
    measurements: dict[str, Any]
    streaming_declined: bool = False
    decline_reason: str = ""
    warning: str = ""
    floor_bytes: int = 0
    helpers: list[dict[str, Any]] = field(default_factory=list)       # planner/helpers.py
    helper_pools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.regime != "will_not_fit"

    def to_json(self) -> dict[str, Any]:
        keys = list(self.values)
        out: dict[str, Any] = {
            "available": True, "model": self.model, "machine": self.machine,
            "regime": self.regime, "streaming_declined": self.streaming_declined,
            "decline_reason": self.decline_reason,
            "decisions": [d.to_json() for d in self.decisions],
            "values": self.values, "args": params.to_args(self.values, keys)
            if self.fits else [], "not_applicable": [],
            "summary": {"sentence": self.sentence, "lanes": [
                {"phase": "prompt", "label": "Prompt", "on": ["CPU"]},
                {"phase": "tokens", "label": "Tokens", "on": ["CPU"]}]},
            "predicted": self.predicted, "memory": {"pools": self.pools},
            "devices": [{"name": "CPU", "description": "the host's cores", "cpu": True,
                         "own_memory": False, "memory_total": 0, "prompt_ratio": 1.0,
                         "token_ratio": 1.0, "rate_text": "The reference",
                         "uses": ["prompt", "tokens"], "status": "used",
                         "badge": "Prompt and tokens",
                         "why": "The host: every rate is measured against it."}],
            "devices_none": "build",
            "devices_none_text": "No other device: this build carries no backend for one.",
            "explain": explain(self), "measurements": self.measurements,
        }
        if self.helpers:
            out["devices"] += self.helpers
            out["devices_none"] = out["devices_none_text"] = ""
            out["memory"]["pools"] = [*self.pools, *self.helper_pools]
            on = [d["name"] for d in self.helpers if "layers" in d["uses"]]
            out["summary"]["lanes"][1]["on"] += on
        if self.warning:
            out["warning"] = self.warning
        return out


def explain(plan: Plan) -> str:
    lines = [plan.sentence, plan.machine]
    lines += [f"{label_of(d.knob)}: {d.value_text} ({d.source}). {d.reason}"
              for d in plan.decisions]
    return "\n".join(lines)


# --- words -------------------------------------------------------------------------------

def size_text(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def rate_text(n: float) -> str:
    return f"{n / GIB:.1f} GiB/s" if n >= GIB else f"{n / MIB:.0f} MiB/s"


def value_text(knob: str, value: Any) -> str:
    if knob == "cache-mb":
        return "off" if value == 0 else (value if value == "auto" else size_text(value * MIB))
    if knob in ("threads", "io-threads"):
        return f"{value} thread{'s' if value != 1 else ''}" if knob == "threads" else \
            f"{value} lane{'s' if value != 1 else ''}"
    if knob == "ctx-size":
        return f"{value} tokens"
    if knob == "moe-stream":
        return "on" if value else "off"
    if knob == "dense-weights":
        return {"anon": "process memory", "mmap": "file mapping"}.get(str(value), str(value))
    if knob == "regime":
        return REGIME_WORDS.get(str(value), str(value))
    if knob in ("storage-rate", "compute-rate"):
        return rate_text(value) if value else "not measured"
    if knob == "memory-ledger":
        return size_text(value) if value else "not read"
    if knob == "hit-curve":
        return f"{value:.0f} % hits"
    if knob == "decode-cost":
        return f"{value:.3f} s/token"
    return str(value)


# --- the plan ----------------------------------------------------------------------------

class _Builder:
    def __init__(self, inp: PlanInputs) -> None:
        self.inp = inp
        self.p = inp.facts.probe
        self.decisions: list[Decision] = []
        self.values: dict[str, Any] = {}
        self.batch = prompt_batch(inp.facts)

    def user(self, key: str) -> bool:
        return key in self.inp.user_keys

    def add(self, knob: str, value: Any, source: str, brief: str, reason: str = "",
            group: str | None = None) -> None:
        if group is None:
            group = "notes" if _is_note(knob) else ("kept" if source in ("operator",
                                                                          "unprobed")
                                                    else "set")
        if group == "set":
            self.values[knob] = value
        self.decisions.append(Decision(knob, group, value, value_text(knob, value), source,
                                       brief, reason))

    def operator(self, knob: str) -> Any:
        value = self.inp.values.get(knob)
        self.add(knob, value, "operator", f"{value_text(knob, value)}: your own setting, "
                 "which the plan never changes.")
        return value


def _is_note(knob: str) -> bool:
    try:
        params.param(knob)
    except KeyError:
        return True
    return False


@dataclass(frozen=True)
class PromptBatch:
    """What a prompt batch of `N_UBATCH` tokens takes beside the weights and the KV cache
    (the engine measures the same at load: `bmoe/engine/experts/budget.py`)."""

    compute: int        # llama.cpp's compute buffer, estimated from the shape (no context)
    mask_tok: int       # ... and what each context token adds to it (the attention mask)
    layer: int          # the experts the batch can route one layer to, held at once
    edges: int          # the expert slices' edge pages
    n_ubatch: int = N_UBATCH

    @property
    def streamed(self) -> int:
        """Beside the expert cache when the experts stream, without the mask."""
        return self.compute + self.edges


def prompt_batch(facts: ModelFacts, n_ubatch: int = N_UBATCH) -> PromptBatch:
    p = facts.probe
    shape = shape_of(facts.kv, facts.tensors)
    if not shape.n_embd:
        shape = type(shape)(p.n_embd, shape.n_ff_exp, p.n_expert_used, shape.n_vocab)
    experts = facts.expert_tensors()
    units: dict[str, int] = {}
    for t in experts:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else t.name
        units[layer] = units.get(layer, 0) + t.nbytes // max(1, p.n_expert)
    if not units and p.n_moe_layer and p.n_expert:       # no tensor list: the average
        units = {"all": p.expert_bytes // (p.n_moe_layer * p.n_expert)}
    layer_bytes = batch_layer_bytes(list(units.values()), p.n_expert, p.n_expert_used,
                                    n_ubatch) if p.is_moe else 0
    if experts:
        edges = edge_bytes((facts.data_start + t.offset, t.nbytes // max(1, p.n_expert),
                            p.n_expert) for t in experts)
    else:                       # one page shared by each pair of neighbouring slices
        edges = 3 * p.n_moe_layer * (p.n_expert + 1) * 4096 if p.is_moe else 0
    return PromptBatch(estimate_compute(shape, n_ubatch, 0), 2 * n_ubatch, layer_bytes, edges,
                       n_ubatch)


def make_plan(inp: PlanInputs) -> Plan:
    b = _Builder(inp)
    p, mem = b.p, inp.memory
    budget = mem.budget
    leave = _leave(inp)
    kv_tok = inp.facts.kv_bytes_per_token()
    whole = p.dense_bytes + p.expert_bytes or inp.facts.size
    stream_ok = p.is_moe and p.streamable
    regime, ctx = _regime(b, budget, leave, kv_tok, whole, stream_ok)
    cache = _cache_bytes(b, regime, budget, leave, kv_tok * ctx, ctx)
    cache = _decide_prompt_batch(b, regime, cache, budget, leave, kv_tok * ctx, ctx)
    _decide_knobs(b, regime, ctx, cache, kv_tok, budget, leave)
    predicted = _predict(b, regime, cache, budget, whole)
    pools = _ledger(b, regime, cache, kv_tok * ctx, budget, ctx)
    floor = stream_floor(p) if stream_ok else whole
    sentence = _sentence(regime, cache, floor, budget, p.is_moe)
    if regime == "will_not_fit" and b.user("ctx-size") and budget:
        fits = _ctx_that_fits(b, budget, kv_tok, whole, stream_ok)
        if fits >= CTX_STEP:       # the weights fit: the operator's context does not
            kv = (kv_tok + b.batch.mask_tok) * ctx
            sentence = (f"Will not fit: a context of {ctx} tokens needs {size_text(kv)} "
                        f"beside the weights and this process may hold "
                        f"{size_text(budget)}; a context of up to {fits} tokens fits "
                        "(--ctx-size).")
    b.decisions.insert(0, Decision("regime", "notes", regime, value_text("regime", regime),
                                   "derived", sentence, _regime_reason(b, regime, budget,
                                                                      leave, whole)))
    return Plan(model=str(inp.facts.path), regime=regime, sentence=sentence,
                machine=_machine(inp), decisions=b.decisions, values=b.values,
                predicted=predicted, pools=pools, measurements=_measurements(inp),
                streaming_declined=p.is_moe and regime in ("resident", "plain mmap"),
                decline_reason=_decline(p, regime),
                warning=(f"{inp.loaded_model} was loaded while this was measured: its memory "
                         "reads as taken, so the plan is sized for a smaller machine"
                         if inp.loaded_model and not mem.loaded_held else ""),
                floor_bytes=floor)


def _leave(inp: PlanInputs) -> int:
    """Memory left to other programs: the RAM-to-leave setting on a whole machine, none
    inside a memory cgroup (its limit is this process's own)."""
    if inp.memory.cgroup_bound and "cache-floor-mb" not in inp.user_keys:
        return 0
    return int(inp.values.get("cache-floor-mb", 1536) or 0) * MIB


def _regime(b: _Builder, budget: int, leave: int, kv_tok: int, whole: int,
            stream_ok: bool) -> tuple[str, int]:
    p, batch = b.p, b.batch
    want_ctx = _ctx_wanted(b)
    user_ctx = b.user("ctx-size")     # the operator's context is never shrunk: it must fit
    ctx_min = want_ctx if user_ctx else min(want_ctx, CTX_ADVICE)
    user_stream = b.inp.values.get("moe-stream") if b.user("moe-stream") else None
    kv_tok += batch.mask_tok          # a context token costs its KV and its batch mask
    fixed = whole + RUNTIME_RESERVE + batch.compute
    if budget and fixed + kv_tok * ctx_min + leave <= budget and user_stream is not True:
        return "resident", _ctx_fit(b, budget - fixed - leave, kv_tok, budget)
    if stream_ok and user_stream is not False:
        # the experts hold at least one token cycle, and a batch's layer set at once
        experts = max(p.token_cycle_bytes, batch.layer)
        room = budget - p.dense_bytes - experts - RUNTIME_RESERVE - batch.streamed
        if budget and room - leave >= kv_tok * ctx_min:
            return "experts-stream", _ctx_fit(b, room - leave, kv_tok, budget, stream=True)
        if budget and room >= kv_tok * (ctx_min if user_ctx else CTX_STEP):
            return "experts-stream", _ctx_fit(b, room, kv_tok, budget, stream=True)
        return "will_not_fit", ctx_min
    if not budget:
        return ("experts-stream" if stream_ok and user_stream is not False
                else "plain mmap"), ctx_min
    if not p.is_moe:
        return "will_not_fit", ctx_min
    return "plain mmap", ctx_min


def _ctx_that_fits(b: _Builder, budget: int, kv_tok: int, whole: int, stream_ok: bool) -> int:
    """The largest context (a multiple of CTX_STEP) beside what must stay resident: the
    streamed floor (dense weights, one token cycle or a batch's layer of experts) where the
    experts stream, else the whole file."""
    p, batch = b.p, b.batch
    if stream_ok and not (b.user("moe-stream") and b.inp.values.get("moe-stream") is False):
        room = (budget - p.dense_bytes - max(p.token_cycle_bytes, batch.layer)
                - RUNTIME_RESERVE - batch.streamed)
    else:
        room = budget - whole - RUNTIME_RESERVE - batch.compute
    per = kv_tok + batch.mask_tok
    return max(0, int(room // per) // CTX_STEP * CTX_STEP) if per > 0 else 0


def _ctx_wanted(b: _Builder) -> int:
    if b.user("ctx-size"):
        return int(b.inp.values.get("ctx-size") or CTX_ADVICE)
    train = b.inp.facts.ctx_train()
    return min(CTX_ADVICE, train) if train else CTX_ADVICE


def _ctx_fit(b: _Builder, room: int, kv_tok: int, budget: int, stream: bool = False) -> int:
    """The context: the person's, else the advice grown while its KV is a small share of
    memory (and, streaming, leaves the cache its room), else shrunk to what fits."""
    want = _ctx_wanted(b)
    if b.user("ctx-size") or kv_tok <= 0:
        return want
    train = b.inp.facts.ctx_train() or CTX_MAX_PLANNED
    ctx = want
    top = min(train, CTX_MAX_PLANNED)
    while ctx * 2 <= top and kv_tok * ctx * 2 <= CTX_KV_SHARE * budget \
            and kv_tok * ctx * 2 <= room / (4 if stream else 1):
        ctx *= 2
    if kv_tok * ctx > room:
        ctx = max(CTX_STEP, int(room // kv_tok) // CTX_STEP * CTX_STEP)
    return ctx


def _cache_bytes(b: _Builder, regime: str, budget: int, leave: int, kv: int, ctx: int) -> int:
    """The cache: what is left after the dense weights, the context (its KV and its batch
    mask), the runtime and a prompt batch's compute buffer and edge pages. A cache below
    a batch's layer set is fine (the set is then held beside it: the ledger's prompt-batch
    row), as long as that set fits where the cache would be."""
    p, batch = b.p, b.batch
    if regime != "experts-stream":
        return 0
    if b.user("cache-mb"):
        raw = b.inp.values.get("cache-mb")
        return p.expert_bytes if raw == "auto" else int(raw or 0) * MIB
    room = (budget - p.dense_bytes - kv - batch.mask_tok * ctx - RUNTIME_RESERVE
            - batch.streamed)
    if not budget:
        return p.token_cycle_bytes
    if room - leave >= max(p.token_cycle_bytes, batch.layer):
        room -= leave
    return max(p.token_cycle_bytes, min(p.expert_bytes, room))


def _decide_prompt_batch(b: _Builder, regime: str, cache: int, budget: int, leave: int,
                        kv: int, ctx: int) -> int:
    """Streaming under a cache smaller than the experts: the largest prompt batch of
    `PREFILL_UBATCHES` whose compute buffer grows by at most `PREFILL_CACHE_SHARE` of the
    cache, and the cache that is then left. A long prompt reads every expert once per
    batch, so a batch four times larger reads a quarter of the bytes."""
    p = b.p
    if (regime != "experts-stream" or cache >= p.expert_bytes or b.user("ubatch-size")
            or b.user("batch-size") or b.user("cache-mb")):
        return cache
    base = b.batch
    for n in PREFILL_UBATCHES:
        if n > ctx:
            continue
        bigger = prompt_batch(b.inp.facts, n)
        extra = (bigger.streamed + bigger.mask_tok * ctx) - (base.streamed + base.mask_tok * ctx)
        if extra > PREFILL_CACHE_SHARE * cache:
            continue
        b.batch = bigger
        left = _cache_bytes(b, regime, budget, leave, kv, ctx)
        if left < max(p.token_cycle_bytes, bigger.layer):
            b.batch = base
            continue
        passes = f"{n // base.n_ubatch}x fewer passes"
        for knob in ("batch-size", "ubatch-size"):
            b.add(knob, n, "derived",
                  f"{n} tokens: a long prompt reads every expert once per batch of this "
                  f"many tokens ({passes} than {base.n_ubatch}).",
                  f"The cache ({size_text(left)}) is smaller than the experts "
                  f"({size_text(p.expert_bytes)}), and a prompt batch routes each layer to "
                  "nearly all of them, so a prompt reads them all once per batch. A batch "
                  f"of {n} tokens takes {size_text(max(0, extra))} more compute buffer "
                  f"than one of {base.n_ubatch} (at most "
                  f"{PREFILL_CACHE_SHARE:.1%} of the cache), taken from the cache.")
        return left
    return cache


def _decide_knobs(b: _Builder, regime: str, ctx: int, cache: int, kv_tok: int,
                  budget: int, leave: int) -> None:
    inp, p = b.inp, b.p
    stream = regime == "experts-stream"
    if b.user("moe-stream"):
        b.operator("moe-stream")
    elif p.is_moe and regime != "will_not_fit":
        b.add("moe-stream", stream, "derived",
              "On: the experts stream from storage." if stream else
              "Off: the whole model stays in memory." if regime == "resident" else
              "Off: this build does not stream this model's experts.")
    if stream:
        if b.user("cache-mb"):
            b.operator("cache-mb")
        else:
            mib = -(-cache // MIB)            # a cache under 1 MiB is not "off"
            b.add("cache-mb", mib, "derived",
                  f"{size_text(cache)}: what is left after the dense weights, the context "
                  "and the runtime.",
                  f"This process may hold {size_text(budget)}; the dense weights take "
                  f"{size_text(p.dense_bytes)}, the context's KV cache "
                  f"{size_text(kv_tok * ctx)}, the runtime {size_text(RUNTIME_RESERVE)}, "
                  f"a prompt batch of {b.batch.n_ubatch} tokens "
                  f"{size_text(_batch_beside(b, ctx))} (llama.cpp's compute buffer and the "
                  "experts' edge pages)"
                  + (f", and {size_text(leave)} is left to other programs" if leave else "")
                  + f". One token cycle is {size_text(p.token_cycle_bytes)}, a batch's "
                  f"experts of one layer {size_text(b.batch.layer)} and all the "
                  f"experts {size_text(p.expert_bytes)}.")
        _decide_read_ahead(b)
    trial = inp.trial
    if b.user("threads"):
        b.operator("threads")
    elif trial is not None and trial["threads_measured"]:
        n = int(trial["threads"])
        b.add("threads", n, "measured",
              f"{n}: measured on this model (its first answer decoded with each count).",
              "Seconds per token by arm of the first answer's calibration: "
              + ", ".join(f"{a['threads']} threads{' with overlap' if a['overlap'] else ''}: "
                          f"{a['s_per_token']:.4f}" for a in trial["arms"]) + ".")
    elif inp.compute.rates and _busy(inp.compute):
        c = inp.compute
        n = max(k for k in c.rates if k <= c.spare_cores) if any(
            k <= c.spare_cores for k in c.rates) else min(c.rates)
        busy = (f"other programs kept {c.busy_elsewhere:.1f} of {c.cores} cores busy "
                "while it measured" if c.others is not None else
                f"load average {c.load:.1f} on {c.cores} cores")
        b.add("threads", n, "measured",
              f"{n}: the cores other programs leave free ({busy}).",
              f"The matmul alone was fastest at {c.best_threads} threads, but the machine "
              f"is busy ({busy}): a compute thread another program deschedules stalls "
              "the others at every node of a decode, which made two threads 2-20x slower "
              "than one in bench/plan_accuracy.py.")
    elif inp.compute.rates:
        n = inp.compute.best_threads
        rates = ", ".join(f"{k}: {rate_text(v)}" for k, v in sorted(inp.compute.rates.items()))
        b.add("threads", n, "measured",
              f"{n}: the thread count with the fastest matmul "
              f"({rate_text(inp.compute.rate())}).",
              f"llama.cpp's matmul on this model's {inp.compute.type_name} weights, by "
              f"thread count: {rates}. Fewer threads win unless more are 15 % faster: on a "
              "shared machine every extra thread can stall a decode at each node.")
    else:
        b.add("threads", inp.values.get("threads"), "unprobed", "Kept: the matmul could "
              "not be measured.", inp.compute.reason)
    _decide_trials(b, stream)
    if stream:
        if b.user("io-threads"):
            b.operator("io-threads")
        elif inp.storage.rates:
            n = inp.storage.best_lanes
            rates = ", ".join(f"{k}: {rate_text(v)}"
                              for k, v in sorted(inp.storage.rates.items()))
            b.add("io-threads", n, "measured",
                  f"{n}: the fewest lanes within 5 % of the fastest reads "
                  f"({rate_text(inp.storage.rate())}).",
                  f"Random direct reads of this model's expert blocks, by lanes: {rates}.")
        else:
            b.add("io-threads", inp.values.get("io-threads"), "unprobed",
                  "Kept: storage could not be measured.", inp.storage.reason)
    _decide_ctx(b, regime, ctx, kv_tok)
    b.add("dense-weights", inp.values.get("dense-weights"),
          "operator" if b.user("dense-weights") else "policy",
          "Kept in process memory, so memory pressure cannot evict them." if
          inp.values.get("dense-weights") == "anon" else
          "Left on the file mapping.", group="kept")
    b.add("storage-rate", round(inp.storage.rate()), inp.storage.figure().source,
          inp.storage.figure().text)
    b.add("compute-rate", round(inp.compute.rate()), inp.compute.figure().source,
          inp.compute.figure().text)
    b.add("memory-ledger", budget, "measured" if budget else "unprobed",
          f"{size_text(budget)} this process may hold.", memory_figures(inp.memory)[
              "memory-budget"].text)


READ_AHEAD_DEPTH = 2      # the streaming bench's depth: 1 and 3 were no better


def _decide_read_ahead(b: _Builder) -> None:
    """``prefetch``: read-ahead when the cache turns over (some experts are read per
    token); off when it holds every expert, where guessing only costs."""
    if b.user("prefetch"):
        b.operator("prefetch")
        return
    cache_mib = b.values.get("cache-mb", b.inp.values.get("cache-mb"))
    if not isinstance(cache_mib, int):
        return
    if cache_mib * MIB < b.p.expert_bytes:
        b.add("prefetch", READ_AHEAD_DEPTH, "policy",
              f"{READ_AHEAD_DEPTH} layers: the cache holds part of the experts; the next "
              "layers' are guessed and read before they are routed.",
              "After each layer the engine applies the next layers' routers to its hidden "
              "state and reads the guesses it lacks; a wrong guess costs bandwidth, never "
              "a wrong answer. Measured under a memory cap of 40 % of the file (2 threads): "
              "a 12-layer slice of gpt-oss-120b decoded at 0.075 s/token with it against "
              "0.107 without, one of Qwen3-30B-A3B at 0.043 against 0.062; 98 % of the "
              "routed experts had been guessed.")
    else:
        b.add("prefetch", 0, "policy", "Off: the cache holds every expert, so once read "
              "none is read again and guessing would only cost.")


def _decide_trials(b: _Builder, stream: bool) -> None:
    """``trial-threads`` / ``trial-overlap`` until the first answer has measured them on
    this model (``bmoe/engine/calibrate.py``); ``overlap`` from the verdict once it has."""
    inp, trial = b.inp, b.inp.trial
    threads = b.values.get("threads")
    if not b.user("threads") and isinstance(threads, int) and not (
            trial is not None and trial["threads_measured"]):
        alt = _other_threads(inp.compute, threads)
        if alt:
            b.add("trial-threads", alt, "policy",
                  f"{alt}: tried against {threads} on the first answer, which keeps the "
                  "faster.",
                  "The matmul probe times one expert's product, not a whole decode step; "
                  "the first answer decodes in alternating windows of both counts and "
                  "the verdict is kept for the next plan of this model.")
    prefetch = int(b.values.get("prefetch", inp.values.get("prefetch")) or 0)
    if not stream or prefetch <= 0:
        return
    if b.user("overlap"):
        b.operator("overlap")
    elif trial is not None and trial["overlap_measured"]:
        on = bool(trial["overlap"])
        b.add("overlap", on, "measured",
              f"{'On' if on else 'Off'}: measured on this model (its first answer decoded "
              "both ways).")
    else:
        b.add("trial-overlap", True, "policy",
              "Tried both ways on the first answer, which keeps the faster.")


def _other_threads(c: ComputeFacts, n: int) -> int:
    """The thread count to try against `n`: the matmul's next best, else a neighbour."""
    others = sorted((k for k in c.rates if k != n), key=lambda k: -c.rates[k])
    if others:
        return int(others[0])
    cores = max(1, int(c.cores or 1))
    return n + 1 if n + 1 <= cores else (n - 1 if n > 1 else 0)


def _busy(c: ComputeFacts) -> bool:
    """More threads measured best than the cores other programs leave free."""
    return bool(c.cores) and c.best_threads > c.spare_cores


def _decide_ctx(b: _Builder, regime: str, ctx: int, kv_tok: int) -> None:
    if b.user("ctx-size"):
        b.operator("ctx-size")
        return
    if regime == "will_not_fit":
        return
    kv = size_text(kv_tok * ctx)
    if ctx < min(CTX_ADVICE, b.inp.facts.ctx_train() or CTX_ADVICE):
        b.add("ctx-size", ctx, "derived",
              f"{ctx} tokens: memory forces it below the {CTX_ADVICE} an agent needs.",
              f"Its KV cache takes {kv}; a larger context would not leave the expert cache "
              "one token cycle.")
    else:
        b.add("ctx-size", ctx, "derived",
              f"{ctx} tokens: the largest that fits beside the "
              f"{'cache' if regime == 'experts-stream' else 'weights'} ({kv} of KV).",
              f"At least the {CTX_ADVICE} tokens a coding agent needs (or the model's own "
              f"limit), doubled while its KV cache takes at most "
              f"{CTX_KV_SHARE:.0%} of memory.")


# --- the cost model ---------------------------------------------------------------------------

def _hit(b: _Builder, cache: int) -> tuple[float, str, str]:
    p, rec = b.p, b.inp.record
    unit = p.token_cycle_bytes // max(1, p.n_expert_used * max(1, p.n_moe_layer))
    if rec is not None and rec.tokens >= 16 and unit:
        policy = str({**b.inp.values, **b.values}.get("cache-policy") or "reuse")
        hit = policy_hit_rate(rec, cache // unit, policy)
        return hit, "measured", (f"{hit:.0%} hits at {size_text(cache)}: the engine's cache "
                                 f"({policy}) replayed over this model's recorded routing "
                                 f"({rec.tokens} tokens).")
    hit = default_hit_rate(cache, p.expert_bytes, p.token_cycle_bytes)
    why = "no routing record of this model yet"
    if b.inp.record_warning:
        why = "its routing record was ignored"
    return hit, "policy", (f"{hit:.0%} hits at {size_text(cache)}: the default curve "
                           f"(the cache's share of the experts to the power 0.35; {why}).")


def _seconds(s: float) -> float:
    """A predicted time, to 0.1 ms, but never a positive time rounded to nothing: a tiny
    model's token (tens of microseconds) keeps two significant digits, so a prediction
    is never shown as missing."""
    r = round(s, 4)
    return r if r > 0 or s <= 0 else float(f"{s:.2g}")


def _predict(b: _Builder, regime: str, cache: int, budget: int,
             whole: int) -> dict[str, float]:
    inp, p = b.inp, b.p
    rate_c = inp.compute.rate(b.values.get("threads") or inp.values.get("threads"))
    rate_s = inp.storage.rate(b.values.get("io-threads") or inp.values.get("io-threads"))
    if regime == "will_not_fit" or rate_c <= 0:
        return {}
    active = inp.facts.dense_active_bytes() + p.token_cycle_bytes
    compute = active / rate_c
    out: dict[str, float] = {}
    if regime == "experts-stream":
        compute += STREAM_LAYER_S * p.n_moe_layer
        hit, source, text = _hit(b, cache)
        b.add("hit-curve", round(hit * 100, 1), source, text)
        compute += MISS_CPU_S * p.n_expert_used * p.n_moe_layer * (1 - hit)
        io = p.token_cycle_bytes * (1 - hit) / rate_s if rate_s else 0.0
        batched = _batched_read_s(inp, hit)
        io = max(io, batched)
        settings = {**inp.values, **b.values}
        overlap = bool(settings.get("overlap")) and int(settings.get("prefetch") or 0) > 0
        # with read-ahead overlapped, a layer's reads run beside the layers computing
        s = max(compute, io) if overlap else compute + io
        out["cache_hit_pct"] = round(hit * 100, 1)
        out["read_s"] = _seconds(io)
    elif regime == "plain mmap":
        held = max(0.0, min(1.0, (budget - RUNTIME_RESERVE) / whole)) if whole else 1.0
        slow = rate_s / MMAP_FAULT_SLOWDOWN if rate_s else 0.0
        s = compute + (active * (1 - held) / slow if slow else 0.0)
    else:
        s = compute
    out["s_per_token"] = _seconds(s)
    out["compute_s"] = _seconds(compute)
    if rate_s:
        out["s_per_token_worst"] = _seconds(compute + active / rate_s)
    measured = inp.costs.get(cost_key({**inp.values, **b.values}))
    if measured and measured.get("tokens", 0) >= MIN_MEASURED_TOKENS \
            and measured.get("s_per_token", 0) > 0:
        got = measured["s_per_token"]
        b.add("decode-cost", round(got, 4), "measured",
              f"{got:.3f} s/token measured here at this configuration; the plan prices "
              "with it.",
              f"The last complete turn at these settings decoded {int(measured['tokens'])} "
              f"tokens at {got:.4f} s/token; the model of the machine alone said {s:.4f}.")
        out["s_per_token"] = round(got, 4)
        if measured.get("cache_hit_pct", -1) >= 0 and "cache_hit_pct" in out:
            out["cache_hit_pct"] = round(measured["cache_hit_pct"], 1)
    return out


def _batched_read_s(inp: PlanInputs, hit: float) -> float:
    """A token's read time as the engine reads: each MoE layer's misses (one block per
    expert tensor of each missed expert) as one batch, waited for before the layer
    computes (blocks of the probe's size: one expert's slice of one tensor). Small batches
    leave lanes idle, so this can exceed bytes ÷ full-queue rate."""
    p, st = inp.facts.probe, inp.storage
    if not st.batch_s or not p.n_moe_layer or not p.n_expert_used or not st.block:
        return 0.0
    unit = p.token_cycle_bytes / max(1, p.n_expert_used * p.n_moe_layer)  # one expert
    reads = p.n_expert_used * (1 - hit) * unit / st.block      # blocks one layer misses
    return p.n_moe_layer * st.batch_seconds(reads)


def _batch_beside(b: _Builder, ctx: int) -> int:
    """A prompt batch's compute buffer (its mask for `ctx` tokens included) and edge pages."""
    return b.batch.streamed + b.batch.mask_tok * ctx


def _ledger(b: _Builder, regime: str, cache: int, kv: int, budget: int,
            ctx: int) -> list[dict[str, Any]]:
    p = b.p
    rows = []
    if regime == "resident":
        rows.append(("model", "Model", p.dense_bytes + p.expert_bytes))
        rows.append(("batch", "Prompt batch", b.batch.compute + b.batch.mask_tok * ctx))
    else:
        rows.append(("dense", "Dense", p.dense_bytes))
    if cache:
        rows.append(("cache", "Expert cache", cache))
        # a batch's layer set beyond the cache is held beside it while that layer runs
        rows.append(("batch", "Prompt batch",
                     _batch_beside(b, ctx) + max(0, b.batch.layer - cache)))
    rows.append(("kv", "Context", kv))
    rows.append(("runtime", "Runtime", RUNTIME_RESERVE))
    held = sum(r[2] for r in rows)
    return [{"name": "host", "label": "This process", "cap_bytes": budget,
             "lockable_cap_bytes": 0, "lockable_cap_known": False, "held_bytes": held,
             "locked_bytes": 0,
             "rows": [{"name": n, "label": lbl, "bytes": int(v), "locked": False,
                       "in_turn": False} for n, lbl, v in rows]}]


# --- sentences ---------------------------------------------------------------------------

def _sentence(regime: str, cache: int, floor: int, budget: int, is_moe: bool) -> str:
    if regime == "resident":
        return "The whole model fits in memory: it runs resident, nothing streams."
    if regime == "experts-stream":
        return f"Experts stream from storage, with a {size_text(cache)} cache."
    if regime == "plain mmap":
        return ("Runs whole from the file on plain mmap: this build does not stream its "
                "experts, and what does not fit is read again as tokens need it.")
    return (f"Will not fit: {floor // MIB} MiB must stay resident and this process may hold "
            f"{budget // MIB} MiB.")


def _regime_reason(b: _Builder, regime: str, budget: int, leave: int, whole: int) -> str:
    p = b.p
    text = (f"The file's weights are {size_text(whole)} (dense {size_text(p.dense_bytes)}"
            + (f", experts {size_text(p.expert_bytes)}, one token cycle "
               f"{size_text(p.token_cycle_bytes)}" if p.is_moe else "")
            + f"); this process may hold {size_text(budget)}")
    if leave:
        text += f", of which {size_text(leave)} is left to other programs"
    return text + "."


def _decline(p: Any, regime: str) -> str:
    if not p.is_moe or regime not in ("resident", "plain mmap"):
        return ""
    if regime == "resident":
        return "the whole model fits in memory"
    return p.refusal or "this build does not stream this model's experts"


def _machine(inp: PlanInputs) -> str:
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = (f"{cores} cores, {inp.memory.budget // MIB} MiB available of "
            f"{inp.memory.total // MIB} MiB")
    if inp.compute.rates:
        text += f", {rate_text(inp.compute.rate())} on this model's matmul"
    if inp.storage.rates:
        text += f", {rate_text(inp.storage.rate())} from its file"
    return text


def _measurements(inp: PlanInputs) -> dict[str, Any]:
    figs = {k: v.to_json() for k, v in memory_figures(inp.memory).items()}
    figs["storage-rate"] = inp.storage.figure().to_json()
    figs["compute-rate"] = inp.compute.figure().to_json()
    return {"figures": figs, "storage": inp.storage.to_json(),
            "compute": inp.compute.to_json(),
            "model": inp.facts.probe.to_json(),
            "routing_tokens": inp.record.tokens if inp.record else 0,
            "routing_warning": inp.record_warning}
