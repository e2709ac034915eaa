"""A prompt under a memory cap (issue 29, part 2): the budget leaves room for a batch.

The budget's arithmetic without I/O (`budget.resolve` against a given room, the edge
pages, `NoCache`'s bound, the one cgroup reader on v1 and v2 trees); then the real
thing: bmoe-cli's session and bmoe-server, streamed, planned and on mmap, in a real
memory cgroup whose limit leaves the process a few dozen MiB beyond what it holds after
the load — less than the whole set of experts, which a prefill routes to — with prompts
of 1, 512, 2,048 and 8,000 tokens. Each must answer with no OOM kill and a peak within
the limit, or refuse before the load with the figures. These tests need root and a
memory cgroup (v1 or v2): without them they fail, they do not skip.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bmoe.machine.cgroup import MemoryCap, cgroup_memory, read_group
from bmoe.engine.errors import LoadError
from bmoe.engine.experts import allocs
from bmoe.engine.experts.budget import (
    MIB,
    PAGE,
    RUNTIME_MARGIN,
    BatchShape,
    PromptNeeds,
    Room,
    batch_layer_bytes,
    edge_bytes,
    estimate_compute,
    resolve,
)
from bmoe.engine.experts.cache import NoCache
from bmoe.modelmaker import make_model
from bmoe.planner.plan import N_UBATCH, RUNTIME_RESERVE

PROMPTS = (1, 512, 2048, 8000)
CTX = 8448
# 4 layers x 64 experts, top-4, F32: an expert (gate+up+down) is 384 KiB, one layer's
# experts 24 MiB, a token cycle 6 MiB, all the experts 96 MiB (small widths: an
# 8,000-token prefill is compute, and this keeps it to seconds).
SHAPE = dict(n_layer=4, n_embd=128, n_expert=64, n_expert_used=4, n_ff_exp=256, seed=11)
ALL_EXPERTS = 96 * MIB
ROOM = 32 * MIB          # what the cap leaves the experts beyond the batch's other needs


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("prompt-memory") / "moe.gguf", **SHAPE)


# -- the arithmetic ------------------------------------------------------------------------


NEEDS = PromptNeeds(n_ubatch=512, compute=20 * MIB, compute_source="llama.cpp",
                    batch_layer=12 * MIB, edges=2 * MIB, runtime=RUNTIME_MARGIN, kv=8 * MIB)
CYCLE, ALL = 12 * MIB, 96 * MIB


def room(avail: int) -> Room:
    return Room(avail, "memory cgroup", limit=avail + 100 * MIB, held=100 * MIB)


def test_auto_leaves_what_a_batch_needs_beside_the_cache() -> None:
    avail = 200 * MIB
    b = resolve({"cache-mb": "auto", "cache-floor-mb": 0}, token_cycle=CYCLE,
                all_bytes=10 * ALL, needs=NEEDS, room=room(avail))
    assert b.bytes == avail - NEEDS.beside == 200 * MIB - 20 * MIB - 2 * MIB - RUNTIME_MARGIN
    assert b.peak + NEEDS.beside <= avail
    # the old arithmetic (no needs) gave the cache the whole room
    old = resolve({"cache-mb": "auto", "cache-floor-mb": 0}, token_cycle=CYCLE,
                  all_bytes=10 * ALL, room=room(avail))
    assert old.bytes - b.bytes == NEEDS.beside


def test_a_cache_below_a_batchs_layer_peaks_at_the_layer() -> None:
    needs = PromptNeeds(512, 4 * MIB, "llama.cpp", batch_layer=40 * MIB, runtime=RUNTIME_MARGIN)
    b = resolve({"cache-mb": 20}, token_cycle=CYCLE, all_bytes=ALL, needs=needs,
                room=room(200 * MIB))
    assert b.bytes == 20 * MIB and b.peak == 40 * MIB
    off = resolve({"cache-mb": 0}, token_cycle=CYCLE, all_bytes=ALL, needs=needs,
                  room=room(200 * MIB))
    assert off.bytes == 0 and off.peak == 40 * MIB      # no cache: a batch's layer set


def test_a_fixed_cache_that_does_not_fit_is_refused_with_the_figures() -> None:
    with pytest.raises(LoadError) as err:
        resolve({"cache-mb": 90}, token_cycle=CYCLE, all_bytes=ALL, needs=NEEDS,
                room=room(100 * MIB))
    msg = err.value.message
    free = (100 * MIB - NEEDS.beside) // MIB
    assert "{cache-mb} is 90 MiB" in msg and f"Lower {{cache-mb}} to {free} MiB" in msg
    assert "compute buffer 20 MiB" in msg and "100 MiB more" in msg
    assert "limit is 200 MiB" in msg and "KV cache 8 MiB" in msg
    with pytest.raises(LoadError, match=r"\{load-all\}"):
        resolve({"load-all": True}, token_cycle=CYCLE, all_bytes=ALL, needs=NEEDS,
                room=room(100 * MIB))


def test_no_room_at_all_names_the_context() -> None:
    for values in ({"cache-mb": "auto"}, {"cache-mb": 0}, {"cache-mb": 12}):
        with pytest.raises(LoadError) as err:
            resolve(values, token_cycle=CYCLE, all_bytes=ALL, needs=NEEDS,
                    room=room(NEEDS.beside + 5 * MIB))
        assert "{ctx-size}" in err.value.message, values


def test_edge_pages_are_the_pages_no_slice_owns_whole() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        offset, size, n = int(rng.integers(0, 1 << 20)) // 32 * 32, int(
            rng.integers(1, 40_000)) // 32 * 32 + 32, int(rng.integers(1, 12))
        pages = set(range(offset // PAGE, -(-(offset + size * n) // PAGE)))
        owned = {p for e in range(n) for p in pages
                 if offset + e * size <= p * PAGE and (p + 1) * PAGE <= offset + (e + 1) * size}
        assert edge_bytes([(offset, size, n)]) == (len(pages) - len(owned)) * PAGE


def test_the_planner_batches_as_the_session_does() -> None:
    from bmoe.engine.session import PREFILL_CHUNK
    assert N_UBATCH == PREFILL_CHUNK


def test_a_batch_routes_a_layer_to_at_most_every_expert() -> None:
    assert batch_layer_bytes([10, 30, 20], n_expert=64, k=4, n_ubatch=512) == 64 * 30
    assert batch_layer_bytes([10, 30, 20], n_expert=64, k=4, n_ubatch=1) == 4 * 30


def test_no_cache_holds_one_layers_set_through_a_batch() -> None:
    unit = np.full(4, 10)
    c = NoCache(4, unit, bound=4 * 2 * 10)            # a token cycle: top-2 of 4 layers
    for layer in range(4):                            # a decode step: 2 experts a layer
        assert c.admit(layer, np.array([0, 1])).victims == []
    assert c.resident_bytes == 80
    for layer in range(4):                            # a batch: every expert of a layer
        adm = c.admit(layer, np.arange(8))
        assert c.resident_bytes <= max(80, 8 * 10)
        assert all(v[0] != layer for v in adm.victims)
    assert c.resident_bytes == 80 and len(c.last[3]) == 8


# -- llama.cpp's figures -------------------------------------------------------------------


def test_the_compute_buffer_is_llama_cpps_own_figure_and_the_estimate_covers_it(
        moe: Path) -> None:
    import llama_cpp as lc
    from bmoe.engine import backend
    backend.start()
    mp = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(moe).encode(), mp)
    try:
        for ctx, ub in ((512, 512), (CTX, 512), (CTX, 128)):
            cp = lc.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = ctx, ub, ub
            tap = allocs.LogTap()
            tap.start()
            c = lc.llama_init_from_model(model, cp)
            got = tap.stop()
            lc.llama_free(c)
            assert got.compute is not None and got.compute > 0, tap.lines
            kv = SHAPE["n_layer"] * 2 * (2 * 16) * 2 * ctx           # F16 K and V
            assert got.kv is not None and 0 <= got.kv - kv <= MIB // 50  # logged to 0.01 MiB
            shape = BatchShape(SHAPE["n_embd"], SHAPE["n_ff_exp"], SHAPE["n_expert_used"],
                               lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)))
            est = estimate_compute(shape, ub, ctx)
            assert got.compute <= est <= 3 * got.compute + MIB, (ctx, ub, got, est)
        # the tap put the previous callback back: the session's, which drops INFO lines
        cb, data = lc.llama_log_callback(), ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
        assert ctypes.cast(cb, ctypes.c_void_p).value == ctypes.cast(
            backend.log_callback(), ctypes.c_void_p).value
    finally:
        lc.llama_model_free(model)


def test_the_streamer_budgets_with_the_reported_compute_buffer(moe: Path) -> None:
    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session
    s = Session(moe, {"temp": 0, "ctx-size": CTX, "threads": 2, "moe-stream": True,
                      "cache-mb": "auto", "cache-floor-mb": 0}, streamer_factory)
    try:
        st: Any = s.streamer
        needs = st.budget.needs
        assert needs.compute_source == "llama.cpp" and needs.compute > MIB
        assert needs.n_ubatch == 512 and needs.batch_layer == 24 * MIB
        assert needs.edges > 0 and needs.kv is not None
        assert st.budget.bytes + needs.beside <= st.budget.available
        assert st.load_info["prompt_needs"]["compute_source"] == "llama.cpp"
    finally:
        s.close()


# -- one cgroup reader -------------------------------------------------------------------


def _tree(root: Path, version: int, levels: list[tuple[str, int | None, int, int]]) -> str:
    """Write a fake hierarchy: (path, limit, usage, file bytes) per level; /proc/self/cgroup."""
    for path, limit, usage, file in levels:
        g = root / path.lstrip("/")
        g.mkdir(parents=True, exist_ok=True)
        if version == 1:
            (g / "memory.limit_in_bytes").write_text(str(limit or 9223372036854771712))
            (g / "memory.usage_in_bytes").write_text(str(usage))
            (g / "memory.stat").write_text(f"total_inactive_file {file}\ntotal_active_file 0\n")
        else:
            (g / "memory.max").write_text(str(limit) if limit else "max")
            (g / "memory.current").write_text(str(usage))
            (g / "memory.stat").write_text(f"anon 1\nfile {file}\n")
    own = levels[-1][0]
    return f"4:memory:{own}\n0::{own}\n" if version == 1 else f"0::{own}\n"


@pytest.mark.parametrize("version", [1, 2])
def test_the_reader_takes_the_tightest_level_up_to_the_root(tmp_path: Path,
                                                            version: int) -> None:
    mount = tmp_path / "cg"
    proc = _tree(mount, version, [("/", None, 5000 * MIB, 0),
                                  ("/a", 800 * MIB, 700 * MIB, 100 * MIB),   # 200 left
                                  ("/a/b", 2000 * MIB, 300 * MIB, 50 * MIB)])  # 1750 left
    fs = "cgroup - cgroup cgroup rw,memory" if version == 1 else "cgroup2 - cgroup2 cgroup2 rw"
    info = f"30 20 0:27 / {mount} rw,relatime shared:9 - {fs.split(' - ', 1)[1]}\n"
    cg = cgroup_memory(info, proc)
    assert cg is not None and cg.version == version
    assert cg.limit == 800 * MIB and cg.headroom == 200 * MIB and cg.held == 600 * MIB
    assert cg.group == mount / "a" / "b"
    # no limit on the path: None; a hybrid host's v1 memory controller wins over cgroup2
    free = tmp_path / "free"
    assert cgroup_memory(f"31 20 0:28 / {free} rw - {fs.split(' - ', 1)[1]}\n",
                         _tree(free, version, [("/", None, MIB, 0), ("/x", None, MIB, 0)])
                         ) is None


def test_budget_and_planner_read_the_same_limit_inside_a_real_cap() -> None:
    cap = MemoryCap("bmoe-pm-readers", 300 * MIB)
    try:
        code = ("from bmoe.engine.experts.budget import memory_room; "
                "from bmoe.planner.probes import probe_memory; "
                "r = memory_room(); m = probe_memory(); "
                "print(r.source, r.limit, r.avail, m.cgroup_limit, m.cgroup_headroom)")
        out = cap.run([sys.executable, "-c", code], timeout=60, check=True).stdout.split()
        assert out[0:2] == ["memory", "cgroup"]
        limit, avail, p_limit, p_headroom = (int(x) for x in out[2:])
        assert limit == p_limit == 300 * MIB
        assert abs(avail - p_headroom) < 2 * MIB and 0 < avail < 300 * MIB
    finally:
        cap.remove()


# -- real processes under a real cap -------------------------------------------------------


def prompt_text(model: Path, n: int) -> str:
    """Text of about `n` tokens by the model's tokenizer (the chat template adds a few)."""
    import llama_cpp as lc
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    m = lc.llama_model_load_from_file(str(model).encode(), mp)
    try:
        vocab = lc.llama_model_get_vocab(m)
        raw = ("The river runs past the old mill, and the town's market opens at dawn. "
               * (n // 10 + 2)).encode()
        buf = (lc.llama_token * len(raw))()
        k = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        out = bytearray()
        for t in buf[:min(k, max(1, n - 20))]:
            piece = ctypes.create_string_buffer(64)
            size = lc.llama_token_to_piece(vocab, t, piece, 64, 0, False)
            out += piece.raw[:size]
        return out.decode("utf-8", "replace")
    finally:
        lc.llama_model_free(m)


def session_lines(prompts: list[str]) -> str:
    reqs = [{"cmd": "generate", "id": i, "prompt": p, "n_predict": 2, "think": False}
            for i, p in enumerate(prompts)]
    return "".join(json.dumps(r) + "\n" for r in reqs) + '{"cmd": "close"}\n'


def cli(model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "bmoe.cli", "-m", str(model), "--session", "-c", str(CTX),
            "-t", "2", *flags]


def held_after_load(model: Path, cmd: list[str], ready: str) -> int:
    """What a front end holds once loaded (no cache), measured in a roomy cap."""
    cap = MemoryCap("bmoe-pm-base", 2048 * MIB)
    try:
        proc = cap.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=tempfile.gettempdir())
        assert proc.stdout is not None and proc.stdin is not None
        try:
            while ready not in (line := proc.stdout.readline()):
                assert line, "the front end ended before it was ready"
            if ready == "listening on":
                url = line.split("listening on", 1)[1].strip().rstrip("/")
                wait_ready(url)
            found = read_group(cap.version, cap.path, cap.path)
            assert found is not None
            return found.held
        finally:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
    finally:
        cap.remove()


@pytest.fixture(scope="module")
def cli_held(moe: Path) -> int:
    return held_after_load(moe, cli(moe, "--moe-stream"), "BMOE_READY")


def tight_cap(name: str, held: int, extra: int = 0) -> MemoryCap:
    """A cap that leaves the experts `ROOM` beyond what a batch needs beside them (the
    compute buffer is below 16 MiB here): far less than all the experts, which a prefill
    routes to, so the old budget (no room for a batch; no cache holding every layer's
    set) was OOM-killed under it. `extra` on top for the planner's own reserve."""
    limit = held + RUNTIME_MARGIN + 16 * MIB + ROOM
    assert limit < held + ALL_EXPERTS
    return MemoryCap(name, limit + extra)


def run_session(cap: MemoryCap, cmd: list[str], model: Path) -> tuple[list[dict[str, Any]],
                                                                       list[str]]:
    texts = [prompt_text(model, n) for n in PROMPTS]
    out = cap.run(cmd, timeout=600, input=session_lines(texts), cwd=tempfile.gettempdir())
    done = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
            if line.startswith("BMOE_DONE ")]
    errors = [json.loads(line.split(" ", 1)[1])["msg"] for line in out.stdout.splitlines()
              if line.startswith("BMOE_ERROR ")]
    return done, errors


