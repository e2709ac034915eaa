"""Expert streaming: byte-identical tokens, llama.cpp's own routing, the cache, the budget.

The gates of issue 7: greedy tokens of the streamed engine equal the plain resident
engine's (llama.cpp on mmap, no streamer) for every cache mode, across a KV-prefix reuse
and after cancelled turns; the routing the streamer captures is the router's choice.
Issue 16 adds the same gates for read-ahead (every depth, with and without overlap, a
predictor forced to guess wrong), the cache policies, the load that reads no experts, and
the graph callback: the native one (the default, so every gate here runs it) against the
Python one, its fallback, and its calls into Python.
Models are tiny ones the model maker writes; the sessions run the way the server runs them
(Session + turn.prepare/run_turn).
"""

from __future__ import annotations

import ctypes
import mmap
import errno
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as lc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from bmoe.engine.errors import EngineError, LoadError
from bmoe.engine.experts import ExpertStreamer, evalcb, ggml, nopopulate, streamer_factory
from bmoe.engine.experts import packed
from bmoe.engine.experts import reader as reader_mod
from bmoe.engine.experts import streamer as streamer_mod
from bmoe.engine.experts.budget import MIB, resolve
from bmoe.engine.experts.cache import ExpertCache, NoCache
from bmoe.engine.experts.layout import read_layout
from bmoe.engine.experts.memory import AnonBuffer, physical_runs
from bmoe.engine.experts.predict import Predictor, router_input
from bmoe.engine.experts.repack import row_bytes
from bmoe.engine.experts.streamer import take_spare
from bmoe.modelmaker import make_model
from bmoe.engine.session import Session
from bmoe.engine.turn import TurnRequest, prepare, run_turn

# The resident baseline runs the kernels the streamer runs: the file's own layout
# (repack off). With llama.cpp's repacked or AMX kernels a resident engine computes
# other bits on some CPUs (tests/test_kernels.py checks that choice on its own).
BASE = {"temp": 0, "ctx-size": 512, "threads": 2, "repack": "off"}
STREAM = {"moe-stream": True, "io-threads": 2}
N_TOKENS = 24
QUESTION = [{"role": "user", "content": "Hello there! What is the weather like in Paris and "
                                        "in London today? Please answer in one sentence."}]
FOLLOW_UP = {"role": "user", "content": "And tomorrow, will it rain in the evening?"}

# 4 layers x 8 experts, top-4, f32: one expert (gate+up+down) is 96 KiB, a token cycle
# 1.5 MiB, all experts 3 MiB: a 2 MiB cache must evict, a 1 MiB one is below a cycle.
# residual_scale 0.3 (not the maker's 0.05) makes the experts' output large enough that
# a wrong or missing expert changes the greedy tokens, not only the logits.
MOE = dict(n_layer=4, n_embd=128, n_expert=8, n_expert_used=4, n_ff_exp=64,
           residual_scale=0.3)


# gpt-oss's layout (F16 routers, so read-ahead guesses by them): 4 layers x 16 experts,
# top-4; an expert is 3 x 256 x 128 MXFP4 (51 KiB, 12.75 pages: no slots), all experts
# 3.2 MiB, a token cycle 816 KiB, a layer 816 KiB: a 2 MiB cache evicts and holds two
# layers of a prompt batch
OSS = dict(MOE, n_expert=16, n_ff_exp=256, head_dim=64, dtype="f16", expert_dtype="mxfp4",
           router_skew=1.0, context_mix=1.5, seed=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("experts")
    return {
        "moe": make_model(d / "moe.gguf", **MOE),
        "moe-f16": make_model(d / "moe-f16.gguf", dtype="f16", router_skew=1.0, seed=3,
                              **MOE),
        "dense": make_model(d / "dense.gguf", arch="qwen3"),
        # 512 KiB slices (128 pages): enough pages to see how physically contiguous they are
        "moe-wide": make_model(d / "moe-wide.gguf", n_layer=2, n_embd=512, n_expert=8,
                               n_expert_used=4, n_ff_exp=512, dtype="f16", residual_scale=0.3,
                               seed=5),
        # gpt-oss's layout: biases on the router and on every expert's outputs (read by
        # the expert ids: add_id), attention sinks, sliding-window layers; MXFP4 experts
        "moe-oss": make_model(d / "moe-oss.gguf", arch="gpt-oss", **OSS),
        # slices of 500,000 bytes: their interiors are 122 or 123 pages, by their phase
        "moe-odd": make_model(d / "moe-odd.gguf", n_layer=2, n_embd=500, n_expert=8,
                              n_expert_used=4, n_ff_exp=500, dtype="f16", residual_scale=0.3,
                              seed=6),
    }


# -- driving sessions the way the server does ------------------------------------------


def python_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read queue on Python threads (`BMOE_LANES=python`): for the tests that replace
    the reader's Python read functions (the C lanes, bmoe/native/readlanes.c, never call
    them; tests/test_readlanes.py and test_faults_streaming.py test those)."""
    monkeypatch.setenv(reader_mod.LANES_ENV, "python")


def open_session(path: Path, **values: Any) -> Session:
    return Session(path, {**BASE, **values}, streamer_factory)


def turn(session: Session, messages: list[dict[str, Any]], *, n: int = N_TOKENS,
         cancel_at: int = 0, cancel: threading.Event | None = None
         ) -> tuple[list[int], dict[str, Any], list[dict[str, Any]]]:
    req = TurnRequest(messages=messages, max_tokens=n, think=False)
    prepared = prepare(session, req)
    cancel = cancel or threading.Event()
    records: list[dict[str, Any]] = []

    def emit(ev: Any, rec: dict[str, Any]) -> None:
        records.append(dict(rec, telemetry=ev.telemetry))
        if cancel_at and ev.step >= cancel_at:
            cancel.set()

    result = run_turn(session, prepared, req, cancel, emit)
    return result.generation.tokens, result.summary, records


Turns = list[tuple[list[int], bytes]]


def conversation(session: Session) -> Turns:
    """Two turns, the second reusing the first's KV prefix: each turn's greedy tokens and
    the bytes of the last logits it computed (bit-for-bit, a stronger check than tokens)."""
    first, _, _ = turn(session, QUESTION)
    out = [(first, session.logits_row().tobytes())]
    text = "".join(session.token_text(t) for t in first)
    second, summary, _ = turn(session, QUESTION + [{"role": "assistant", "content": text},
                                                   FOLLOW_UP])
    prompt_len = summary["n_past"] - len(second) + 1
    assert summary["n_prompt"] < prompt_len - 20, "the second turn reused no KV prefix"
    out.append((second, session.logits_row().tobytes()))
    return out


_reference: dict[str, Turns] = {}


def resident(models: dict[str, Path], name: str, **values: Any) -> Turns:
    """The plain resident engine's tokens for `conversation` (computed once per model and
    values: BASE's, or with `values` over them)."""
    key = name + "".join(f"+{k}={v}" for k, v in sorted(values.items()))
    if key not in _reference:
        s = Session(models[name], dict(BASE, **values))
        try:
            assert s.streamer is None
            _reference[key] = conversation(s)
        finally:
            s.close()
    return _reference[key]


def streamed(path: Path, check: Callable[[ExpertStreamer], None] | None = None,
             **values: Any) -> Turns:
    s = open_session(path, **{**STREAM, **values})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        tokens = conversation(s)
        if check:
            check(s.streamer)
        return tokens
    finally:
        s.close()


# -- the gates: byte-identical greedy tokens ---------------------------------------------


@pytest.mark.parametrize("name", ["moe", "moe-f16", "moe-oss"])
def test_cache_off_matches_resident(models: dict[str, Path], name: str) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.summary()["cache_hit_pct"] == -1
        assert st.stats()["read_bytes"] > 0

    assert streamed(models[name], check, **{"cache-mb": 0}) == resident(models, name)


@pytest.mark.parametrize("name", ["moe", "moe-oss"])
def test_small_cache_evicts_and_matches(models: dict[str, Path], name: str) -> None:
    def check(st: ExpertStreamer) -> None:
        s = st.summary()
        assert s["cache_budget_mib"] == 2.0
        assert s["cache_evictions"] > 0 and s["cache_rereads"] > 0
        assert s["cache_resident_mib"] <= 2.0
        assert 0 < s["cache_hit_pct"] < 100

    assert streamed(models[name], check, **{"cache-mb": 2}) == resident(models, name)


def test_auto_cache_matches(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.budget.mode == "auto"
        assert st.budget.bytes == st.layout.expert_bytes   # plenty of memory: everything

    values = {"cache-mb": "auto", "cache-floor-mb": 64}
    assert streamed(models["moe-f16"], check, **values) == resident(models, "moe-f16")


def test_load_all_matches(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.summary()["cache_hit_pct"] == 100.0
        assert st.load_info["load_all_mib"] == pytest.approx(3.0, abs=0.05)
        assert st.stats()["read_bytes"] == 0       # nothing read after the load
        assert "page_folios" not in st.load_info   # nothing turns over: no fresh pages

    assert streamed(models["moe"], check, **{"load-all": True}) == resident(models, "moe")


def test_a_prompt_longer_than_a_prefill_chunk_matches(models: dict[str, Path]) -> None:
    # Prefill decodes 512 tokens at a time and only the last chunk outputs logits: the
    # last layer of the other chunks routes zero tokens.
    long = [{"role": "user", "content": "Tell me about the weather in every city. " * 90}]
    ref = Session(models["moe"], dict(BASE, **{"ctx-size": 2048}))
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2, "ctx-size": 2048})
    try:
        want, _, _ = turn(ref, long, n=8)
        got, summary, _ = turn(s, long, n=8)
        assert summary["n_prompt"] > 512
        assert got == want and ref.logits_row().tobytes() == s.logits_row().tobytes()
    finally:
        s.close()
        ref.close()


@pytest.mark.parametrize("name", ["moe", "moe-f16", "moe-oss"])
@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "on-demand"])
def test_prefill_read_ahead_matches(models: dict[str, Path], name: str, ahead: bool) -> None:
    """A long prompt under a small cache: with prompt read-ahead the next layer's experts
    are read while a layer computes; the tokens and the last logits stay the resident
    engine's, byte for byte (moe-f16's routers are F16: guessed by the router; moe's are
    not: every expert of the next layer, as a batch routes to nearly all)."""
    long = [{"role": "user", "content": "Tell me about the weather in every city. " * 90}]
    ref = Session(models[name], dict(BASE, **{"ctx-size": 2048}))
    # below every expert (3 / 1.5 / 3.2 MiB), two layers' sets
    cap = {"moe": 2, "moe-f16": 1, "moe-oss": 2}[name]
    s = open_session(models[name], **STREAM, **{"cache-mb": cap, "ctx-size": 2048,
                                                "prefill-ahead": ahead})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        want, _, _ = turn(ref, long, n=8)
        got, summary, _ = turn(s, long, n=8)
        assert summary["n_prompt"] > 512
        assert got == want and ref.logits_row().tobytes() == s.logits_row().tobytes()
        figures = st.summary()
        if ahead:
            assert st.load_info["prefill_ahead"].startswith("the next layer's experts")
            assert st.queue is not None
            assert figures["prefill_ahead"] and figures["prefill_ahead_mib"] > 0
            assert figures["spec_prefetched"] > 0 and figures["spec_useful"] > 0
            assert figures["spec_useful"] <= figures["spec_prefetched"]
        else:
            assert "prefill_ahead" not in st.load_info and st.queue is None
            assert not figures["prefill_ahead"] and figures["spec_prefetched"] == 0
        assert figures["cache_resident_mib"] <= figures["cache_budget_mib"]
    finally:
        s.close()
        ref.close()


