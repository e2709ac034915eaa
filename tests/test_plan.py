"""The planner without a server: decisions, the cost model, routing records (hostile ones too)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from bmoe.engine import params
from bmoe.models.probe import ModelProbe
from bmoe.planner.plan import PlanInputs, make_plan
from bmoe.planner.probes import MIB, ComputeFacts, MemoryFacts, ModelFacts, StorageFacts
from bmoe.planner.routing import (
    MAGIC,
    append_record,
    cost_key,
    default_hit_rate,
    lru_hit_rate,
    read_record,
    record_path,
)

GIB = 1 << 30


def moe_facts(dense: int = 400 * MIB, experts: int = 4 * GIB, cycle: int = 256 * MIB,
              layers: int = 24) -> ModelFacts:
    p = ModelProbe(readable=True, arch="qwen3moe", role="model", block_count=layers,
                   is_moe=True, n_expert=64, n_expert_used=4, n_layer=layers,
                   n_moe_layer=layers, n_embd=1024, dense_bytes=dense, expert_bytes=experts,
                   token_cycle_bytes=cycle, streamable=True)
    kv = {"qwen3moe.attention.head_count": 8, "qwen3moe.attention.head_count_kv": 4,
          "qwen3moe.attention.key_length": 128, "qwen3moe.context_length": 32768}
    return ModelFacts(Path("/m/big-moe.gguf"), dense + experts, p, kv=kv)


def dense_facts(size: int) -> ModelFacts:
    p = ModelProbe(readable=True, arch="qwen3", role="model", block_count=8, n_layer=8,
                   n_embd=1024, dense_bytes=size)
    kv = {"qwen3.attention.head_count": 8, "qwen3.attention.head_count_kv": 4,
          "qwen3.attention.key_length": 128, "qwen3.context_length": 32768}
    return ModelFacts(Path("/m/dense.gguf"), size, p, kv=kv)


def memory(budget: int, cgroup: bool = True) -> MemoryFacts:
    return MemoryFacts(total=32 * GIB, available=16 * GIB if cgroup else budget,
                       cgroup_limit=budget if cgroup else None,
                       cgroup_headroom=budget if cgroup else None, loaded_held=0)


STORAGE = StorageFacts(block=MIB, rates={1: 400 * MIB, 2: 700 * MIB, 4: 720 * MIB})
COMPUTE = ComputeFacts(rates={1: 8 * GIB, 2: 14 * GIB}, type_name="f16")


def plan_for(facts: ModelFacts, mem: MemoryFacts, user: dict | None = None, **kw):
    values = params.defaults(server=True)
    values.update(user or {})
    return make_plan(PlanInputs(facts, mem, STORAGE, COMPUTE, values, list(user or {}), **kw))


def test_a_moe_larger_than_memory_streams_with_a_cache_that_fits() -> None:
    plan = plan_for(moe_facts(), memory(2 * GIB))
    body = plan.to_json()
    assert body["regime"] == "experts-stream"
    cache = body["values"]["cache-mb"] * MIB
    assert 256 * MIB <= cache <= 2 * GIB - 400 * MIB
    held = body["memory"]["pools"][0]["held_bytes"]
    assert held <= 2 * GIB
    assert body["values"]["moe-stream"] is True
    assert body["values"]["threads"] == 2 and body["values"]["io-threads"] == 2
    assert "--cache-mb" in body["args"]
    assert body["summary"]["sentence"].startswith("Experts stream from storage")
    # a cache that turns over reads ahead, and the first answer tries it overlapped
    assert body["values"]["prefetch"] == 2 and "--prefetch" in body["args"]
    assert any(d["knob"] == "trial-overlap" for d in body["decisions"])
    p = body["predicted"]
    assert 0 < p["s_per_token"] < p["s_per_token_worst"]
    assert 0 < p["cache_hit_pct"] < 100


def test_decisions_have_labels_briefs_and_groups() -> None:
    body = plan_for(moe_facts(), memory(2 * GIB)).to_json()
    knobs = {d["knob"]: d for d in body["decisions"]}
    assert knobs["cache-mb"]["label"] == params.param("cache-mb").label
    assert knobs["regime"]["label"] == "Streaming mode"
    assert knobs["storage-rate"]["label"] == "Storage speed"
    assert knobs["memory-ledger"]["label"] == "Memory use"
    for d in body["decisions"]:
        assert set(d) >= {"knob", "label", "group", "value", "value_text", "source", "brief",
                          "reason"}
        assert len(d["brief"]) <= 120 and d["brief"]
        assert d["group"] in ("set", "kept", "notes")
        assert d["source"] in ("measured", "derived", "policy", "operator", "unprobed")
    assert knobs["threads"]["source"] == "measured"
    assert knobs["cache-mb"]["value_text"].endswith(("MiB", "GiB"))


def test_a_dense_model_that_fits_is_resident() -> None:
    body = plan_for(dense_facts(300 * MIB), memory(4 * GIB)).to_json()
    assert body["regime"] == "resident"
    assert "cache-mb" not in body["values"]
    assert body["predicted"]["s_per_token"] > 0


def test_a_tiny_models_predicted_time_is_never_rounded_to_nothing() -> None:
    """A model of a few hundred KiB on a fast machine decodes in tens of microseconds:
    the prediction keeps two significant digits rather than rounding to 0.0 (which the
    plan screen shows as no prediction at all)."""
    body = plan_for(dense_facts(200 * 1024), memory(4 * GIB)).to_json()
    predicted = body["predicted"]
    assert body["regime"] == "resident"
    assert 0 < predicted["s_per_token"] < 0.0001
    assert 0 < predicted["compute_s"] <= predicted["s_per_token_worst"]


def test_a_dense_model_over_the_cap_will_not_fit() -> None:
    plan = plan_for(dense_facts(3 * GIB), memory(1 * GIB))
    assert plan.regime == "will_not_fit" and not plan.fits
    assert plan.sentence.startswith("Will not fit:")
    assert "MiB must stay resident" in plan.sentence
    assert plan.to_json()["args"] == []


def test_a_moe_whose_dense_part_exceeds_the_cap_will_not_fit() -> None:
    plan = plan_for(moe_facts(dense=3 * GIB), memory(2 * GIB))
    assert plan.regime == "will_not_fit"


def test_user_keys_come_back_as_operator_and_are_never_changed() -> None:
    user = {"threads": 1, "cache-mb": 700, "ctx-size": 4096, "io-threads": 3}
    body = plan_for(moe_facts(), memory(2 * GIB), user).to_json()
    knobs = {d["knob"]: d for d in body["decisions"]}
    for key, value in user.items():
        assert knobs[key]["source"] == "operator"
        assert knobs[key]["group"] == "kept"
        assert knobs[key]["value"] == value
        assert key not in body["values"]


def test_the_context_is_never_below_the_advice_unless_memory_forces_it() -> None:
    body = plan_for(moe_facts(), memory(2 * GIB)).to_json()
    assert body["values"]["ctx-size"] >= 16384
    tight = plan_for(moe_facts(dense=400 * MIB, cycle=256 * MIB), memory(900 * MIB)).to_json()
    ctx = {d["knob"]: d for d in tight["decisions"]}["ctx-size"]
    if ctx["value"] < 16384:
        assert "memory forces it" in ctx["brief"]


def test_a_whole_machine_leaves_the_floor_to_other_programs() -> None:
    caged = plan_for(moe_facts(), memory(4 * GIB)).to_json()["values"]["cache-mb"]
    machine = plan_for(moe_facts(), memory(4 * GIB, cgroup=False)).to_json()
    assert machine["values"]["cache-mb"] < caged


def test_a_measured_decode_cost_prices_the_next_plan() -> None:
    first = plan_for(moe_facts(), memory(2 * GIB))
    values = {**params.defaults(server=True), **first.values}
    costs = {cost_key(values): {"s_per_token": 0.5, "tokens": 40, "cache_hit_pct": 55.0}}
    again = plan_for(moe_facts(), memory(2 * GIB), costs=costs).to_json()
    notes = {d["knob"]: d for d in again["decisions"]}
    assert notes["decode-cost"]["source"] == "measured"
    assert again["predicted"]["s_per_token"] == 0.5


# --- routing records ---------------------------------------------------------------------

def rows(n: int, layers: int = 24, k: int = 4, n_expert: int = 64, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    hot = rng.choice(n_expert, size=12, replace=False)
    out = []
    for _ in range(n):
        token = np.stack([rng.choice(hot if rng.random() < 0.7 else np.arange(n_expert),
                                     size=k, replace=False) for _ in range(layers)])
        out.append(token.astype(np.int32))
    return out


def shape(size: int = 1000) -> dict:
    return {"size": size, "n_layer": 24, "n_expert": 64, "n_expert_used": 4}


def test_a_routing_record_is_written_and_read_back(tmp_path: Path) -> None:
    file = record_path(tmp_path, "/m/big-moe.gguf", 1000)
    assert append_record(file, rows(100), model="big-moe.gguf", **shape()) == 100
    assert append_record(file, rows(50, seed=1), model="big-moe.gguf", **shape()) == 150
    rec, warning = read_record(file, **shape())
    assert warning == "" and rec is not None and rec.tokens == 150
    assert rec.ids.shape == (150, 24, 4)
    assert lru_hit_rate(rec, 0) == 0.0
    assert lru_hit_rate(rec, 24 * 64) > 0.9      # only first-use misses after the warm-up
    small, big = lru_hit_rate(rec, 24 * 8), lru_hit_rate(rec, 24 * 24)
    assert 0 < small < big < 1


def test_the_plan_reads_its_hit_rate_off_the_record(tmp_path: Path) -> None:
    file = record_path(tmp_path, "/m/big-moe.gguf", 1000)
    append_record(file, rows(200), model="big-moe.gguf", **shape())
    rec, _ = read_record(file, **shape())
    body = plan_for(moe_facts(), memory(2 * GIB), record=rec).to_json()
    curve = {d["knob"]: d for d in body["decisions"]}["hit-curve"]
    assert curve["source"] == "measured" and "recorded routing" in curve["brief"]
    without = plan_for(moe_facts(), memory(2 * GIB)).to_json()
    curve = {d["knob"]: d for d in without["decisions"]}["hit-curve"]
    assert curve["source"] == "policy" and "default curve" in curve["brief"]


@pytest.mark.parametrize("damage", ["magic", "truncated", "padded", "header", "shape",
                                    "ids", "tokens", "huge-header", "not-object"])
def test_a_hostile_or_truncated_record_is_ignored_with_a_warning(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "m.routing"
    append_record(file, rows(40), model="m", **shape())
    raw = file.read_bytes()
    head_end = raw.index(b"\n", len(MAGIC))
    head = json.loads(raw[len(MAGIC):head_end])
    body = raw[head_end + 1:]
    if damage == "magic":
        raw = b"XXXX" + raw[4:]
    elif damage == "truncated":
        raw = raw[:-7]
    elif damage == "padded":
        raw = raw + b"\0\0"
    elif damage == "header":
        raw = MAGIC + b"{not json\n" + body
    elif damage == "shape":
        raw = MAGIC + json.dumps({**head, "n_layer": 12}).encode() + b"\n" + body
    elif damage == "ids":
        ids = np.frombuffer(body, "<u2").copy()
        ids[5] = 9999
        raw = raw[:head_end + 1] + ids.tobytes()
    elif damage == "tokens":
        raw = MAGIC + json.dumps({**head, "tokens": 10 ** 12}).encode() + b"\n" + body
    elif damage == "huge-header":
        raw = MAGIC + b"{" + b" " * 100000 + b"}\n" + body
    elif damage == "not-object":
        raw = MAGIC + b"[1, 2]\n" + body
    file.write_bytes(raw)
    with caplog.at_level("WARNING"):
        rec, warning = read_record(file, **shape())
    assert rec is None
    assert "ignored" in warning and "routing record" in warning
    assert any("ignored" in r.getMessage() for r in caplog.records)
    # the next streamed run replaces it with a record that reads
    assert append_record(file, rows(20), model="m", **shape()) == 20
    assert read_record(file, **shape())[0] is not None


def test_the_default_curve_is_stated() -> None:
    assert default_hit_rate(100, 1000, 200) == 0.0          # below one token cycle
    assert default_hit_rate(250, 1000, 100) == pytest.approx(0.25 ** 0.35)
    assert default_hit_rate(2000, 1000, 100) == 1.0


def test_a_busy_machine_gets_the_cores_other_programs_leave_free() -> None:
    busy = ComputeFacts(rates={1: 4 * GIB, 2: 14 * GIB}, type_name="f16", cores=2, load=5.0)
    values = params.defaults(server=True)
    body = make_plan(PlanInputs(moe_facts(), memory(2 * GIB), STORAGE, busy, values,
                                [])).to_json()
    threads = {d["knob"]: d for d in body["decisions"]}["threads"]
    assert threads["value"] == 1 and body["values"]["threads"] == 1
    assert "load average 5.0 on 2 cores" in threads["brief"]
    quiet = ComputeFacts(rates={1: 4 * GIB, 2: 14 * GIB}, type_name="f16", cores=2, load=0.5)
    body = make_plan(PlanInputs(moe_facts(), memory(2 * GIB), STORAGE, quiet, values,
                                [])).to_json()
    assert body["values"]["threads"] == 2


def test_cpu_use_measured_over_the_probe_outranks_the_load_average() -> None:
    """The load average still counts programs that ended a minute ago; what other
    programs used while the probe ran decides when it was measured."""
    values = params.defaults(server=True)
    stale = ComputeFacts(rates={1: 4 * GIB, 2: 14 * GIB}, type_name="f16", cores=2,
                         load=2.5, others=0.1)
    body = make_plan(PlanInputs(moe_facts(), memory(2 * GIB), STORAGE, stale, values,
                                [])).to_json()
    assert body["values"]["threads"] == 2
    busy_now = ComputeFacts(rates={1: 4 * GIB, 2: 14 * GIB}, type_name="f16", cores=2,
                            load=0.2, others=1.3)
    body = make_plan(PlanInputs(moe_facts(), memory(2 * GIB), STORAGE, busy_now, values,
                                [])).to_json()
    threads = {d["knob"]: d for d in body["decisions"]}["threads"]
    assert body["values"]["threads"] == 1
    assert "other programs kept 1.3 of 2 cores busy" in threads["brief"]


def test_cpu_used_elsewhere_counts_a_busy_neighbour_not_this_process() -> None:
    import subprocess
    import sys

    from bmoe.planner.probes import cpu_times, cpu_used_elsewhere

    a = cpu_times()
    assert a is not None
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:       # this process spins: not "elsewhere"
        pass
    mine = cpu_used_elsewhere(a, cpu_times())
    spin = "import time\nt = time.monotonic() + 0.8\nwhile time.monotonic() < t: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.1)
    b = cpu_times()
    time.sleep(0.5)
    theirs = cpu_used_elsewhere(b, cpu_times())
    child.wait()
    assert mine is not None and theirs is not None
    assert theirs > 0.6                      # the child kept most of a core busy
    assert theirs > mine + 0.4
    assert cpu_used_elsewhere(a, a) is None  # no span: nothing measured


def test_reads_priced_as_the_engine_batches_them() -> None:
    """A layer's misses are read as one batch and waited for: when small batches leave
    lanes idle, the read time is the batches', not bytes at the full-queue rate."""
    facts = moe_facts()
    fast = plan_for(facts, memory(2 * GIB)).to_json()["predicted"]["s_per_token"]
    slow_batches = StorageFacts(block=MIB, rates=dict(STORAGE.rates), batch_lanes=4,
                                batch_s={1: 0.004, 2: 0.005, 4: 0.006, 8: 0.012, 16: 0.024})
    assert slow_batches.batch_seconds(3) == pytest.approx(0.0055)
    assert slow_batches.batch_seconds(32) == pytest.approx(0.048)
    assert slow_batches.batch_seconds(0.5) == pytest.approx(0.002)
    plan = make_plan(PlanInputs(facts, memory(2 * GIB), slow_batches, COMPUTE,
                                params.defaults(server=True), []))
    slow = plan.to_json()["predicted"]["s_per_token"]
    assert slow > fast
    # batches as fast as the full queue change nothing
    quick = StorageFacts(block=MIB, rates=dict(STORAGE.rates), batch_lanes=4,
                         batch_s={n: n * MIB / 720 / MIB for n in (1, 2, 4, 8, 16)})
    plan = make_plan(PlanInputs(facts, memory(2 * GIB), quick, COMPUTE,
                                params.defaults(server=True), []))
    assert plan.to_json()["predicted"]["s_per_token"] == pytest.approx(fast, rel=0.02)