def check_answered(cap: MemoryCap, done: list[dict[str, Any]], errors: list[str]) -> None:
    assert cap.oom_kills() == 0, f"OOM-killed (peak {cap.peak() / MIB:.1f} MiB)"
    assert not errors, errors
    assert len(done) == len(PROMPTS)
    got = [d["n_prompt"] for d in done]
    assert all(0.8 * n <= g <= n + 40 for n, g in zip(PROMPTS, got, strict=True)), got
    assert cap.peak() <= cap.limit


@pytest.mark.parametrize("flags", [["--moe-stream"],
                                   ["--moe-stream", "--cache-mb", "auto",
                                    "--cache-floor-mb", "0"],
                                   []], ids=["no-cache", "auto", "mmap"])
def test_a_cli_session_answers_every_prompt_under_the_cap(moe: Path, cli_held: int,
                                                          flags: list[str]) -> None:
    cap = tight_cap("bmoe-pm-cli", cli_held)
    try:
        done, errors = run_session(cap, cli(moe, *flags), moe)
        check_answered(cap, done, errors)
        if "auto" in flags:           # the cache took what the batch leaves, no more
            budget = done[-1]["cache_budget_mib"] * MIB
            assert 0 < budget <= cap.limit - cli_held - RUNTIME_MARGIN
    finally:
        cap.remove()