@pytest.mark.parametrize("name", ["moe", "moe-oss"])
def test_prefill_read_ahead_follows_the_ubatches(models: dict[str, Path], name: str) -> None:
    """A prompt in two chunks of 512 tokens, each two ubatches of 256: every ubatch's
    first layer is read ahead before its routing (from the chunk's start, and while the
    ubatch before computes its last layers), and nothing is read ahead for the rows the
    model's last layer skips where llama.cpp skips them (it runs only the prompt's last
    row; gpt-oss's graph runs them all); the tokens and the last logits stay the resident
    engine's, byte for byte."""
    long = [{"role": "user", "content": "Tell me about the weather in every city. " * 45}]
    sizes = {"batch-size": 512, "ubatch-size": 256, "ctx-size": 2048}
    ref = Session(models[name], dict(BASE, **sizes))
    s = open_session(models[name], **STREAM, **{"cache-mb": 2, **sizes})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.queue is not None
        firsts: list[int] = []
        queued: dict[int, int] = {}
        ahead_first, queue_guess = st._ahead_first, st._queue_guess

        def spy_first(n: int) -> None:
            firsts.append(n)
            ahead_first(n)

        def spy_queue(j: int, guess: np.ndarray, prio: int, c: Any) -> Any:
            if st._in_prefill:                  # not the answer's read-ahead
                queued[j] = queued.get(j, 0) + len(guess)
            return queue_guess(j, guess, prio, c)

        st._ahead_first = spy_first            # type: ignore[method-assign]
        st._queue_guess = spy_queue            # type: ignore[method-assign]
        want, _, _ = turn(ref, long, n=8)
        got, summary, _ = turn(s, long, n=8)
        n = summary["n_prompt"]
        assert 768 < n <= 1024
        assert got == want and ref.logits_row().tobytes() == s.logits_row().tobytes()
        rest = n - 768
        # chunk 1: at its start, then from ubatch 1 (for 2) and ubatch 2 (for 3);
        # chunk 2: at its start (ubatch 3, queued already), then from ubatch 3 (for 4)
        # (gpt-oss: ubatch 1 asks twice, before and after its last layer showed that it
        # runs every row; the second finds the reads queued)
        assert firsts == ([256, 256, 256, 256, rest] if name == "moe" else
                          [256, 256, 256, 256, 256, rest])
        assert rest * MOE["n_expert_used"] >= 16
        last = MOE["n_layer"] - 1
        if name == "moe":
            # llama.cpp runs this family's last layer on the output rows only: at most
            # the last row's top-k, guessed once (not every expert for each ubatch, as
            # each one's 256 rows would route to)
            assert st._last_cut is True
            assert 0 < queued[last] <= MOE["n_expert_used"]
        else:
            # gpt-oss's last layer runs every row: learned at the first ubatch (read on
            # demand there), then read ahead for all the rows of the three after it
            assert st._last_cut is False
            assert queued[last] > 2 * MOE["n_expert_used"]
        assert queued[0] >= 4 * (MOE["n_expert"] if name == "moe" else OSS["n_expert"])
        assert st.summary()["spec_useful"] > 0
    finally:
        s.close()
        ref.close()


def test_prompt_batches_keep_the_first_layers(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's batches loop over the layers, every layer asked for nearly all of its
    experts at every ubatch: asked to (`BMOE_PROMPT_KEEP=1`), they keep the first
    streamed layers where the cache has room for them beside two layers' batch sets
    (`_start_prompt_keep`), so later ubatches and the next prompt find them cached. An
    8-layer gpt-oss model under a 3 MiB cache (a batch's layer is 0.8 MiB: one kept); a
    900-token prompt in four ubatches of 256, then a follow-up prompt. The tokens and last
    logits stay the resident engine's; with keeping on, layer 0 is cached whole after
    each prompt and the prompts read fewer bytes than without."""
    model = make_model(tmp_path / "oss8.gguf", arch="gpt-oss", **dict(OSS, n_layer=8))
    long = [{"role": "user", "content": "Tell me about the weather in every city. " * 45}]
    sizes = {"batch-size": 512, "ubatch-size": 256, "ctx-size": 2048}
    ref = Session(model, dict(BASE, **sizes))
    try:
        want = turn(ref, long, n=1)[0]
        want_logits = ref.logits_row().tobytes()
        text = "".join(ref.token_text(t) for t in want)
        follow = long + [{"role": "assistant", "content": text},
                         {"role": "user", "content": "And tomorrow, in the evening? " * 20}]
        want2 = turn(ref, follow, n=1)[0]
        want2_logits = ref.logits_row().tobytes()
    finally:
        ref.close()
    reads: dict[str, tuple[float, float]] = {}
    for keep in ("on", "0"):                 # asked for, then not
        monkeypatch.setenv(streamer_mod.KEEP_ENV, keep)
        s = open_session(model, **STREAM, **{"cache-mb": 3, **sizes})
        try:
            st = s.streamer
            assert isinstance(st, ExpertStreamer) and isinstance(st.cache, ExpertCache)
            got, summary, _ = turn(s, long, n=1)
            assert summary["n_prompt"] > 768                   # four ubatches
            assert got == want and s.logits_row().tobytes() == want_logits
            first = st.summary()["prefill_read_mib"]
            if keep == "on":
                assert st.load_info["prompt_keeps"] == "on: layer 0 (1 of 8, 1 MiB)"
                assert st.summary()["prompt_keeps"] == st.load_info["prompt_keeps"]
                assert st.cache.resident[0].all()
            else:
                assert st.load_info["prompt_keeps"] == \
                    "off: not asked for (BMOE_PROMPT_KEEP=1)"
            got2, _, _ = turn(s, follow, n=1)
            assert got2 == want2 and s.logits_row().tobytes() == want2_logits
            reads[keep] = (first, st.summary()["prefill_read_mib"])
            if keep == "on":
                assert st.cache.resident[0].all()
            figures = st.summary()
            assert figures["cache_resident_mib"] <= figures["cache_budget_mib"]
        finally:
            s.close()
    # each later pass of the first prompt and the whole follow-up skip layer 0
    assert reads["on"][0] < reads["0"][0] and reads["on"][1] < reads["0"][1], reads


def test_the_cache_pages_are_committed_ahead_of_the_first_prompt(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that turns over commits its pages in the background after the load
    (`_start_page_reserve`, `PageSupply.reserve`), within its budget; the first prompt's
    misses then take those pages instead of faulting fresh ones in the lanes, and its
    tokens are the resident engine's. `BMOE_PAGE_RESERVE=0` turns it off, and says so; a
    cache that holds every expert never turns over and commits nothing ahead."""
    ref = open_session(models["moe-oss"])
    try:
        want = turn(ref, QUESTION)[0]
    finally:
        ref.close()
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 3})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.reader is not None
        supply = st.reader.supply
        assert supply is not None and st._reserve is not None
        st._reserve.join(60)
        note = st.load_info["page_reserve"]
        assert re.fullmatch(r"\d+ MiB committed in [\d.]+ s \((the cache holds its budget|"
                            r"reached its limit)\)", note), note
        assert 0 < supply.reserved_bytes <= st.budget.bytes
        assert supply.reserve_left == supply.reserved_bytes        # nothing read yet
        assert turn(s, QUESTION)[0] == want
        assert supply.reserve_given_bytes > 0   # the first misses took committed pages
        # what the cache's slices hold inside their edge pages (budgeted apart), and what
        # is still parked, stay within the budget
        inside = sum(buf.interior(int(e) * t.slice_bytes, (int(e) + 1) * t.slice_bytes)[1]
                     for layer, pairs in st._by_layer.items() for t, buf in pairs
                     for e in np.flatnonzero(st.cache.resident[layer]))
        assert 0 < inside
        assert inside + supply.parked_bytes + supply.reserve_left <= st.budget.bytes
        assert st.summary()["pages_reserved_mib"] > 0
    finally:
        s.close()
    monkeypatch.setenv(streamer_mod.RESERVE_ENV, "0")
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 3})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["page_reserve"] == "off: BMOE_PAGE_RESERVE=0"
        assert s.streamer._reserve is None
        assert turn(s, QUESTION)[0] == want
    finally:
        s.close()
    monkeypatch.delenv(streamer_mod.RESERVE_ENV)
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 8})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["page_reserve"].startswith("off: ")
        assert s.streamer._reserve is None
    finally:
        s.close()


def test_prompt_keeping_needs_room_for_three_layers(models: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for, a cache with room for fewer than three layers' batch sets keeps none
    (the layer computing and the next one read ahead need two), and says why; one that
    holds every expert has nothing to keep. Not asked for, none is kept."""
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 3})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["prompt_keeps"] == \
            "off: not asked for (BMOE_PROMPT_KEEP=1)"
        assert s.streamer._prompt_keep is None
    finally:
        s.close()
    monkeypatch.setenv(streamer_mod.KEEP_ENV, "1")
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 2})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["prompt_keeps"].startswith(
            "off: the cache (2 MiB) holds fewer than three layers' experts")
    finally:
        s.close()
    s = open_session(models["moe-oss"], **STREAM, **{"cache-mb": 8})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["prompt_keeps"] == "off: the cache holds every expert"
    finally:
        s.close()


def test_prefill_read_ahead_needs_room_for_two_layers(models: dict[str, Path]) -> None:
    """A cache below two layers' batch sets: the layer computing holds its set, the next
    one's would find no room, so prompt read-ahead stays off and says why."""
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 1, "force-cache": True})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        assert st.load_info["prefill_ahead"].startswith("off: the cache (1 MiB) holds fewer")
        assert st.queue is None and not st.summary()["prefill_ahead"]
        from bmoe.engine.experts.memory import folio_note
        assert st.load_info["page_folios"] == folio_note()     # a cache that turns over
    finally:
        s.close()


def test_forced_cache_below_a_token_cycle_still_matches(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.summary()["cache_budget_mib"] == 1.0
        assert st.summary()["cache_evictions"] > 0

    values = {"cache-mb": 1, "force-cache": True}
    assert streamed(models["moe"], check, **values) == resident(models, "moe")


def test_dense_weights_on_the_mapping_match(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert 0.0 < st.dense_resident_frac() <= 1.0

    values = {"cache-mb": 2, "dense-weights": "mmap"}
    assert streamed(models["moe"], check, **values) == resident(models, "moe")


def test_cancelled_turns_then_a_new_one_match(models: dict[str, Path]) -> None:
    ref = Session(models["moe"], dict(BASE))
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        # cancelled while decoding, after 3 tokens: both engines the same way
        want, _, _ = turn(ref, QUESTION, cancel_at=3)
        got, summary, _ = turn(s, QUESTION, cancel_at=3)
        assert summary["cancelled"] and got == want and len(got) == 3
        # cancelled in the middle of a prefill graph, between two layers' expert loads
        cancel = threading.Event()
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        ensure = st.ensure

        def ensure_then_cancel(layer: int, ids: np.ndarray) -> Any:
            if layer == 1:
                cancel.set()
            return ensure(layer, ids)

        st.ensure = ensure_then_cancel  # type: ignore[method-assign]
        other = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]
        got, summary, _ = turn(s, other, cancel=cancel)
        st.ensure = ensure  # type: ignore[method-assign]
        assert summary["cancelled"] and got == []
        # a new turn after both
        want, _, _ = turn(ref, other)
        got, _, _ = turn(s, other)
        assert got == want and len(got) == N_TOKENS
    finally:
        s.close()
        ref.close()


# -- read-ahead: every mode byte-identical ----------------------------------------------------


def check_read_ahead(st: ExpertStreamer) -> None:
    s = st.summary()
    assert st.predictor is not None and st.queue is not None
    assert s["spec_prefetched"] > 0 and s["spec_read_mib"] > 0
    assert 0 <= s["spec_recall_pct"] <= 100 and s["spec_useful"] <= s["spec_prefetched"]
    assert s["cache_resident_mib"] <= s["cache_budget_mib"]


@pytest.mark.parametrize("values", [
    {"prefetch": 1},
    {"prefetch": 1, "overlap": True},
    {"prefetch": 2, "overlap": True},
    {"prefetch": 3, "overlap": True, "spec-gate": 0.2},
    {"prefetch": 2, "overlap": True, "cache-policy": "lru"},
    {"prefetch": 1, "overlap": True, "io-threads": 1},
], ids=["next", "next-overlap", "depth2-overlap", "depth3-gate", "depth2-lru", "one-lane"])
def test_read_ahead_matches(models: dict[str, Path], values: dict[str, Any]) -> None:
    assert streamed(models["moe"], check_read_ahead, **{"cache-mb": 2, **values}) \
        == resident(models, "moe")


@pytest.mark.parametrize("values", [
    {"prefetch": 2, "overlap": True},
    {"prefetch": 1, "overlap": True, "cache-policy": "reuse"},
], ids=["depth2-overlap", "reuse"])
def test_read_ahead_on_gpt_oss_matches(models: dict[str, Path], values: dict[str, Any]) -> None:
    """gpt-oss's experts have biases the graph adds by the same expert ids (add_id) after
    the matmuls: the streamed experts and the resident biases still meet, and the router's
    own bias is in the guesses (C and numpy)."""
    def check(st: ExpertStreamer) -> None:
        check_read_ahead(st)
        assert st.layout.arch == "gpt-oss"
        assert "with 4 routers' biases, guessed in C" in st.load_info["predictor"]
        assert st.summary()["cache_evictions"] > 0

    assert streamed(models["moe-oss"], check, **{"cache-mb": 2, **values}) \
        == resident(models, "moe-oss")


@pytest.mark.parametrize("overlap", [False, True])
def test_wrong_guesses_only_cost_bandwidth(models: dict[str, Path], overlap: bool) -> None:
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2, "prefetch": 2,
                                                 "overlap": overlap})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.predictor is not None
        st.predictor.invert = True          # the test knob: guess the least likely experts
        got = conversation(s)
        summary = st.summary()
        assert summary["spec_prefetched"] > 0
        assert summary["spec_precision_pct"] < 20    # (nearly) every guess wrong
    finally:
        s.close()
    assert got == resident(models, "moe")


