"""The planner on this machine: probes against a dd-style read and the cgroup, and plans
under a real memory cap (root and cgroup v1; skipped otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from bmoe.machine.cgroup import MemoryCap
from bmoe.modelmaker import make_model
from bmoe.planner.probes import model_facts, probe_compute, probe_memory, probe_storage
from conftest import ServerProcess

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
MIB = 1 << 20


def own_v1_group() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    return None


def can_cap() -> bool:
    group = own_v1_group()
    return os.geteuid() == 0 and group is not None and os.access(group, os.W_OK)


needs_cap = pytest.mark.skipif(not can_cap(), reason="needs root and a cgroup-v1 memory "
                               "controller")


def Cap(name: str, limit: int) -> MemoryCap:  # noqa: N802 - a group per test process
    """The engine's own memory cgroup (bmoe.machine.cgroup), named for this process."""
    return MemoryCap(f"{name}-{os.getpid()}", limit)


@pytest.fixture(scope="module")
def stream_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 596 MiB MoE (12 layers x 32 experts, top-4, F16): 1.5 MiB experts, 72 MiB cycle."""
    return make_model(tmp_path_factory.mktemp("plan-models") / "stream.gguf", n_layer=12,
                      n_expert=32, n_expert_used=4, n_embd=512, n_ff_exp=512, n_head=8,
                      n_head_kv=4, head_dim=64, dtype="f16", router_skew=1.5,
                      context_mix=1.5, seed=3)


@pytest.fixture(scope="module")
def big_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 182 MiB dense model."""
    return make_model(tmp_path_factory.mktemp("plan-dense") / "dense.gguf", arch="qwen3",
                      n_layer=6, n_embd=1024, n_ff=4096, n_head=8, n_head_kv=4,
                      head_dim=128, dtype="f16")


def dd_rate(path: Path, block: int, count: int) -> float:
    """Bytes/s of dd reading ``count`` blocks with O_DIRECT from the middle of the file."""
    skip = max(0, path.stat().st_size // block // 3)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}",
                    f"skip={skip}", "iflag=direct"], check=True, capture_output=True)
    return block * count / (time.perf_counter() - t0)


def test_storage_probe_agrees_with_a_dd_direct_read(stream_moe: Path) -> None:
    """dd reads into its own buffer, pages faulted in one by one: the probe with the
    same kind of memory (`huge_pages=False`, the engine's default) must agree with it.
    The probe as the engine reads with `huge-pages` (pages from transparent huge pages)
    may be faster on a disk that pays per physically contiguous run (up to 2.1x dd
    measured here), never slower."""
    facts = model_facts(stream_moe)
    plain = [probe_storage(facts, lanes=(1,), seconds=0.5, seed=i, huge_pages=False)
             for i in range(2)]
    huge = [probe_storage(facts, lanes=(1,), seconds=0.5, seed=i, huge_pages=True)
            for i in range(2)]
    block = plain[0].block
    assert block == 512 * 1024 and plain[0].odirect and huge[0].odirect
    ours = max(p.rate(1) for p in plain)
    dd = max(dd_rate(stream_moe, block, 160) for _ in range(2))
    assert 0.5 <= ours / dd <= 2.0, (ours / MIB, dd / MIB)
    assert max(p.rate(1) for p in huge) >= 0.8 * ours
    figure = huge[0].figure()
    assert figure.source == "measured" and "O_DIRECT" in figure.text


