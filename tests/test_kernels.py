"""Which kernels a resident load runs (`bmoe.engine.kernels`): both branches, for real.

The decision table is checked on its own; the probe runs in a child process on this
host's llama.cpp build; "unusable" is forced by making the probe die as a faulting kernel
does (SIGSEGV before its first batch with extra buffer types), and "usable" by the
setting. Each branch then serves a quantized model's batched prompt through the server,
so whichever way the choice goes, the process stays up and says which it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bmoe.engine import kernels
from bmoe.engine.kernels import KernelChoice
from bmoe.modelmaker import make_model
from bmoe.modelmaker.quantize import quantize
from conftest import ServerProcess, start_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12    # a batch, not one token


def test_off_and_nothing_registered_never_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe() -> tuple[bool, str]:
        raise AssertionError("the probe ran")

    monkeypatch.setattr(kernels, "run_probe", no_probe)
    off = kernels._decide("off", ("CPU_REPACK",))
    assert off == KernelChoice(False, ("CPU_REPACK",), "off", "setting", off.reason)
    none = kernels._decide("auto", ())
    assert none.extra_bufts is False and none.decided_by == "none registered"
    assert kernels._decide("on", ()).extra_bufts is False       # nothing to turn on


def test_amx_is_off_without_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "run_probe", lambda: (True, ""))
    choice = kernels._decide("auto", ("AMX", "CPU_REPACK"))
    assert choice.extra_bufts is False and choice.decided_by == "known fault"
    assert "AMX" in choice.reason
    on = kernels._decide("on", ("AMX", "CPU_REPACK"))       # not even when asked for
    assert on.extra_bufts is False and on.decided_by == "known fault"


def test_auto_follows_the_probe_and_keeps_its_verdict(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs: list[int] = []

    def probe() -> tuple[bool, str]:
        runs.append(1)
        return False, "the kernel probe died with SIGSEGV at here"

    monkeypatch.setattr(kernels, "run_probe", probe)
    first = kernels._decide("auto", ("CPU_REPACK",))
    again = kernels._decide("auto", ("CPU_REPACK",))
    assert first == again and first.extra_bufts is False and "SIGSEGV" in first.reason
    assert runs == [1], "the kept verdict was not reused"
    kept = json.loads((tmp_path / "bmoe" / "kernels.json").read_text())
    assert list(kept.values()) == [{"usable": False, "why": first.reason}]


def test_registered_types_are_read_from_ggml() -> None:
    names = kernels.registered_extra_bufts()
    assert isinstance(names, tuple) and all(isinstance(n, str) and n for n in names)
    flags = kernels.cpu_flags()
    # Repacking is compiled into every x86-64 build; it registers where AVX2 is present.
    if "avx2" in flags:
        assert "CPU_REPACK" in names, names
    assert ("AMX" in names) <= ("amx_int8" in flags), (names, sorted(flags))


def test_the_real_probe_reaches_a_verdict_here() -> None:
    usable, why = kernels.run_probe()
    assert isinstance(usable, bool)
    if usable:
        assert why == ""
    else:       # a fault or a disagreement, named; never a probe that could not run
        assert "SIGSEGV" in why or "differ" in why or "signal" in why, why


def test_the_probe_reports_each_type_it_checked() -> None:
    out = subprocess.run([sys.executable, "-m", "bmoe.kernelprobe"], capture_output=True,
                         text=True, timeout=kernels.PROBE_TIMEOUT_S)
    if out.returncode < 0:          # this host's kernels fault: the verdict is the signal
        assert "kernel probe: " in out.stderr
        return
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if report["usable"]:
        from bmoe.kernelprobe import PROBE_TYPES
        assert sorted(report["checked"]) == sorted(PROBE_TYPES)
        assert all(0 <= e <= 0.05 for e in report["checked"].values()), report


def test_a_faulting_probe_is_a_named_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BMOE_KERNEL_PROBE_FAULT", "1")
    usable, why = kernels.run_probe()
    assert usable is False
    assert why.startswith("the kernel probe died with SIGSEGV at probe-q4_0.gguf: a batch "
                          "of 40"), why


# --- both branches through the server ---------------------------------------------------

@pytest.fixture(scope="module")
def q4_moe(model_dir: Path) -> Path:
    base = make_model(model_dir / "kernels-f32.gguf", n_embd=256, n_head=4, n_head_kv=2,
                      head_dim=64, n_ff_exp=256, n_layer=2, seed=11)
    return quantize(base, model_dir / "kernels-q4_0.gguf", "Q4_0")


def _serve(tmp: Path, model: Path, *args: str, env: dict[str, str] | None = None
           ) -> ServerProcess:
    return start_server(tmp, "-m", str(model), "-c", "1024", "--no-moe-stream", *args,
                        env=env)


def _batched_answer(srv: ServerProcess) -> dict[str, object]:
    status, _, body = srv.request("POST", "/completion", {
        "prompt": PROMPT, "n_predict": 6, "temperature": 0})
    assert status == 200, body
    assert body["tokens_evaluated"] > 50 and body["tokens_predicted"] == 6, body
    assert srv.proc.poll() is None
    return body


@pytest.fixture
def faulting(tmp_path: Path, q4_moe: Path) -> Iterator[ServerProcess]:
    env = {"BMOE_KERNEL_PROBE_FAULT": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    srv = _serve(tmp_path / "data", q4_moe, env=env)
    yield srv
    srv.stop()


def test_forced_unusable_loads_without_them_and_answers(faulting: ServerProcess,
                                                        tmp_path: Path) -> None:
    info = faulting.info()
    assert info["state"] == "ready", info
    k = info["model"]["kernels"]
    if not k["registered"]:
        assert k["decided_by"] == "none registered"
    elif "AMX" in k["registered"]:
        assert k["decided_by"] == "known fault" and k["extra_bufts"] is False
    else:
        assert k == {"extra_bufts": False, "registered": k["registered"], "mode": "auto",
                     "decided_by": "probe", "reason": k["reason"]}
        assert "SIGSEGV" in k["reason"]
        assert (tmp_path / "cache" / "bmoe" / "kernels.json").is_file()
    assert info["devices"][0]["repack"] is False
    _batched_answer(faulting)


def test_forced_usable_loads_with_them_and_answers(tmp_path: Path, q4_moe: Path) -> None:
    names = kernels.registered_extra_bufts()
    model = q4_moe
    srv = _serve(tmp_path, model, "--repack", "on")
    try:
        k = srv.info()["model"]["kernels"]
        assert k["mode"] == "on", k
        assert k["extra_bufts"] is (bool(names) and "AMX" not in names), k
        on = _batched_answer(srv)
    finally:
        srv.stop()
    srv = _serve(tmp_path, model, "-nr")
    try:
        k = srv.info()["model"]["kernels"]
        assert k["mode"] == "off" and k["extra_bufts"] is False, k
        off = _batched_answer(srv)
    finally:
        srv.stop()
    assert len(str(on["content"])) > 0 and len(str(off["content"])) > 0


def test_the_streamer_never_uses_them(tmp_path: Path, q4_moe: Path) -> None:
    srv = _serve(tmp_path, q4_moe, "--moe-stream", "--repack", "on")
    try:
        k = srv.info()["model"]["kernels"]
        assert srv.info()["model"]["streaming"] is True
        assert k["extra_bufts"] is False and k["decided_by"] == "streamer", k
        _batched_answer(srv)
    finally:
        srv.stop()


def test_a_bad_repack_value_is_refused_by_name(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bmoe.server", "--data-dir", str(tmp_path),
                          "--repack", "sometimes"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ))
    assert out.returncode != 0
    assert "repack" in out.stderr and "sometimes" in out.stderr, out.stderr


# --- repacking and memory ------------------------------------------------------------------

def test_repacking_stays_off_for_a_model_memory_cannot_hold() -> None:
    on = KernelChoice(True, ("CPU_REPACK",), "auto", "probe", "checked")
    gib = 1 << 30
    assert kernels.within_memory(on, 2 * gib, 8 * gib) is on
    assert kernels.within_memory(on, 2 * gib, 0) is on                 # room unknown
    off = KernelChoice(False, ("CPU_REPACK",), "off", "setting", "off")
    assert kernels.within_memory(off, 9 * gib, 1 * gib) is off
    for mode in ("auto", "on"):
        big = kernels.within_memory(KernelChoice(True, ("CPU_REPACK",), mode, "setting", ""),
                                    4 * gib, 2 * gib)
        assert big.extra_bufts is False and big.decided_by == "memory" and big.mode == mode
        assert big.reason.startswith("the model (4.0 GiB) does not fit the memory this "
                                     "process may hold (2.0 GiB)"), big.reason
    tight = kernels.within_memory(on, 2 * gib - kernels.REPACK_MARGIN + 1, 2 * gib)
    assert tight.extra_bufts is False


def test_a_model_larger_than_the_cap_on_the_file_mapping_loads_and_answers(
        tmp_path: Path, model_dir: Path) -> None:
    """llama.cpp on the file mapping (no streaming) under a memory cap smaller than the
    model, repacking asked for: it would copy the MXFP4 experts into memory and the cap
    would kill the process at load. The load keeps the file's layout, says why, and
    answers a batched prompt with the process inside its cap."""
    from bmoe.machine.cgroup import MemoryCap

    model = make_model(model_dir / "kernels-mxfp4-big.gguf", n_layer=12, n_embd=1024,
                       n_head=8, n_head_kv=4, head_dim=128, n_expert=32, n_expert_used=4,
                       n_ff_exp=1024, dtype="q8_0", expert_dtype="mxfp4", seed=12)
    size = model.stat().st_size
    cap = MemoryCap("bmoe-kernels-repack", 450 << 20)
    assert size > cap.limit + (150 << 20)
    cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
           str(tmp_path / "data"), "--no-auto", "--threads", "1", "-c", "1024", "-m",
           str(model), "--no-moe-stream", "--repack", "on"]
    proc = cap.popen(cmd, stdout=subprocess.PIPE, text=True,
                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        srv = ServerProcess(proc, line.split("listening on", 1)[1].strip(), tmp_path / "data")
        info = srv.wait_state("ready", "error")
        assert info["state"] == "ready", info
        k = info["model"]["kernels"]
        assert k["extra_bufts"] is False, k
        if k["registered"] and "AMX" not in k["registered"]:
            assert k["decided_by"] == "memory" and "does not fit the memory" in k["reason"], k
        _batched_answer(srv)
        assert cap.oom_kills() == 0 and proc.poll() is None
    finally:
        ServerProcess(proc, "", tmp_path / "data").stop()
        cap.remove()