@pytest.mark.parametrize("policy", ["lru", "lfu", "next-use", "reuse"])
def test_cache_policies_match(models: dict[str, Path], policy: str) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.summary()["cache_policy"] == policy
        assert st.summary()["cache_evictions"] > 0

    values = {"cache-mb": 2, "cache-policy": policy}
    assert streamed(models["moe"], check, **values) == resident(models, "moe")


def test_read_ahead_is_off_without_a_cache(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.predictor is None and st.summary()["spec_recall_pct"] == -1

    values = {"cache-mb": 0, "prefetch": 2, "overlap": True}
    assert streamed(models["moe"], check, **values) == resident(models, "moe")


def test_cancelled_turns_with_read_ahead_match(models: dict[str, Path]) -> None:
    ref = Session(models["moe"], dict(BASE))
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2, "prefetch": 2,
                                                 "overlap": True})
    try:
        want, _, _ = turn(ref, QUESTION, cancel_at=3)
        got, summary, _ = turn(s, QUESTION, cancel_at=3)
        assert summary["cancelled"] and got == want
        other = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]
        want, _, _ = turn(ref, other)
        got, _, _ = turn(s, other)
        assert got == want and len(got) == N_TOKENS
    finally:
        s.close()
        ref.close()


def test_the_load_reads_no_experts(models: dict[str, Path]) -> None:
    lib = nopopulate._libllama()
    slots = nopopulate.import_slots(lib, set(nopopulate._SHIMS))
    base = nopopulate._load_address(lib)
    before = {o: ctypes.c_void_p.from_address(base + o).value
              for offs in slots.values() for o in offs}
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        assert s.streamer.load_info["load_reads"] == "dense weights only"
        after = {o: ctypes.c_void_p.from_address(base + o).value for o in before}
        assert after == before                 # libllama's imports are restored at attach
    finally:
        s.close()


# -- routing: the ids the streamer captures are the router's --------------------------------