@pytest.mark.parametrize("cache_mb, when", [(90, "before the load"), (45, "after the load")])
def test_a_cache_that_cannot_fit_is_refused_before_the_load(moe: Path, cli_held: int,
                                                            cache_mb: int, when: str) -> None:
    """90 MiB cannot fit beside the dense weights alone: refused before llama.cpp loads
    anything. 45 MiB can, but not beside llama.cpp's compute buffer and the KV cache:
    refused once the context is made, before any expert is read or a prompt runs."""
    cap = tight_cap("bmoe-pm-refuse", cli_held)
    try:
        flags = ("--moe-stream", "--cache-mb", str(cache_mb))
        done, errors = run_session(cap, cli(moe, *flags), moe)
        assert cap.oom_kills() == 0 and not done
        assert len(errors) == 1, errors
        msg = errors[0]
        assert f"--cache-mb is {cache_mb} MiB" in msg and "Lower --cache-mb to" in msg, msg
        assert "it held" in msg and when in msg and "memory cgroup's limit is" in msg, msg
        assert "compute buffer" in msg and "one layer's experts at once (24 MiB)" in msg, msg
    finally:
        cap.remove()


# -- the server ------------------------------------------------------------------------


def wait_ready(url: str, timeout: float = 120.0) -> dict[str, Any]:
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/api/info", timeout=10) as r:
            info = json.loads(r.read())
        if info["state"] in ("ready", "error"):
            return info
        time.sleep(0.1)
    raise AssertionError("the server never got ready")