def test_the_server_runs_the_matmul_probe_on_its_engine_thread(tmp_path: Path) -> None:
    """llama.cpp's OpenMP build gives each thread that computes a graph its own team of
    workers for good; a probe run on a worker thread left a second team that made every
    later decode of the server 1.6x slower on 2 cores (bmoe/planner/measure.py). The
    plan's matmul runs on the engine thread, and the measurement uses that route."""
    import threading

    from bmoe.modelmaker import make_model
    from bmoe.planner import measure as measure_mod
    from bmoe.runtime.config import ConfigStore
    from bmoe.runtime.events import EventBus
    from bmoe.runtime.state import Runtime, ServerOptions
    from bmoe.server.plan_routes import PlanService

    state = Runtime(ServerOptions(data_dir=tmp_path), ConfigStore(tmp_path, {}), EventBus())
    engine = state.engine
    try:
        service = PlanService(state)
        ran_on: list[str] = []

        def probe() -> ComputeFacts:
            ran_on.append(threading.current_thread().name)
            return ComputeFacts(rates={1: GIB}, type_name="f32", cores=1)

        assert service._on_engine_thread(probe).rates == {1: GIB}
        assert ran_on == ["bmoe-engine"]

        model = make_model(tmp_path / "moe.gguf", n_layer=2, n_expert=4, n_expert_used=2)
        seen: list[object] = []

        def route(fn):  # type: ignore[no-untyped-def]
            seen.append(fn)
            return service._on_engine_thread(fn)

        plan = measure_mod.measure(model, params.defaults(server=True), [],
                                   routing_dir=None, compute_on=route)
        assert len(seen) == 1 and plan.to_json()["measurements"]["compute"]["rates"]
    finally:
        engine.close().result(timeout=30)