class RouterProbe:
    """A bare Streamer that records the router's logits, its input and ffn_moe_topk as
    llama.cpp computed them, without moving any weight (the plain resident engine)."""

    def __init__(self) -> None:
        self.rows: dict[str, np.ndarray] = {}
        self.cb = lc.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, t: int, ask: bool, _user: Any) -> bool:
        name = ctypes.string_at(t + ggml.OFF_NAME).decode()
        kind = name.rsplit("-", 1)[0]
        if kind not in ("ffn_moe_topk", "ffn_moe_logits", "ffn_norm", "attn_post_norm"):
            return False
        if ask:
            return True
        tt = ggml.tensor_at(t)
        ne0, ne1, nb1 = int(tt.ne[0]), int(tt.ne[1]), int(tt.nb[1])
        ctype = ctypes.c_int32 if kind == "ffn_moe_topk" else ctypes.c_float
        flat = np.ctypeslib.as_array((ctype * ((ne1 - 1) * nb1 // 4 + ne0)).from_address(tt.data))
        rows = np.lib.stride_tricks.as_strided(flat, (ne1, ne0), (nb1, 4)).copy()
        self.rows[name] = rows
        return True

    def configure_model_params(self, params: Any) -> None:
        pass

    def configure_context_params(self, params: Any) -> None:
        params.cb_eval = self.cb
        params.cb_eval_user_data = None

    def attach(self, model: Any, ctx: Any) -> None:
        pass

    def prefill_begin(self) -> None:
        pass

    def batch_begin(self, n_tokens: int, n_outputs: int, n_after: int) -> None:
        pass

    def prefill_end(self) -> None:
        pass

    def token_begin(self) -> None:
        pass

    def token_end(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def failure(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def teacher_forced(session: Session, tokens: list[int], each: Callable[[int], None]) -> None:
    for i in range(1, len(tokens) + 1):
        session.prefill(tokens[:i], threading.Event())
        each(i - 1)


def streamed_routing(s: Session, tokens: list[int]) -> np.ndarray:
    """Teacher-force `tokens` one at a time through a streamed session whose streamer
    records its routing; that routing, [tokens, layers, k]."""
    st = s.streamer
    assert isinstance(st, ExpertStreamer) and st.record_routing
    for i in range(1, len(tokens) + 1):
        st.token_begin()
        s.prefill(tokens[:i], threading.Event())
        st.token_end()
    return np.array(st.routing)


@pytest.mark.parametrize("name", ["moe-f16", "moe-oss"])
def test_routing_capture_is_llama_cpps_choice(models: dict[str, Path], name: str) -> None:
    """The routing the streamer captures is llama.cpp's: the top k of the router's logits
    (W h, plus the router's bias in gpt-oss, whose FFN input is `attn_post_norm`)."""
    path = models[name]
    probe = RouterProbe()
    plain = Session(path, dict(BASE), lambda _s: probe)
    s = open_session(path, **STREAM, **{"cache-mb": 0})
    st = s.streamer
    assert isinstance(st, ExpertStreamer)
    st.record_routing = True
    text = "The quick brown fox jumps over the lazy dog; then it rains in Paris."
    tokens = plain.tokenize(text)
    reader = gguf.GGUFReader(path)
    routers = {int(t.name.split(".")[1]): np.array(t.data, dtype=np.float32)
               for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    biases = {int(t.name.split(".")[1]): np.array(t.data, dtype=np.float32)
              for t in reader.tensors if t.name.endswith("ffn_gate_inp.bias")}
    assert bool(biases) == (name == "moe-oss")
    assert all(np.abs(b).max() > 0.05 for b in biases.values())   # they move the choice
    norm = "attn_post_norm" if biases else "ffn_norm"
    k = read_layout(path).n_expert_used
    by_llama: list[np.ndarray] = []

    def check_plain(_i: int) -> None:
        layers = []
        for layer, w in sorted(routers.items()):
            ids = probe.rows[f"ffn_moe_topk-{layer}"][-1]
            logits = probe.rows[f"ffn_moe_logits-{layer}"][-1]
            hidden = probe.rows[f"{norm}-{layer}"][-1]
            # the router's logits are W_gate_inp @ its input, and topk is their top k
            # (after the router's bias, where it has one)
            np.testing.assert_allclose(w @ hidden, logits, rtol=2e-3, atol=2e-3)
            chosen = logits + biases.get(layer, 0.0)
            assert set(ids.tolist()) == set(np.argsort(-chosen, kind="stable")[:k].tolist())
            layers.append(ids)
        by_llama.append(np.array(layers))

    try:
        teacher_forced(plain, tokens, check_plain)
        streamed_routing(s, tokens)
        assert len(st.routing) == len(tokens) == len(by_llama)
        for got, want in zip(st.routing, by_llama, strict=True):
            np.testing.assert_array_equal(got, want)
        routed = np.array(st.routing)
        assert len(np.unique(routed)) > k      # the routing does vary from token to token
    finally:
        s.close()
        plain.close()


def _consecutive_overlap(path: Path, text: str) -> float:
    """The share of a layer's experts a token keeps from the token before, teacher-forced
    through llama.cpp with the streamer's routing capture."""
    s = open_session(path, **STREAM, **{"cache-mb": 0})
    try:
        assert isinstance(s.streamer, ExpertStreamer)
        s.streamer.record_routing = True
        r = streamed_routing(s, s.tokenize(text))
        k = r.shape[2]
        return float(np.mean([len(set(r[t, j]) & set(r[t - 1, j])) / k
                              for t in range(1, len(r)) for j in range(r.shape[1])]))
    finally:
        s.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_the_context_kernel_makes_consecutive_tokens_share_experts(
        tmp_path: Path, arch: str) -> None:
    """The model maker's context kernel (layer 0's attention over the last few tokens)
    makes consecutive tokens share experts as real text does, in gpt-oss's attention (no
    Q/K norms, sinks) as in qwen3's: measured 0.46 against 0.16 without it, for both."""
    text = ("The quick brown fox jumps over the lazy dog. Then it started to rain in Paris, "
            "and the people in the streets opened their umbrellas while the cafes filled.")
    shape = dict(arch=arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                 n_expert=32, n_expert_used=4, n_ff_exp=64, dtype="f16", router_skew=1.0)
    plain = _consecutive_overlap(make_model(tmp_path / "plain.gguf", **shape), text)
    mixed = _consecutive_overlap(make_model(tmp_path / "ctx.gguf", context_mix=1.5, **shape),
                                 text)
    assert plain < 0.25 and mixed > plain + 0.15, (plain, mixed)


# -- the budget, load errors, fallbacks ----------------------------------------------------


def test_budget_below_a_token_cycle_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(LoadError) as err:
        open_session(models["moe"], **STREAM, **{"cache-mb": 1})
    assert "{cache-mb}" in err.value.message and "token cycle" in err.value.message
    assert "1.5 MiB" in err.value.message


def test_auto_budget_clamps() -> None:
    cycle, total = 10 * MIB, 100 * MIB
    big = {"cache-mb": "auto", "cache-floor-mb": 0}
    assert resolve(big, token_cycle=cycle, all_bytes=total).bytes == total
    ceil = resolve({**big, "cache-ceil-mb": 50}, token_cycle=cycle, all_bytes=total)
    assert ceil.bytes == 50 * MIB and ceil.mode == "auto"
    huge_floor = {"cache-mb": "auto", "cache-floor-mb": 1 << 30}
    assert resolve(huge_floor, token_cycle=cycle, all_bytes=total).bytes == cycle
    with pytest.raises(LoadError, match="cache-ceil-mb"):
        resolve({**big, "cache-ceil-mb": 5}, token_cycle=cycle, all_bytes=total)
    assert resolve({"cache-mb": 0}, token_cycle=cycle, all_bytes=total).bytes == 0
    assert resolve({"cache-mb": 500}, token_cycle=cycle, all_bytes=total).bytes == total


def test_factory_streams_only_moe_files(models: dict[str, Path]) -> None:
    dense = open_session(models["dense"], **STREAM)
    off = open_session(models["moe"], **{"moe-stream": False})
    try:
        assert dense.streamer is None and off.streamer is None
    finally:
        dense.close()
        off.close()
    layout = read_layout(models["moe"])
    assert layout.token_cycle_bytes == 4 * 4 * layout.unit_bytes(0)
    assert not read_layout(models["dense"]).experts


def test_refused_o_direct_falls_back_to_buffered_reads(models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)

    def check(st: ExpertStreamer) -> None:
        s = st.summary()
        assert s["odirect"] is False and "refused O_DIRECT" in s["odirect_fallback"]

    assert streamed(models["moe"], check, **{"cache-mb": 2}) == resident(models, "moe")


def test_a_direct_read_refused_midway_falls_back(models: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    python_lanes(monkeypatch)
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.reader is not None
        if not st.reader.odirect:
            pytest.skip("this file system refuses O_DIRECT")
        direct_fd, real_preadv = st.reader.direct_fd, os.preadv

        def refuse(fd: int, buffers: Any, offset: int) -> int:
            if fd == direct_fd:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(fd, buffers, offset)

        def refuse_aio(self: Any, fd: int, reads: list[tuple[int, int, int]]) -> list[int]:
            return [-errno.EINVAL] * len(reads)

        monkeypatch.setattr(reader_mod.os, "preadv", refuse)
        monkeypatch.setattr(reader_mod.Aio, "pread_all", refuse_aio)
        got = conversation(s)
        assert st.summary()["odirect"] is False
        assert "refused" in st.summary()["odirect_fallback"]
    finally:
        s.close()
    assert got == resident(models, "moe")


def test_buffered_reads_when_o_direct_is_off(models: dict[str, Path]) -> None:
    def check(st: ExpertStreamer) -> None:
        assert st.summary()["odirect"] is False
        assert st.summary()["odirect_fallback"] == "o-direct is off"

    values = {"cache-mb": 2, "o-direct": False}
    assert streamed(models["moe"], check, **values) == resident(models, "moe")


def test_o_direct_is_used_where_the_file_system_allows_it(models: dict[str, Path]) -> None:
    try:
        os.close(os.open(models["moe"], os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        _, summary, records = turn(s, QUESTION, n=4)
        assert s.streamer is not None and s.streamer.summary()["odirect"] is True
        assert all(r["telemetry"]["odirect"] is True for r in records)
    finally:
        s.close()


@pytest.mark.parametrize("extra", [{}, {"prefetch": 2, "overlap": True}],
                         ids=["serial", "read-ahead"])
def test_a_failed_read_is_an_error_and_the_session_recovers(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]) -> None:
    python_lanes(monkeypatch)
    s = open_session(models["moe"], **{**STREAM, "cache-mb": 2, "io-threads": 1, **extra})
    try:
        def broken(self: Any, r: Any) -> int:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(reader_mod.ExpertReader, "_one", broken)
        with pytest.raises(EngineError) as err:
            turn(s, QUESTION)
        assert err.value.code == "failed" and "Input/output error" in err.value.message
        monkeypatch.undo()
        tokens, _, _ = turn(s, QUESTION)
        assert tokens == resident(models, "moe")[0][0]
    finally:
        s.close()


# -- the graph callback: native (bmoe/native/evalcb.c) against Python -------------------


@pytest.mark.parametrize("values", [{"cache-mb": 0}, {"cache-mb": 2},
                                    {"cache-mb": 2, "prefetch": 2, "overlap": True}],
                         ids=["nocache", "cache", "read-ahead"])
def test_native_and_python_callbacks_match_no_streaming(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, values: dict[str, Any]) -> None:
    def native(st: ExpertStreamer) -> None:
        assert st.load_info["eval_callback"] == "native" and st.native is not None
        assert st.stats()["cb_route_calls"] > 0

    def python(st: ExpertStreamer) -> None:
        assert st.load_info["eval_callback"] == "python: forced by BMOE_EVAL_CALLBACK=python"
        assert st.native is None and "cb_asks" not in st.stats()

    monkeypatch.delenv(evalcb.ENV, raising=False)
    got_native = streamed(models["moe"], native, **values)
    monkeypatch.setenv(evalcb.ENV, "python")
    got_python = streamed(models["moe"], python, **values)
    assert got_native == got_python == resident(models, "moe")


def count_python_asks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the Python callback's ask-phase calls (install before the session opens)."""
    asks = [0]
    original = ExpertStreamer._eval

    def counting(self: ExpertStreamer, t: int, ask: bool, user: Any) -> bool:
        asks[0] += bool(ask)
        return original(self, t, ask, user)

    monkeypatch.setattr(ExpertStreamer, "_eval", counting)
    return asks


def test_the_native_callback_enters_python_once_per_moe_layer(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = models["moe"]
    n_layer = read_layout(path).n_layer
    monkeypatch.delenv(evalcb.ENV, raising=False)
    s = open_session(path, **STREAM, **{"cache-mb": 2})
    tokens = s.tokenize("The quick brown fox jumps over the lazy dog in Paris.")
    native_asks: list[int] = []
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.native is not None
        before = st.stats()
        assert before["cb_asks"] == 0 and before["cb_binding"]
        s.prefill(tokens[:4], threading.Event())         # the first graph: binding
        first = st.stats()
        assert first["cb_bind_calls"] == 3 * n_layer      # gate, up, down of each layer
        assert not first["cb_binding"] and not st._unbound
        assert first["cb_route_calls"] == n_layer
        for i in range(5, len(tokens) + 1):               # one-token decodes
            a = st.stats()
            s.prefill(tokens[:i], threading.Event())
            b = st.stats()
            assert b["cb_route_calls"] - a["cb_route_calls"] == n_layer
            assert b["cb_bind_calls"] == first["cb_bind_calls"]
            native_asks.append(b["cb_asks"] - a["cb_asks"])
    finally:
        s.close()
    # every node still went through the C side: as many asks as the Python callback gets
    monkeypatch.setenv(evalcb.ENV, "python")
    asks = count_python_asks(monkeypatch)
    s = open_session(path, **STREAM, **{"cache-mb": 2})
    python_asks = []
    try:
        s.prefill(tokens[:4], threading.Event())
        for i in range(5, len(tokens) + 1):
            a = asks[0]
            s.prefill(tokens[:i], threading.Event())
            python_asks.append(asks[0] - a)
    finally:
        s.close()
    assert native_asks == python_asks
    assert min(native_asks) > 10 * n_layer      # the nodes answered without Python


@pytest.mark.parametrize("values", [{"load-all": True},
                                    {"cache-mb": "auto", "cache-floor-mb": 64}],
                         ids=["load-all", "auto-fits"])
def test_a_model_that_fits_decodes_without_entering_python(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, values: dict[str, Any]) -> None:
    path = models["moe"]
    n_layer = read_layout(path).n_layer
    monkeypatch.delenv(evalcb.ENV, raising=False)
    figures, records = {}, {}
    for callback in ("native", "python"):
        if callback == "python":
            monkeypatch.setenv(evalcb.ENV, "python")
        s = open_session(path, **STREAM, **values)
        try:
            st = s.streamer
            assert isinstance(st, ExpertStreamer)
            got = conversation(s)
            assert got == resident(models, "moe")
            stats = st.stats()
            figures[callback] = (stats["hits"], stats["misses"], st.summary()["cache_hit_pct"])
            tokens = s.tokenize("Paris and London in the rain, then the sun again.")
            s.prefill(tokens[:3], threading.Event())
            a = st.stats()
            s.prefill(tokens[:4], threading.Event())          # one decode
            b = st.stats()
            st.record_routing = True                           # a routing record, too
            for i in (5, 6):
                st.token_begin()
                s.prefill(tokens[:i], threading.Event())
                st.token_end()
            c = st.stats()
            records[callback] = np.array(st.routing)
            assert records[callback].shape == (2, n_layer, 4)
            if callback == "python":
                continue
            assert stats["cb_resident"] and stats["cb_resident_routes"] > 0
            assert b["cb_route_calls"] == a["cb_route_calls"]  # no Python
            assert b["cb_resident_routes"] - a["cb_resident_routes"] == n_layer
            assert b["hits"] - a["hits"] >= n_layer            # each layer's routed experts
            assert c["cb_resident"] and c["cb_route_calls"] == b["cb_route_calls"]
        finally:
            s.close()
    assert figures["native"] == figures["python"]     # the same hits, counted in C
    np.testing.assert_array_equal(records["native"], records["python"])  # written in C


def test_without_the_extension_the_python_callback_runs(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(evalcb.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "bmoe.native.evalcb", None)   # an import that fails

    def check(st: ExpertStreamer) -> None:
        assert st.native is None
        why = st.load_info["eval_callback"]
        assert why.startswith("python: the extension bmoe.native.evalcb is not built"), why

    assert streamed(models["moe"], check, **{"cache-mb": 2}) == resident(models, "moe")


@pytest.mark.parametrize("field,shift,problem", [
    (3, 8, "nb reads [12, 60], expected [4, 12]"),      # nb[1] read for nb[0]
    (9, 4, "read type reads (0, 0), expected (0, 1)"),  # the padding read for type
    (10, 8, "read view_src reads 8, expected"),          # view_offs read for view_src
], ids=["nb", "type", "view_src"])
def test_a_native_side_reading_a_wrong_offset_falls_back(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, field: int, shift: int,
        problem: str) -> None:
    right = ggml.native_layout()
    wrong = list(right)
    wrong[field] += shift
    monkeypatch.delenv(evalcb.ENV, raising=False)
    monkeypatch.setattr(ggml, "native_layout", lambda: wrong)

    def check(st: ExpertStreamer) -> None:
        assert st.native is None
        why = st.load_info["eval_callback"]
        assert why.startswith("python: the native callback reads the layout probe wrongly")
        assert problem in why, why

    assert streamed(models["moe"], check, **{"cache-mb": 2}) == resident(models, "moe")


@pytest.mark.parametrize("where", ["_bind", "_routed"])
def test_a_failure_in_the_native_callback_is_an_error_and_the_session_recovers(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.delenv(evalcb.ENV, raising=False)
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        assert isinstance(s.streamer, ExpertStreamer) and s.streamer.native is not None

        def broken(*_args: Any) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(ExpertStreamer, where, broken)
        with pytest.raises(EngineError) as err:
            turn(s, QUESTION)
        assert err.value.code == "failed"
        assert err.value.message.startswith("Expert streaming failed: injected")
        monkeypatch.undo()
        # a failed bind keeps asking; a failed routing stopped the first graph before it
        assert s.streamer.stats()["cb_binding"]
        tokens, _, _ = turn(s, QUESTION)
        assert tokens == resident(models, "moe")[0][0]
        assert not s.streamer.stats()["cb_binding"]
    finally:
        s.close()


# -- read-ahead guesses made in C ------------------------------------------------------------


def numpy_guess(routers: dict[int, np.ndarray], n_layer: int, k: int, depth: int, gate: float,
                layer: int, h: np.ndarray | None,
                biases: dict[int, np.ndarray] | None = None) -> list[tuple[int, list[int]]]:
    """What the numpy predictor guesses with the routers rounded to bfloat16, as C has them."""
    rounded = {j: evalcb.from_bf16(evalcb.to_bf16(w)) for j, w in routers.items()}
    return [(j, g.tolist()) for j, g in
            Predictor(rounded, n_layer, k, depth, gate, biases).guesses(layer, h)]


@pytest.mark.parametrize("biased", [False, True], ids=["plain", "router-biases"])
@pytest.mark.parametrize("gate", [0.0, 0.02])
def test_c_guesses_equal_numpys_on_bfloat16_routers(gate: float, biased: bool) -> None:
    """C's guesses are numpy's, with the routers' biases (gpt-oss) added to the logits
    where a layer has one; the biases do change the guesses."""
    rng = np.random.default_rng(7)
    n_layer, n_expert, n_embd, k, depth = 6, 128, 2880, 4, 2
    routers = {j: rng.standard_normal((n_expert, n_embd), dtype=np.float32) * 0.05
               for j in (1, 2, 3, 5)}                      # layer 4 has no float router
    biases = ({j: rng.standard_normal(n_expert, dtype=np.float32) * 2.0 for j in (1, 2, 5)}
              if biased else None)                         # layer 3 has none
    cb = evalcb.NativeCallback(lambda *_: True, lambda _: 0)
    assert cb.guess(routers, n_layer, n_expert, depth, k, gate, biases)
    compared = changed = 0
    for trial in range(40):
        h = rng.standard_normal(n_embd, dtype=np.float32) * (1 + trial % 5)
        for layer in range(n_layer):
            rows = cb.guess_for(layer, h)
            pred = Predictor({}, n_layer, k, depth, gate)
            got = [(j, g.tolist()) for j, g in pred.from_rows(layer, rows)]
            want = numpy_guess(routers, n_layer, k, depth, gate, layer, h, biases)
            want = [(j, g) for j, g in want if j != 4]     # numpy falls back to "previous"
            assert got == want, (trial, layer)
            unbiased = [(j, g) for j, g in numpy_guess(routers, n_layer, k, depth, gate,
                                                        layer, h) if j != 4]
            changed += unbiased != want
            for d in range(depth):                         # what C says of each next layer
                j = layer + 1 + d
                if j >= n_layer or j not in routers:
                    assert rows[d, 0] == (-2 if j >= n_layer else -1)
                else:
                    assert 0 <= rows[d, 0] <= k
            compared += len(want)
    assert compared > 200
    assert (changed > 0) == biased
    # where C had no router (-1), the layer's previous routing is the guess, as in numpy
    pred = Predictor({}, n_layer, k, depth, gate)
    pred.last[4] = np.array([5, 6, 7, 8])
    rows = cb.guess_for(3, np.ones(n_embd, dtype=np.float32))
    assert rows[0, 0] == -1 and rows[1, 0] >= 0
    assert [j for j, _ in pred.from_rows(3, rows)] == [4, 5][:1 + (rows[1, 0] > 0)]
    assert pred.from_rows(3, rows)[0][1].tolist() == [5, 6, 7, 8]
    if gate:          # flat logits: none passes the gate; a sharp router: some do
        # (layer 3, which has no bias to make its logits other than flat)
        flat, sharp = (cb.guess_for(2, rng.standard_normal(n_embd, dtype=np.float32) * s)[0, 0]
                       for s in (0.01, 20))
        assert flat == 0 and 1 <= sharp <= k


def test_c_guesses_of_a_broken_router_input_are_empty_not_a_crash() -> None:
    rng = np.random.default_rng(1)
    routers = {1: rng.standard_normal((8, 64), dtype=np.float32)}
    cb = evalcb.NativeCallback(lambda *_: True, lambda _: 0)
    assert cb.guess(routers, 2, 8, 1, 4, 0.0)
    for bad in (np.full(64, np.nan), np.full(64, np.inf), np.full(64, -np.inf)):
        rows = cb.guess_for(0, bad.astype(np.float32))
        assert 0 <= rows[0, 0] <= 4                   # NaN logits are never taken
        assert all(0 <= e < 8 for e in rows[0, 1:1 + rows[0, 0]])
    # shapes C does not take leave guessing off
    assert not cb.guess({1: routers[1], 0: np.zeros((8, 32), np.float32)}, 2, 8, 1, 4, 0.0)
    assert not cb.guess(routers, 2, 8, 3, 4, 0.0)           # deeper than the model
    assert not cb.guess(routers, 2, 16, 1, 4, 0.0)          # rows != experts
    assert not cb.guess(routers, 2, 8, 1, 4, 1.5)           # a gate above 1


def _routing_graph(ids: np.ndarray, probs: np.ndarray, row_pad: int, probs_pad: int,
                   name: bytes = b"ffn_moe_probs-1") -> tuple[Any, ...]:
    """A routing node as llama.cpp's graph has it: a view (I32 [k, n], rows `row_pad`
    ints wider than k) of an argsort whose source is the router's probabilities (F32
    [n_expert, n], rows `probs_pad` floats wider). Returns the node and what keeps the
    memory alive."""
    n, k = ids.shape
    e = probs.shape[1]
    id_buf = np.full((n, k + row_pad), -7, dtype=np.int32)
    id_buf[:, :k] = ids
    p_buf = np.full((n, e + probs_pad), -1.0, dtype=np.float32)
    p_buf[:, :e] = probs
    pt, arg, topk = ggml.GgmlTensor(), ggml.GgmlTensor(), ggml.GgmlTensor()
    pt.type, pt.name, pt.data = ggml.GGML_TYPE_F32, name, p_buf.ctypes.data
    pt.ne[0], pt.ne[1], pt.nb[0], pt.nb[1] = e, n, 4, p_buf.strides[0]
    arg.src[0] = ctypes.addressof(pt)
    topk.type, topk.name, topk.data = ggml.GGML_TYPE_I32, b"ffn_moe_topk-1", id_buf.ctypes.data
    topk.ne[0], topk.ne[1], topk.nb[0], topk.nb[1] = k, n, 4, id_buf.strides[0]
    topk.view_src = ctypes.addressof(arg)
    return ctypes.addressof(topk), id_buf, p_buf, (pt, arg, topk)


@settings(max_examples=60, deadline=None)
@given(hs.integers(1, 6), hs.integers(1, 8), hs.integers(0, 3), hs.integers(0, 5),
       hs.integers(0, 2 ** 32 - 1))
def test_c_slot_rewrite_is_numpys(n: int, k: int, row_pad: int, probs_pad: int,
                                  seed: int) -> None:
    """The C callback's rewrite of a routing to expert slots (`bmoe_evalcb_rewrite`)
    writes what the streamer's numpy rewrite writes: ids -> perm[ids], probs'[perm[e]] =
    probs[e], row by row, and nothing in the rows' padding."""
    rng = np.random.default_rng(seed)
    n_layer, n_exp = 3, 16
    perm = np.stack([rng.permutation(n_exp) for _ in range(n_layer)]).astype(np.int64)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n)]).astype(np.int32)
    probs = rng.random((n, n_exp), dtype=np.float32)
    node, id_buf, p_buf, _keep = _routing_graph(ids, probs, row_pad, probs_pad)
    cb = evalcb.NativeCallback(lambda *_: True, lambda _: 0)
    assert cb.rewrite(node, 1) == -1                  # no slots handed over yet
    assert cb.slots(perm)
    assert cb.rewrite(node, 1) == 0
    want = np.empty_like(probs)
    want[:, perm[1]] = probs
    assert (id_buf[:, :k] == perm[1][ids]).all() and (id_buf[:, k:] == -7).all()
    assert (p_buf[:, :n_exp] == want).all() and (p_buf[:, n_exp:] == -1.0).all()
    assert cb.rewrite(node, n_layer) == -1            # a layer outside the slots


def test_c_slot_rewrite_refuses_what_it_does_not_expect() -> None:
    """Ids or slots out of range and probabilities that are not the router's are refused
    (a negative code, which the streamer turns into an error), not a write out of
    bounds."""
    perm = np.tile(np.arange(8, dtype=np.int64)[::-1].copy(), (2, 1))
    probs = np.arange(16, dtype=np.float32).reshape(2, 8)
    cb = evalcb.NativeCallback(lambda *_: True, lambda _: 0)
    assert cb.slots(perm)
    node, id_buf, p_buf, _keep = _routing_graph(np.array([[1, 9], [2, 3]], np.int32), probs, 0, 0)
    assert cb.rewrite(node, 0) == -4 and (id_buf[0] == [1, 9]).all()   # id 9 of 8
    node, *_k1 = _routing_graph(np.array([[1, 2]], np.int32), probs[:1], 0, 0, b"ffn_moe_x-1")
    assert cb.rewrite(node, 0) == -3
    perm[1, 3] = 8                                     # a slot out of range
    node, id_buf, p_buf, _keep = _routing_graph(np.array([[1, 2]], np.int32), probs[:1], 0, 0)
    assert cb.rewrite(node, 1) == -4 and (id_buf[0] == [1, 2]).all()
    assert (p_buf[0] == probs[0]).all()
    assert cb.slots(None) and cb.rewrite(node, 0) == -1


@pytest.mark.parametrize("name", ["moe", "moe-f16"])
def test_the_callbacks_guesses_are_numpys_from_the_graphs_router_input(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """On llama.cpp's real graph: the C side finds each layer's router input itself and
    guesses what numpy guesses from the input Python finds (bfloat16 routers both)."""
    monkeypatch.delenv(evalcb.ENV, raising=False)
    seen: list[tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]] = []
    original = ExpertStreamer._read_ahead

    def checking(self: ExpertStreamer, layer: int, node: int) -> None:
        assert self.native is not None and self.native.guess_rows is not None
        assert self.predictor is not None
        got = [(j, g.tolist()) for j, g in
               self.predictor.from_rows(layer, self.native.guess_rows)]
        h = router_input(ggml.tensor_at(node), layer)
        p = self.predictor
        want = numpy_guess(p.routers, p.n_layer, p.k, p.depth, p.gate, layer, h)
        seen.append((got, want))
        original(self, layer, node)

    monkeypatch.setattr(ExpertStreamer, "_read_ahead", checking)

    def check(st: ExpertStreamer) -> None:
        assert "guessed in C" in st.load_info["predictor"]
        stats = st.stats()
        assert stats["cb_guessed"] > 0 and stats["cb_guess_missing"] == 0
        check_read_ahead(st)

    cap = 2 if name == "moe" else 1    # below every expert (3 / 1.5 MiB)
    got = streamed(models[name], check, **{"cache-mb": cap, "prefetch": 2, "overlap": True})
    assert got == resident(models, name)
    assert len(seen) > 20 and sum(len(w) for _, w in seen) > 40
    assert all(g == w for g, w in seen)


@pytest.mark.parametrize("n", [1, 3], ids=["decode", "batch"])
def test_a_routing_is_read_whole_and_ids_out_of_range_are_refused(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    # no read-ahead: it would look for the router's input from the (here made-up) node
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2, "prefill-ahead": False})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer) and st.predictor is None
        asked: list[list[int]] = []
        monkeypatch.setattr(st, "ensure", lambda layer, ids: asked.append(ids.tolist()))
        k, row = 4, 24                    # rows 24 bytes apart: two int32 of padding each
        buf = np.full((n, row // 4), 99, dtype=np.int32)
        buf[:, :k] = [[5, 1, 5, 3], [0, 1, 2, 3], [7, 7, 7, 7]][:n]
        st._routed(0, 1, k, n, row, buf.ctypes.data)
        assert asked == [sorted({int(e) for e in buf[:, :k].ravel()})]
        for bad in (-1, 8):               # the model has 8 experts
            buf[n - 1, 2] = bad
            with pytest.raises(RuntimeError, match=r"layer 1 routed to expert ids outside 0..7"):
                st._routed(0, 1, k, n, row, buf.ctypes.data)
        with pytest.raises(RuntimeError, match="unexpected layout"):
            st._routed(0, 1, k, n, 2 * k, buf.ctypes.data)     # rows narrower than k ids
        assert len(asked) == 1
    finally:
        s.close()


# -- telemetry -----------------------------------------------------------------------------


def test_per_token_telemetry_and_summary(models: dict[str, Path]) -> None:
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 2})
    try:
        _, summary, records = turn(s, QUESTION)
        tel = records[0]["telemetry"]
        for key in ("io_ms", "read_mib", "cache_hit_pct", "mgmt_ms", "stall_ms",
                    "cache_budget_mib", "cache_resident_mib", "evictions", "rereads",
                    "dense_resident_frac", "odirect"):
            assert key in tel, key
        assert tel["stall_ms"] == 0.0 and tel["overlap"] is False
        assert tel["cache_budget_mib"] == 2.0 and tel["dense_resident_frac"] == 1.0
        assert 0 <= tel["cache_hit_pct"] <= 100
        assert sum(r["telemetry"]["read_mib"] for r in records) > 0
        assert summary["prefill_read_mib"] > 0 and summary["cache_budget_mib"] == 2.0
        assert summary["token_demand_mib"] == 1.5
        assert summary["cache_hit_pct"] == records[-1]["cache_hit_pct"]
        # the record the server sends carries the streamer's figures
        assert records[1]["read_mib"] == records[1]["telemetry"]["read_mib"]
    finally:
        s.close()


# -- the cache, without I/O ----------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_and_never_the_current_layer() -> None:
    unit = np.array([10, 10])
    c = ExpertCache(unit, n_expert=4, budget=40, policy="lru")
    assert c.admit(0, np.array([0, 1])).misses.tolist() == [0, 1]
    assert c.admit(1, np.array([0, 1])).misses.tolist() == [0, 1]
    hit = c.admit(0, np.array([0]))                      # (0,0) is now the most recent
    assert hit.hits == 1 and not hit.victims
    adm = c.admit(1, np.array([2, 3]))                   # needs 20: evicts (0,1), (1,0)
    assert sorted(adm.victims) == [(0, 1), (1, 0)]
    assert c.resident_bytes == 40 and c.evictions == 2
    adm = c.admit(0, np.array([0, 1, 2, 3]))             # a whole layer: overshoots
    assert all(layer != 0 for layer, _ in adm.victims)
    assert c.resident[0].all()
    assert c.rereads == 1                                # (0,1) came back


def test_no_cache_releases_what_the_layer_no_longer_uses() -> None:
    c = NoCache(2, np.array([10, 10]))
    assert c.admit(0, np.array([1, 2])).victims == []
    adm = c.admit(0, np.array([2, 3]))
    assert adm.misses.tolist() == [2, 3] and adm.victims == [(0, 1)]
    assert c.resident_bytes == 20


def test_next_use_keeps_the_frequent_units_of_the_layers_coming_next() -> None:
    c = ExpertCache(np.array([1, 1, 1]), n_expert=4, budget=5, policy="next-use")
    for _ in range(3):                       # (0,0) and (1,0) are routed every token
        c.admit(0, np.array([0]))
        c.admit(1, np.array([0]))
        c.admit(2, np.array([0]))
    c.admit(0, np.array([1]))                # used once
    c.admit(1, np.array([1]))
    adm = c.admit(2, np.array([1, 2]))       # 7 units for 5: two must go
    # LRU would evict (0,0) and (1,0), the oldest; next-use evicts the rarely used ones,
    # the layer just asked (0) furthest from its next use first
    assert sorted(adm.victims) == [(0, 1), (1, 1)]


def test_read_ahead_admission_spares_the_layer_in_use_and_reads_in_flight() -> None:
    c = ExpertCache(np.array([1, 1]), n_expert=4, budget=4, policy="lru")
    c.admit(1, np.array([2, 3]))
    c.admit(0, np.array([0, 1]))             # layer 0 is computing
    c.pinned[1, 2] = True                    # a read of (1,2) still in flight
    adm = c.admit_spec(1, np.array([0, 1]))
    assert adm.victims == [(1, 3)] and adm.misses.tolist() == [0]   # room for one only
    assert c.resident[0, [0, 1]].all() and c.resident[1, 2]
    assert c.hits == 0 and c.misses == 4     # read-ahead is neither a hit nor a miss


# -- a model that fits: the cache fills in the background --------------------------------


def _settle(st: ExpertStreamer, session: Session) -> None:
    """Wait for the fill's reads, then decode one more turn so the engine sees them done."""
    assert st.queue is not None
    for g in list(st._inflight.values()):
        assert g.done.wait(30)
    turn(session, QUESTION, n=2)


def test_background_fill_reads_each_expert_once_and_goes_resident(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert fits: the lanes fill the cache behind the tokens' own reads (slowed
    here so the fill is still running while the first turns route), a routed expert still
    queued is promoted and waited on, never read twice; then the native callback counts
    routings without Python. Tokens and logits stay the resident engine's."""
    python_lanes(monkeypatch)
    slow = reader_mod.ExpertReader._one
    reads: list[tuple[int, int]] = []

    def one(self: reader_mod.ExpertReader, r: reader_mod.Read) -> int:
        import time
        time.sleep(0.003)
        reads.append((r.offset, r.length))
        return slow(self, r)

    monkeypatch.setattr(reader_mod.ExpertReader, "_one", one)
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 8})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        assert st.summary()["cache_fill"] == "filling"
        got = conversation(s)
        _settle(st, s)
        summary = st.summary()
        assert summary["cache_fill"] == "done"
        # each expert slice read once (4 layers x 8 experts x 3 tensors), all of them
        assert len(reads) == len(set(reads)) == 96
        assert sum(n for _, n in reads) == st.layout.expert_bytes
        # the fill queued every expert at load, so it read them all; the first tokens
        # found theirs still queued (promoted, waited on: a stall), none read apart
        assert summary["cache_fill_read_mib"] * MIB == pytest.approx(
            st.stats()["read_bytes"], abs=0.05 * MIB)
        assert st.stats()["stall_s"] > 0
        assert st._native_resident or st.native is None
        assert not st.cache.pinned.any()
    finally:
        s.close()
    assert got == resident(models, "moe")


def test_background_fill_on_the_c_lanes_reads_each_expert_once(
        models: dict[str, Path]) -> None:
    """The same fill on the C lanes (the default where the extension is built): every
    expert read once, the bytes counted by the lanes equal the experts' bytes, nothing
    left pinned, and the tokens are the resident engine's."""
    assert reader_mod.native_lanes() is not None, "bmoe.native.readlanes is not built"
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 8})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        assert isinstance(st.queue, reader_mod.NativeLaneQueue)
        got = conversation(s)
        _settle(st, s)
        summary = st.summary()
        assert summary["cache_fill"] == "done"
        # each of the 96 slices once: a direct read takes its page-aligned superset (at
        # most two pages more), a buffered one the slice
        extra = 96 * 2 * mmap.PAGESIZE if st.reader is not None and st.reader.odirect else 0
        assert st.layout.expert_bytes <= st.stats()["read_bytes"] <= \
            st.layout.expert_bytes + extra
        assert st.queue.busy_s > 0 and st.reader is not None and st.reader.moved_bytes == 0
        assert not st.cache.pinned.any() and st.cache.resident.all()
    finally:
        s.close()
    assert got == resident(models, "moe")


def test_no_background_fill_when_turned_off_or_experts_do_not_fit(
        models: dict[str, Path]) -> None:
    def off(st: ExpertStreamer) -> None:
        s = st.summary()
        assert s["cache_fill"] == "off" and st.queue is None and st.load_info.get(
            "cache_fill") is None
        assert s["cache_fill_read_mib"] == 0 and st.stats()["read_bytes"] > 0   # routed ones

    assert streamed(models["moe"], off, **{"cache-mb": 8, "cache-fill": False}) \
        == resident(models, "moe")

    def small(st: ExpertStreamer) -> None:
        assert st.summary()["cache_fill"] == "off"

    assert streamed(models["moe"], small, **{"cache-mb": 2}) == resident(models, "moe")


def test_closing_drops_the_queued_fill(models: dict[str, Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A session closed while its fill is queued does not read the rest first."""
    python_lanes(monkeypatch)
    calls: list[int] = []
    slow = reader_mod.ExpertReader._one

    def one(self: reader_mod.ExpertReader, r: reader_mod.Read) -> int:
        import time
        calls.append(r.length)
        time.sleep(0.05)
        return slow(self, r)

    monkeypatch.setattr(reader_mod.ExpertReader, "_one", one)
    s = open_session(models["moe"], **STREAM, **{"cache-mb": 8})
    st = s.streamer
    assert isinstance(st, ExpertStreamer) and st._fill_units == 32
    s.close()
    assert 0 < len(calls) < 32 * 3 // 2       # 96 reads were queued; most were dropped


# -- fresh pages from transparent huge pages (huge-pages) ----------------------------------

def thp_on() -> bool:
    from bmoe.engine.experts.memory import thp_mode
    return thp_mode() in ("always", "madvise")


def test_page_supply_gives_zeroed_contiguous_pages() -> None:
    from bmoe.engine.experts.memory import PAGE, AnonBuffer, PageSupply
    supply = PageSupply(region=8 * MIB)
    buf = AnonBuffer(576, 24 * MIB)
    try:
        if not thp_on():
            assert not supply.give(buf.base, MIB) and supply.given_bytes == 0
            return
        given = []
        for i in range(20):                       # 1 MiB interiors: regions run out, renew
            addr, n = buf.interior(i * MIB, (i + 1) * MIB)
            assert supply.give(addr, n)
            given.append((addr, n))
        assert supply.given_bytes == sum(n for _, n in given)
        off = given[3][0] - buf.base
        assert not buf.array[off:off + given[3][1]].any()          # fresh pages are zero
        buf.array[off:off + 8] = 7                                  # and ours to write
        runs = [physical_runs(a, n) for a, n in given]
        if os.geteuid() == 0:                     # frame numbers visible (root): contiguous
            assert all(r is not None for r in runs), "a page given is not present"
            assert sum(1 for r in runs if r is not None and r <= 2) >= 18, runs
        assert supply.give(buf.base, 0) is False
    finally:
        supply.close()
        buf.close()
    assert not supply.give(buf.base, PAGE)        # closed: gives nothing


def test_page_supply_keeps_the_pages_handed_back_for_the_next_slice() -> None:
    """A victim's pages no miss took (`take`) are kept, not freed, up to `park_limit`, and
    are what the next `give` hands out, before any fresh page: the same physical pages
    with what was in them (a read overwrites it), so a cache whose units differ in size
    by layer stops faulting in fresh pages once it is full."""
    from bmoe.engine.experts.memory import PAGE, AnonBuffer, PageSupply
    supply = PageSupply(region=8 * MIB, park_limit=4 * MIB)
    buf = AnonBuffer(0, 16 * MIB)
    a = buf.array
    try:
        a[:3 * MIB] = 5                                     # committed, recognisable
        a[MIB:MIB + PAGE] = 6
        runs_before = physical_runs(buf.base, MIB)
        supply.take(buf.base, MIB)
        supply.take(buf.base + MIB, 2 * MIB)
        assert supply.parked_bytes == 3 * MIB
        assert not a[:3 * MIB].any()                       # moved away: nothing left there
        supply.take(buf.base + 3 * MIB, 2 * MIB)           # beyond the limit: freed
        assert supply.parked_bytes == 3 * MIB
        # one give spans both kept ranges, last kept first
        assert supply.give(buf.base + 8 * MIB, 3 * MIB)
        got = a[8 * MIB:11 * MIB]
        assert (got[:2 * MIB] != 0).all() and (got[2 * MIB:] == 5).all()
        assert (got[:PAGE] == 6).all()                     # the second range's own pages
        assert supply.reused_bytes == 3 * MIB and supply.parked_bytes == 0
        if runs_before is not None:                        # root: the same physical pages
            assert physical_runs(buf.base + 10 * MIB, MIB) == runs_before
        # the parking space is whole again: one free range
        assert len(supply._park_free) == 1
        if not supply.enabled:                             # no huge pages: no fresh ones
            assert not supply.give(buf.base + 12 * MIB, PAGE)
        del got
    finally:
        del a
        supply.close()
        buf.close()


@pytest.mark.parametrize("plain_faster,once", [(True, False), (False, False), (True, True)],
                         ids=["plain-faster", "huge-faster", "slots-commit-once"])
def test_page_supply_turns_itself_off_where_huge_pages_fault_in_slower(
        monkeypatch: pytest.MonkeyPatch, plain_faster: bool, once: bool) -> None:
    """After `_JUDGE_BYTES` given, the supply stays on only while its huge pages commit at
    least as fast as plain pages fault in; off, it gives nothing (the reads fault pages in
    as without it) and its note gives both rates. With `once` (expert slots: each slot's
    pages committed once) it does not judge and stays on."""
    from bmoe.engine.experts import memory
    from bmoe.engine.experts.memory import AnonBuffer, PageSupply

    if not thp_on():
        pytest.skip("the kernel has no transparent huge pages")
    monkeypatch.setattr(memory, "_JUDGE_BYTES", 4 * MIB)
    supply = PageSupply(region=8 * MIB)
    assert supply.plain_rate > 0 and supply.note == "on"
    supply.plain_rate = 1e15 if plain_faster else 1.0      # faster, or slower, than any
    supply.once = once
    buf = AnonBuffer(576, 12 * MIB)
    try:
        i = 0
        while supply.given_bytes < 4 * MIB:       # up to the judgement, every one given
            addr, n = buf.interior(i * MIB, (i + 1) * MIB)
            assert supply.give(addr, n)
            i += 1
        addr, n = buf.interior(i * MIB, (i + 1) * MIB)
        if once:
            assert supply.enabled and supply.give(addr, n) and supply.note == "on"
            return
        if plain_faster:
            assert not supply.enabled and not supply.give(addr, n)
            assert supply.note.startswith("off: huge pages faulted in at "), supply.note
        else:
            assert supply.enabled and supply.give(addr, n)
            assert supply.note.startswith("on: huge pages fault in at "), supply.note
        assert ", plain pages at " in supply.note and supply.note.endswith(" MiB/s")
    finally:
        supply.close()
        buf.close()


def test_no_page_supply_where_the_kernel_has_no_huge_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bmoe.engine.experts import memory
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "THP_ENABLED", str(never))
    assert memory.thp_mode() == "never" and not memory.PageSupply().enabled
    monkeypatch.setattr(memory, "THP_ENABLED", str(tmp_path / "missing"))
    assert memory.thp_mode() == "" and not memory.PageSupply().enabled


def _fake_thp(root: Path, top: str, sizes: dict[int, str]) -> Path:
    """A /sys/kernel/mm/transparent_hugepage of our own: the top mode and per-size ones."""
    root.mkdir()
    modes = ("always", "madvise", "never")
    (root / "enabled").write_text(" ".join(f"[{m}]" if m == top else m for m in modes) + "\n")
    for kib, mode in sizes.items():
        (root / f"hugepages-{kib}kB").mkdir()
        choices = ("always", "inherit", "madvise", "never")
        (root / f"hugepages-{kib}kB" / "enabled").write_text(
            " ".join(f"[{m}]" if m == mode else m for m in choices) + "\n")
    return root


def test_the_folios_fresh_pages_come_in_are_read_from_the_kernels_settings(
        tmp_path: Path) -> None:
    from bmoe.engine.experts.memory import anon_folio_sizes, folio_note

    off = _fake_thp(tmp_path / "off", "madvise",
                    {16: "never", 64: "never", 128: "madvise", 2048: "inherit"})
    assert anon_folio_sizes(str(off)) == []        # madvise / inherit of madvise: not ours
    assert "4 KiB pages" in folio_note(str(off))
    assert f"echo always > {off}/hugepages-64kB/enabled" in folio_note(str(off))
    on = _fake_thp(tmp_path / "on", "madvise", {16: "always", 64: "always", 2048: "always"})
    assert anon_folio_sizes(str(on)) == [16, 64]   # 2 MiB pages are the page supply's
    assert folio_note(str(on)) == "fresh pages come in folios of up to 64 KiB"
    inherit = _fake_thp(tmp_path / "inherit", "always", {32: "inherit", 64: "never"})
    assert anon_folio_sizes(str(inherit)) == [32]
    old = _fake_thp(tmp_path / "old", "always", {})       # a kernel before multi-size THP
    assert anon_folio_sizes(str(old)) == [] and "no smaller huge pages" in folio_note(str(old))
    assert anon_folio_sizes(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("values", [{"cache-mb": 16, "huge-pages": True},
                                    {"cache-mb": 16, "prefetch": 1, "overlap": True,
                                     "huge-pages": True}],
                         ids=["evicting", "read-ahead"])
def test_huge_pages_match_and_reads_land_in_contiguous_pages(
        models: dict[str, Path], values: dict[str, Any]) -> None:
    def check(st: ExpertStreamer) -> None:
        if st.queue is not None:                    # read-ahead or fill still in flight
            assert st.queue.wait(list(st._inflight.values()), 30)
            # the supply's fresh pages go with the C lanes too (given as reads are queued)
            from bmoe.engine.experts.reader import NativeLaneQueue, native_lanes
            assert isinstance(st.queue, NativeLaneQueue) or native_lanes() is None
        s, stats = st.summary(), st.stats()
        assert s["huge_pages"] is thp_on()
        if not thp_on():
            return
        assert stats["fresh_bytes"] > 0 and s["huge_pages_mib"] > 0
        # every resident slice's interior pages (in its slot, with expert slots on):
        # present, and few physical runs
        runs = []
        for layer, tensors in st._by_layer.items():
            for t, buf in tensors:
                for e in range(t.n_expert):
                    if not st.cache.resident[layer, e]:
                        continue
                    at = int(st._perm[layer, e]) if st._perm is not None else e
                    addr, n = buf.interior(at * t.slice_bytes, (at + 1) * t.slice_bytes)
                    if n:
                        runs.append(physical_runs(addr, n))
        assert runs
        if os.geteuid() == 0:                     # frame numbers visible (root)
            assert all(r is not None for r in runs), "a resident slice's page is missing"
            assert sum(1 for r in runs if r is not None and r <= 2) >= 0.9 * len(runs), runs

    def off(st: ExpertStreamer) -> None:
        assert st.summary()["huge_pages"] is False and st.stats()["fresh_bytes"] == 0

    assert streamed(models["moe-wide"], check, **values) == resident(models, "moe-wide")
    assert streamed(models["moe-wide"], off, **{**values, "huge-pages": False}) \
        == resident(models, "moe-wide")
    assert streamed(models["moe-wide"], off, **{k: v for k, v in values.items()
                                                if k != "huge-pages"}) \
        == resident(models, "moe-wide")                     # off unless asked for


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["take", "give"]), hs.integers(0, 15),
                          hs.integers(1, 6)), min_size=1, max_size=40),
       hs.integers(0, 12))
def test_kept_pages_carry_their_bytes_and_the_parking_space_adds_up(
        ops: list[tuple[str, int, int]], limit_pages: int) -> None:
    """Any run of `take` and `give` over a buffer's pages: what is kept stays within the
    limit, every byte `give` hands out from kept pages is a byte some `take` kept (pages
    move, nothing is copied or zeroed), and the parking mapping is always exactly its free
    ranges plus the kept ones."""
    from bmoe.engine.experts.memory import PAGE, AnonBuffer, PageSupply
    supply = PageSupply(enabled=False, park_limit=limit_pages * PAGE)
    buf = AnonBuffer(0, 16 * 6 * PAGE)
    a = buf.array
    try:
        stamp = 1
        for op, slot, pages in ops:
            at, n = slot * 6 * PAGE, pages * PAGE
            if op == "take":
                a[at:at + n:PAGE] = stamp         # committed, marked by which take
                before = supply.parked_bytes
                supply.take(buf.base + at, n)
                assert not a[at:at + n].any()      # moved away, or freed
                kept = supply.parked_bytes - before
                assert kept in (0, n)
                stamp = stamp % 250 + 1
            else:
                a[at:at + n] = 0
                reused = supply.reused_bytes
                whole = supply.give(buf.base + at, n)
                got = supply.reused_bytes - reused
                assert whole == (got == n)
                assert (a[at:at + got:PAGE] != 0).all()    # each page came from a take
                assert not a[at + got:at + n].any()
            assert 0 <= supply.parked_bytes <= supply.park_limit
            assert supply.parked_bytes == sum(n for _, n in supply.parked)
            if supply._park is not None:
                spans = sorted(supply._park_free + supply.parked)
                pos = supply._park_base
                for start, length in spans:
                    assert start == pos and length > 0
                    pos += length
                assert pos == supply._park_base + len(supply._park)
    finally:
        del a
        supply.close()
        buf.close()


def test_a_turning_cache_keeps_its_spare_pages_and_matches(models: dict[str, Path]) -> None:
    """Huge pages off (the default): a victim's pages a miss does not take (its interior is
    a page longer, by its phase in the file) are kept by the reader's supply and handed to
    the next miss that needs more, not freed and faulted in again; the tokens are the
    resident model's."""
    def check(st: ExpertStreamer) -> None:
        if st.queue is not None:
            assert st.queue.wait(list(st._inflight.values()), 30)
        s = st.summary()
        assert s["huge_pages"] is False and s["huge_pages_note"] == "off"
        assert st.reader is not None and st.reader.supply is not None
        assert st.stats()["evictions"] > 0 and s["pages_reused_mib"] > 0
        assert st.stats()["fresh_bytes"] == 0            # no huge page given
        assert st.reader.supply.parked_bytes <= st.reader.supply.park_limit

    values = {"cache-mb": 12, "prefetch": 1, "overlap": True}
    assert streamed(models["moe-odd"], check, **values) == resident(models, "moe-odd")


@pytest.mark.parametrize("values", [{"load-all": True, "huge-pages": True},
                                    {"cache-mb": 32, "huge-pages": True}],
                         ids=["load-all", "fill"])
def test_no_huge_pages_when_every_expert_fits(models: dict[str, Path],
                                              values: dict[str, Any]) -> None:
    """Each expert is then read once: contiguous pages would not pay for themselves."""
    def check(st: ExpertStreamer) -> None:
        assert st.reader is not None and st.reader.supply is None
        assert st.summary()["huge_pages"] is False and st.stats()["fresh_bytes"] == 0

    assert streamed(models["moe-wide"], check, **values) == resident(models, "moe-wide")


def test_a_miss_takes_a_victims_pages_of_another_length() -> None:
    """A slice's interior is a page longer or shorter with its phase in the file: a miss
    takes a victim's pages of the same length first, else the nearest larger one (the
    rest freed at once), else the largest smaller one (the read faults in the rest)."""
    page = mmap.PAGESIZE
    buf = AnonBuffer(0, 64 * page)
    buf.array[::page] = 1                                   # every page committed
    at = buf.base
    spare = {8 * page: [(buf, at)], 10 * page: [(buf, at + 16 * page)],
             4 * page: [(buf, at + 32 * page)]}
    assert take_spare(spare, 8 * page) == (at, 8 * page)    # the same length
    assert take_spare(spare, 7 * page) == (at + 16 * page, 7 * page)   # the nearest larger
    vec = (ctypes.c_ubyte * 10)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(at + 16 * page), 10 * page, vec) == 0
    assert [v & 1 for v in vec] == [1] * 7 + [0] * 3        # its last three pages freed
    assert take_spare(spare, 9 * page) == (at + 32 * page, 4 * page)   # the largest smaller
    assert take_spare(spare, 8 * page) is None               # nothing left
    buf.close()


@pytest.mark.parametrize("name,values", [
    ("moe", {"cache-mb": 2, "prefetch": 1, "overlap": True}),
    ("moe-f16", {"cache-mb": 1, "prefetch": 2}),
    ("moe-wide", {"cache-mb": 16, "prefetch": 1, "overlap": True}),
    ("moe", {"cache-mb": 2, "prefetch": 0, "huge-pages": True}),
    ("moe", {"cache-mb": 2, "prefetch": 1, "overlap": True}),
], ids=["f32-overlap", "f16-wait", "wide-overlap", "serial", "python-callback"])
def test_expert_slots_read_misses_into_their_victims_room_and_match(
        models: dict[str, Path], name: str, values: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Expert slots (`BMOE_EXPERT_SLOTS=1`): a missed expert is read into the room of a
    victim of its own layer, no page moved, and the routing the expert matmuls read is
    rewritten to the slots (the router's probabilities permuted to match: in the C
    callback, or with numpy under the Python callback). Prompt batches take room across
    layers. Two turns, the second reusing the first's KV: the same greedy tokens and
    bit-identical logits as the resident model."""
    monkeypatch.setenv(streamer_mod.SLOTS_ENV, "1")
    python = request.node.callspec.id == "python-callback"
    if python:
        monkeypatch.setenv(evalcb.ENV, "python")

    def check(st: ExpertStreamer) -> None:
        if st.queue is not None:
            assert st.queue.wait(list(st._inflight.values()), 30)
        s = st.summary()
        assert s["expert_slots"].startswith("on: "), s["expert_slots"]
        assert s["slot_swaps"] > 0 and s["pages_reused_mib"] == 0
        assert st.stats()["evictions"] > 0
        perm = st._perm
        assert perm is not None
        assert (np.sort(perm, axis=1) == np.arange(perm.shape[1])).all()  # permutations
        assert isinstance(st.queue, reader_mod.NativeLaneQueue) and st.queue.lanes.exact
        assert s["expert_slots"].endswith("with numpy" if python else "in C")
        supply = st.reader.supply if st.reader is not None else None
        if values.get("huge-pages") and supply is not None and supply.enabled:
            assert supply.once and s["huge_pages_mib"] > 0     # no judgement: kept on

    assert streamed(models[name], check, **values) == resident(models, name)


@pytest.mark.parametrize("name,values,why", [
    ("moe-odd", {"cache-mb": 12, "prefetch": 1}, "an expert slice is not whole pages"),
    ("moe", {"cache-mb": 2, "prefetch": 0, "prefill-ahead": False}, "read lanes' queue"),
    ("moe", {"cache-mb": 64, "prefetch": 1}, "the cache holds every expert"),
], ids=["odd-slices", "no-read-ahead", "all-fit"])
def test_expert_slots_stay_off_where_they_cannot_work(
        models: dict[str, Path], name: str, values: dict[str, Any], why: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for where they cannot work, expert slots stay off and say why; the experts
    stay in their own places (no rewrite) and the tokens are the resident model's."""
    monkeypatch.setenv(streamer_mod.SLOTS_ENV, "1")

    def check(st: ExpertStreamer) -> None:
        s = st.summary()
        assert s["expert_slots"].startswith("off: ") and why in s["expert_slots"]
        assert s["slot_swaps"] == 0 and st._perm is None

    assert streamed(models[name], check, **values) == resident(models, name)


# -- repacked experts (repack.py) ---------------------------------------------------------

# What the kernel choice says under `repack: on` here: repacked MXFP4 experts where it
# allows llama.cpp's repacked kernels (not on AMX hosts: the choice is off there).
REPACKED = {"repack": "on"}


def resident_repacked(models: dict[str, Path], name: str) -> Turns:
    """The resident engine with llama.cpp's own repacking at load (`repack: on`)."""
    return resident(models, name, **REPACKED)


def repack_allowed() -> bool:
    from bmoe.engine import kernels
    return kernels.choose("on").extra_bufts


@pytest.mark.parametrize("values", [
    {"cache-mb": 0},
    {"cache-mb": 2},
    {"cache-mb": 2, "prefetch": 0},
    {"cache-mb": 2, "prefill-ahead": False, "prefetch": 0},
    {"load-all": True},
    {"cache-mb": 64},
], ids=["cache-off", "small-cache", "no-read-ahead", "serial", "load-all", "fill"])
def test_repacked_experts_match_the_resident_repacked_engine(
        models: dict[str, Path], values: dict[str, Any]) -> None:
    """gpt-oss's MXFP4 experts, read and repacked by the streamer (by the C lanes where a
    cache turns over, by the streamer after a read it waited on otherwise) and run by
    llama.cpp's CPU_REPACK kernels: the greedy tokens and logits are the resident
    engine's with llama.cpp's own repacking at load, byte for byte. Bytes repacked
    wrong, or repacked bytes run by the file layout's kernels, would not be."""
    allowed = repack_allowed()

    def check(st: ExpertStreamer) -> None:
        state = st.load_info["expert_repack"]
        if allowed:
            assert state.startswith("on: 12 of 12 expert tensors"), state
            assert len(st._pack_kernels) == 12
        else:
            assert state.startswith("off: "), state
        assert not st._unbound      # every expert tensor was bound (and handed over)

    got = streamed(models["moe-oss"], check, **REPACKED, **values)
    assert got == resident_repacked(models, "moe-oss")


def test_repacked_experts_under_the_python_callback(models: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python graph callback binds and hands over the repacked tensors the same way."""
    monkeypatch.setenv(evalcb.ENV, "python")

    def check(st: ExpertStreamer) -> None:
        assert st.load_info["eval_callback"].startswith("python")
        assert st.load_info["expert_repack"].startswith("on" if repack_allowed() else "off")

    got = streamed(models["moe-oss"], check, **REPACKED, **{"cache-mb": 2})
    assert got == resident_repacked(models, "moe-oss")


# -- the packed experts file (packed.py) ------------------------------------------------


def model_copy(src: Path, folder: Path) -> Path:
    """The model in a folder of its own (a hard link where it can be: same bytes, same
    mtime), so a packed file beside it is seen by this test only."""
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / src.name
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


@pytest.mark.parametrize("values", [
    {"cache-mb": 2},
    {"cache-mb": 2, "prefetch": 0, "prefill-ahead": False},
    {"cache-mb": 0},
    {"load-all": True},
], ids=["small-cache", "serial", "cache-off", "load-all"])
def test_packed_experts_file_is_read_instead_of_repacking(
        models: dict[str, Path], tmp_path: Path, values: dict[str, Any]) -> None:
    """`bmoe-server models pack-experts`'s file: the MXFP4 experts already permuted, at
    the model's own offsets, the rest holes. Streamed from it (the lanes permute
    nothing), the greedy tokens and logits are the resident repacked engine's, byte for
    byte; its bytes are pack_mxfp4's of the model's."""
    model = model_copy(models["moe-oss"], tmp_path)
    out = packed.write(model)
    assert out == packed.packed_path(model) and out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    lay = read_layout(model)
    native = reader_mod.native_lanes()
    assert native is not None
    with open(model, "rb") as f, open(out, "rb") as g:
        for t in lay.experts:
            f.seek(t.offset)
            g.seek(t.offset)
            want = np.frombuffer(f.read(t.nbytes), dtype=np.uint8).copy()
            native.pack_mxfp4(want, row_bytes(t.ne0))
            assert g.read(t.nbytes) == want.tobytes(), t.name
    allowed = repack_allowed()

    def check(st: ExpertStreamer) -> None:
        assert st.reader is not None
        if not allowed:
            assert st.load_info["expert_repack"].startswith("off: ")
            assert st.reader.path == str(model)
            return
        assert st.load_info["packed_experts"] == f"on: {out.name}"
        assert st.load_info["expert_repack"].endswith(
            "read repacked from the packed experts file")
        assert st.reader.path == str(out) and not st._pack_rows
        assert len(st._pack_kernels) == 12
        if isinstance(st.queue, reader_mod.NativeLaneQueue):
            assert st.queue.lanes.packs == 0 and st.queue.lanes.exact
        assert st.file_problem() is None

    got = streamed(model, check, **REPACKED, **values)
    assert got == resident_repacked(models, "moe-oss")


def test_packed_experts_file_is_what_the_experts_are_read_from(
        models: dict[str, Path], tmp_path: Path) -> None:
    """The packed file's bytes are the ones run: with its experts' bytes spoiled (the
    trailer kept, so it still matches) the tokens are no longer the resident engine's."""
    if not repack_allowed():
        pytest.skip("this CPU runs no repacked MXFP4 kernels: the packed file is not used")
    model = model_copy(models["moe-oss"], tmp_path)
    out = packed.write(model)
    with open(out, "r+b") as g:
        for t in read_layout(model).experts:
            g.seek(t.offset)
            spoiled = bytes(reversed(g.read(t.nbytes)))
            g.seek(t.offset)
            g.write(spoiled)
    got = streamed(model, None, **REPACKED, **{"cache-mb": 2})
    assert got != resident_repacked(models, "moe-oss")


def test_packed_experts_file_passed_over_where_it_does_not_match(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Turned off, made from another version of the model, or not a packed file at all:
    the streamer reads the model and repacks as before, and says why."""
    if not repack_allowed():
        pytest.skip("this CPU runs no repacked MXFP4 kernels: the packed file is not asked")
    model = model_copy(models["moe-oss"], tmp_path)
    out = packed.write(model)

    def note(**values: Any) -> str:
        s = open_session(model, **STREAM, **REPACKED, **{"cache-mb": 2}, **values)
        try:
            st = s.streamer
            assert isinstance(st, ExpertStreamer) and st.reader is not None
            info = st.load_info["packed_experts"]
            if not info.startswith("on"):
                assert st.reader.path == str(model) and st._pack_rows
            return str(info)
        finally:
            s.close()

    assert note() == f"on: {out.name}"
    assert note(**{"packed-experts": False}) == "off"
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert "made from another version of the model file" in note()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert note() == f"on: {out.name}"
    with open(out, "r+b") as g:
        g.seek(-4, os.SEEK_END)
        g.write(b"XXXX")
    assert "is not a packed experts file" in note()
    out.unlink()
    assert note() == "none"


def test_packed_experts_file_replaced_under_a_loaded_model(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Once the experts are read from the packed file, its being replaced is a file
    problem the turn reports, as the model file's own."""
    if not repack_allowed():
        pytest.skip("this CPU runs no repacked MXFP4 kernels: the packed file is not used")
    model = model_copy(models["moe-oss"], tmp_path)
    out = packed.write(model)
    s = open_session(model, **STREAM, **REPACKED, **{"cache-mb": 2})
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        assert st.file_problem() is None
        shutil.copy2(out, tmp_path / "other")
        os.replace(tmp_path / "other", out)
        why = st.file_problem()
        assert why is not None and "packed experts file" in why and "replaced" in why
    finally:
        s.close()


def test_pack_experts_command(models: dict[str, Path], tmp_path: Path) -> None:
    """`bmoe-server models pack-experts`: a path or a name in the models folder; a model
    without MXFP4 experts refused with a sentence and exit code 1, nothing written."""
    import subprocess

    model = model_copy(models["moe-oss"], tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bmoe.server", "models", "--models-dir", str(tmp_path),
           "pack-experts"]
    r = subprocess.run([*cmd, model.name], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr
    out = packed.packed_path(model)
    assert out.exists() and f"wrote {out}" in r.stdout and "100%" in r.stderr
    dense = model_copy(models["moe"], tmp_path / "dense")
    r = subprocess.run([*cmd, str(dense)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tempfile.gettempdir())
    assert r.returncode == 1 and "no MXFP4 expert tensors" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and list(dense.parent.iterdir()) == [dense]
    r = subprocess.run([*cmd, "no-such-model.gguf"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tempfile.gettempdir())
    assert r.returncode == 1 and "neither a file nor a model" in r.stderr, r.stderr


def test_pack_experts_refuses_a_model_without_mxfp4_experts(
        models: dict[str, Path], tmp_path: Path) -> None:
    model = model_copy(models["moe"], tmp_path)
    with pytest.raises(packed.PackError, match="no MXFP4 expert tensors"):
        packed.write(model)
    assert list(tmp_path.iterdir()) == [model]


@pytest.mark.parametrize(("name", "values", "why"), [
    ("moe-oss", {"repack": "off"}, "off: turned off by the setting"),
    ("moe", REPACKED, "off: no MXFP4 experts"),
    ("moe-f16", REPACKED, "off: no MXFP4 experts"),
])
def test_experts_keep_the_files_layout_where_repacking_is_not_chosen(
        models: dict[str, Path], name: str, values: dict[str, Any], why: str) -> None:
    s = open_session(models[name], **STREAM, **{"cache-mb": 2}, **values)
    try:
        st = s.streamer
        assert isinstance(st, ExpertStreamer)
        assert st.load_info["expert_repack"] == why
        assert not st._pack_rows and not st._pack_kernels
    finally:
        s.close()