def test_storage_probe_batches_read_as_the_engine_reads(
        stream_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batches are the engine's reads: whole expert slices at their own offsets (the
    reader widens them to pages), a layer's gate/up/down of the same experts, each into
    pages moved over from a slot read before (as a miss takes a victim's pages)."""
    from bmoe.engine.experts import reader as reader_mod
    facts = model_facts(stream_moe)
    slices = {}
    for t in facts.expert_tensors():
        size = t.nbytes // facts.probe.n_expert
        for e in range(facts.probe.n_expert):
            slices[facts.data_start + t.offset + e * size] = (t.name.split(".")[1], size, e)
    batches: list[list[reader_mod.Read]] = []
    original = reader_mod.ExpertReader.read_all

    def record(self: reader_mod.ExpertReader, reads: list[reader_mod.Read]) -> tuple[int, float]:
        batches.append(list(reads))
        return original(self, reads)

    monkeypatch.setattr(reader_mod.ExpertReader, "read_all", record)
    probe = probe_storage(facts, lanes=(1, 2), seconds=0.2, seed=1)
    assert set(probe.lane_batch_s) == {1, 2} and probe.batch_s
    assert {len(b) for b in batches} == {1, 2, 4, 8, 16}
    for batch in batches:
        where = [slices[r.offset] for r in batch]          # KeyError: not a slice's offset
        assert all(r.length == size for r, (_, size, _) in zip(batch, where, strict=True))
        assert len({layer for layer, _, _ in where}) == 1
        assert len({e for _, _, e in where}) == -(-len(batch) // 3)
        assert all(len(r.moves) == 1 and r.moves[0][0] != reader_mod.FRESH for r in batch)


def test_compute_probe_measures_llama_cpps_matmul(stream_moe: Path) -> None:
    c = probe_compute(model_facts(stream_moe), threads=(1, 2), seconds=0.2)
    assert c.type_name == "f16"
    assert set(c.rates) == {1, 2} and all(r > 50 * MIB for r in c.rates.values()), c.rates
    assert c.best_threads in (1, 2)
    assert c.figure().source == "measured"


def test_memory_probe_without_a_cap_reads_memavailable() -> None:
    m = probe_memory()
    assert m.total > 0 and 0 < m.available <= m.total
    assert 0 < m.budget <= m.total


@needs_cap
def test_memory_probe_reads_the_cgroup_limit() -> None:
    cap = Cap("bmoe-plan-mem", 700 * MIB)
    try:
        code = ("from bmoe.planner.probes import probe_memory; m = probe_memory(); "
                "print(m.cgroup_limit, m.cgroup_headroom, m.budget)")
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=cap.enter,
                             capture_output=True, text=True, check=True).stdout.split()
        limit, headroom, budget = (int(x) for x in out)
        assert limit == 700 * MIB
        assert 0 < headroom <= limit and budget == min(headroom, budget)
        assert budget <= limit
    finally:
        cap.remove()


def start_capped(cap: Cap, data: Path, *args: str) -> ServerProcess:
    cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
           "--threads", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=cap.enter,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the capped server did not start: {line!r}")
    return ServerProcess(proc, line.split("listening on", 1)[1].strip(), data)


@pytest.fixture
def capped(request: pytest.FixtureRequest) -> Iterator[list[Cap]]:
    caps: list[Cap] = []
    yield caps
    for c in caps:
        c.remove()


@needs_cap
def test_under_a_cap_the_plan_streams_and_the_load_succeeds(
        tmp_path: Path, stream_moe: Path, capped: list[Cap]) -> None:
    size = stream_moe.stat().st_size
    cap = Cap("bmoe-plan-stream", 480 * MIB)       # 80 % of the file, the server included
    capped.append(cap)
    srv = start_capped(cap, tmp_path, "--auto")
    try:
        assert srv.request("POST", "/api/session/load", {"model": str(stream_moe)})[0] == 202
        info = srv.wait_state("ready", "error", timeout=120)
        assert info["state"] == "ready", info
        assert info["model"]["streaming"] is True
        notes = info["model"]["streaming_notes"]      # what the streamer chose, and why
        assert notes["eval_callback"] and notes["load_reads"], notes
        assert notes["prefill_ahead"].startswith(("the next layer's", "off: the cache")), notes
        plan = srv.request("GET", "/api/plan")[2]
        assert plan["from_last_load"] is True
        assert plan["regime"] == "experts-stream"
        cache = plan["values"]["cache-mb"] * MIB
        cycle = plan["measurements"]["model"]["token_cycle_bytes"]
        assert cycle <= cache < cap.limit
        # a cache smaller than the experts turns over: the plan reads ahead, and the
        # streamer guesses the next layers from their routers
        assert cache < plan["measurements"]["model"]["expert_bytes"]
        assert plan["values"]["prefetch"] == 2
        assert notes["predictor"].startswith("router, "), notes
        assert plan["memory"]["pools"][0]["held_bytes"] <= cap.limit
        assert plan["memory"]["pools"][0]["cap_bytes"] < cap.limit
        # plain mmap would have to hold the whole file in a cap smaller than it
        assert size > cap.limit
        status, _, body = srv.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 16, "temperature": 0}, timeout=120)
        assert status == 200, body
        assert cap.oom_kills() == 0 and srv.proc.poll() is None
        assert cap.peak() <= cap.limit
    finally:
        srv.stop()


@needs_cap
def test_a_dense_model_over_the_cap_will_not_fit_and_the_load_is_refused(
        tmp_path: Path, big_dense: Path, capped: list[Cap]) -> None:
    cap = Cap("bmoe-plan-dense", 200 * MIB)
    capped.append(cap)
    srv = start_capped(cap, tmp_path, "--auto")
    try:
        assert srv.request("POST", "/api/session/load", {"model": str(big_dense)})[0] == 202
        info = srv.wait_state("ready", "error", timeout=120)
        assert info["state"] == "error", info
        assert re.match(r"Will not fit: \d+ MiB must stay resident and this process may "
                        r"hold \d+ MiB\.", info["error"]), info["error"]
        plan = srv.request("GET", "/api/plan")[2]
        assert plan["regime"] == "will_not_fit" and plan["args"] == []
        assert plan["summary"]["sentence"].startswith("Will not fit: ")
        assert cap.oom_kills() == 0
    finally:
        srv.stop()


def test_a_small_dense_model_is_resident(tmp_path: Path, tiny_dense: Path) -> None:
    from bmoe.engine import params
    from bmoe.planner.measure import measure
    plan = measure(tiny_dense, params.defaults(server=True), [], routing_dir=tmp_path)
    assert plan.regime == "resident"
    assert plan.to_json()["predicted"]["s_per_token"] > 0