def test_the_record_is_replayed_through_the_engines_own_policy() -> None:
    """The hit rate read off a routing record is the engine's cache's, with the session's
    replacement policy: `reuse` learns the routing's reuse and hits more than an LRU of
    the same size on skewed, recurring routing; `lru` is LRU's."""
    from bmoe.planner.routing import RoutingRecord, lru_hit_rate, policy_hit_rate

    rng = np.random.default_rng(5)
    hot = rng.choice(32, size=(4, 6), replace=False)       # per layer, 6 popular experts
    tokens = []
    for _ in range(200):
        row = []
        for layer in range(4):
            pick = hot[layer, rng.choice(6, 2, replace=False)] if rng.random() < 0.7 \
                else rng.choice(32, 2, replace=False)
            row.append(pick)
        tokens.append(row)
    rec = RoutingRecord("m", 1, 4, 32, 2, np.array(tokens, dtype=np.uint16))
    lru = lru_hit_rate(rec, 32)
    assert policy_hit_rate(rec, 32, "lru") == lru
    reuse = policy_hit_rate(rec, 32, "reuse")
    assert 0 < lru < reuse < 1
    assert policy_hit_rate(rec, 0, "reuse") == 0.0


def test_streaming_under_a_small_cache_grows_the_prompt_batch() -> None:
    """A long prompt reads every expert once per batch: with room, the plan takes a
    larger batch (its compute buffer out of the cache, at most an eighth of it); with the
    person's own batch size, or a cache that holds every expert, it keeps 512."""
    from bmoe.planner.plan import PREFILL_CACHE_SHARE, prompt_batch

    facts = moe_facts()
    plain = plan_for(facts, memory(2 * GIB), {"ubatch-size": 512}).to_json()
    grown = plan_for(facts, memory(2 * GIB)).to_json()
    assert plain["values"].get("ubatch-size") is None
    n = grown["values"]["ubatch-size"]
    assert n in (1024, 2048) and grown["values"]["batch-size"] == n
    assert f"--ubatch-size {n}" in " ".join(grown["args"]) or "--ubatch-size" in grown["args"]
    extra = prompt_batch(facts, n).compute - prompt_batch(facts).compute
    cache_before, cache_after = (p["values"]["cache-mb"] * MIB for p in (plain, grown))
    assert 0 < cache_before - cache_after <= PREFILL_CACHE_SHARE * cache_before + MIB
    assert cache_before - cache_after >= extra - MIB
    assert any(d["knob"] == "ubatch-size" and "fewer passes" in d["brief"]
               for d in grown["decisions"])
    # every expert fits: one pass whatever the batch, nothing to gain
    roomy = plan_for(moe_facts(experts=1 * GIB), memory(8 * GIB),
                     {"moe-stream": True}).to_json()
    assert roomy["regime"] == "experts-stream" and "ubatch-size" not in roomy["values"]
    assert roomy["values"]["prefetch"] == 0       # every expert fits: nothing to guess
    assert not any(d["knob"] == "trial-overlap" for d in roomy["decisions"])