def server_cmd(model: Path, data: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
            "--threads", "2", "--ctx-size", str(CTX), "--model", str(model), *flags]


def completion(url: str, ids: list[int]) -> dict[str, Any]:
    body = json.dumps({"prompt": ids, "n_predict": 2, "temperature": 0,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("flags", [["--no-auto", "--cache-floor-mb", "0"], ["--auto"]],
                         ids=["auto-cache", "planned"])
def test_the_server_answers_every_prompt_under_the_cap(moe: Path, tmp_path: Path,
                                                       flags: list[str]) -> None:
    held = held_after_load(moe, server_cmd(moe, tmp_path / "base", "--no-auto",
                                           "--cache-mb", "0"), "listening on")
    # the planner keeps its own reserve for what a load adds (RUNTIME_RESERVE)
    cap = tight_cap("bmoe-pm-server", held, RUNTIME_RESERVE if "--auto" in flags else 0)
    proc = cap.popen(server_cmd(moe, tmp_path / "data", *flags), stdout=subprocess.PIPE,
                     text=True, cwd=tempfile.gettempdir())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        url = line.split("listening on", 1)[1].strip().rstrip("/")
        info = wait_ready(url)
        assert info["state"] == "ready", info
        for n in PROMPTS:
            ids = [5 + (i * 7919) % 500 for i in range(n)]
            reply = completion(url, ids)
            assert reply["timings"]["prompt_n"] == n
        assert cap.oom_kills() == 0 and proc.poll() is None
        assert cap.peak() <= cap.limit
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        cap.remove()