def test_the_operators_read_ahead_is_kept() -> None:
    body = plan_for(moe_facts(), memory(2 * GIB), {"prefetch": 0}).to_json()
    knobs = {d["knob"]: d for d in body["decisions"]}
    assert knobs["prefetch"]["source"] == "operator" and "prefetch" not in body["values"]
    assert "trial-overlap" not in knobs
    deep = plan_for(moe_facts(), memory(2 * GIB), {"prefetch": 3}).to_json()
    assert {d["knob"]: d for d in deep["decisions"]}["prefetch"]["value"] == 3
    assert any(d["knob"] == "trial-overlap" for d in deep["decisions"])


def test_an_operators_context_that_does_not_fit_is_refused_with_one_that_does() -> None:
    """The plan never shrinks the operator's context: one whose KV cache does not fit
    beside the weights is refused (not loaded to be killed by the memory limit), and the
    sentence names a context that fits."""
    import re

    huge = plan_for(moe_facts(), memory(2 * GIB), {"ctx-size": 400_000})
    assert huge.regime == "will_not_fit" and not huge.fits
    m = re.search(r"a context of up to (\d+) tokens fits", huge.sentence)
    assert m and "a context of 400000 tokens needs" in huge.sentence, huge.sentence
    fits = int(m.group(1))
    ok = plan_for(moe_facts(), memory(2 * GIB), {"ctx-size": fits}).to_json()
    assert ok["regime"] == "experts-stream"
    assert ok["memory"]["pools"][0]["held_bytes"] <= 2 * GIB
    over = plan_for(moe_facts(), memory(2 * GIB), {"ctx-size": fits + 2048})
    assert over.regime == "will_not_fit"
    # without the operator's context the plan fits one itself
    assert plan_for(moe_facts(), memory(2 * GIB)).regime == "experts-stream"
