"""The first answer's calibration: the trial's bookkeeping, the planner reading its verdict,
and a real session trying two thread counts without changing a token."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from bmoe.engine import params
from bmoe.engine.calibrate import MIN_GAIN, WINDOW_TOKENS, WINDOWS_PER_ARM, Arm, Trial
from bmoe.engine.session import Session
from bmoe.planner.routing import read_trial, trial_path, write_trial
from test_plan import COMPUTE, memory, moe_facts, plan_for

GIB = 1 << 30


def run(trial: Trial, seconds: dict[Arm, float]) -> list[Arm]:
    seen = []
    while not trial.done:
        arm = trial.arm()
        seen.append(arm)
        trial.record(seconds[arm] * (5.0 if trial.step % WINDOW_TOKENS == 0 else 1.0))
    return seen


def test_no_trial_without_a_second_value() -> None:
    assert Trial.from_values({"threads": 2}, can_overlap=True) is None
    assert Trial.from_values({"threads": 2, "trial-threads": 2}, can_overlap=True) is None
    assert Trial.from_values({"threads": 2, "trial-overlap": True}, can_overlap=False) is None


def test_arms_alternate_by_window_and_the_faster_wins() -> None:
    trial = Trial.from_values({"threads": 2, "trial-threads": 1, "overlap": False,
                               "trial-overlap": True}, can_overlap=True)
    assert trial is not None
    a, b, c = Arm(2, False), Arm(1, False), Arm(2, True)
    assert trial.arms == [a, b, c]
    seen = run(trial, {a: 0.010, b: 0.008, c: 0.012})
    assert len(seen) == 3 * WINDOW_TOKENS * WINDOWS_PER_ARM
    assert seen[:WINDOW_TOKENS] == [a] * WINDOW_TOKENS
    assert seen[WINDOW_TOKENS:2 * WINDOW_TOKENS] == [b] * WINDOW_TOKENS
    verdict = trial.verdict
    assert verdict is not None and (verdict["threads"], verdict["overlap"]) == (1, False)
    # the warm-up step of each window (5x slower here) is not counted
    assert [arm["s_per_token"] for arm in verdict["arms"]] == [0.01, 0.008, 0.012]
    assert trial.arm() == b          # the winner runs from now on
    trial.record(99.0)               # and nothing more is counted
    assert verdict["arms"][1]["s_per_token"] == 0.008


def test_a_gain_within_the_noise_keeps_the_plans_choice() -> None:
    trial = Trial.from_values({"threads": 2, "trial-threads": 1}, can_overlap=False)
    assert trial is not None
    run(trial, {Arm(2, False): 0.010, Arm(1, False): 0.010 * (1 - MIN_GAIN / 2)})
    assert trial.verdict is not None and trial.verdict["threads"] == 2


def test_the_plan_tries_until_measured_then_reads_the_verdict(tmp_path: Path) -> None:
    facts = moe_facts()
    plan = plan_for(facts, memory(2 * GIB), {"prefetch": 1}).to_json()
    assert plan["values"]["threads"] == 2 and plan["values"]["trial-threads"] == 1
    assert plan["values"]["trial-overlap"] is True and "overlap" not in plan["values"]
    assert "--trial-threads" in plan["args"]
    trial = {"threads": 1, "overlap": True, "threads_measured": True, "overlap_measured": True,
             "arms": [{"threads": 2, "overlap": False, "s_per_token": 0.02},
                      {"threads": 1, "overlap": False, "s_per_token": 0.015},
                      {"threads": 2, "overlap": True, "s_per_token": 0.019}]}
    plan = plan_for(facts, memory(2 * GIB), {"prefetch": 1}, trial=trial).to_json()
    assert plan["values"]["threads"] == 1 and plan["values"]["overlap"] is True
    assert "trial-threads" not in plan["values"] and "trial-overlap" not in plan["values"]
    threads = next(d for d in plan["decisions"] if d["knob"] == "threads")
    assert threads["source"] == "measured" and "measured on this model" in threads["brief"]
    # the operator's own threads are never tried against anything
    plan = plan_for(facts, memory(2 * GIB), {"threads": 2}).to_json()
    assert "trial-threads" not in plan["values"]
    assert COMPUTE.rates    # the alternative came from the matmul's rates


def test_a_verdict_is_kept_and_a_hostile_one_ignored(tmp_path: Path) -> None:
    file = trial_path(tmp_path, "/m/x.gguf", 123)
    write_trial(file, {"threads": 2, "overlap": False,
                       "arms": [{"threads": 2, "overlap": False, "s_per_token": 0.1},
                                {"threads": 1, "overlap": False, "s_per_token": 0.2}]})
    verdict, warning = read_trial(file)
    assert warning == "" and verdict is not None
    assert verdict["threads_measured"] and not verdict["overlap_measured"]
    for bad in (b"{", b"[]", json.dumps({"threads": 0, "overlap": False, "arms": []}).encode(),
                json.dumps({"threads": 2, "overlap": "yes", "arms": [{}]}).encode(),
                b" " * 20000):
        file.write_bytes(bad)
        verdict, warning = read_trial(file)
        assert verdict is None and warning, bad[:20]


def test_a_session_tries_two_thread_counts_without_changing_a_token(tiny_moe: Path) -> None:
    values = params.defaults(server=True)
    values.update({"model": str(tiny_moe), "ctx-size": 512, "threads": 1})

    def greedy(extra: dict) -> tuple[list[int], Session]:
        s = Session(tiny_moe, {**values, **extra})
        prompt = s.tokenize("Once upon a time")
        gen = s.generate(prompt, max_tokens=40, cancel=threading.Event(),
                         on_token=lambda ev: None)
        return gen.tokens, s

    plain, s0 = greedy({})
    s0.close()
    tried, s1 = greedy({"trial-threads": 2})
    try:
        assert s1.trial is not None and s1.trial.done, "40 tokens finish a 2-arm trial"
        assert tried == plain
        arms = s1.trial.verdict["arms"]
        assert [a["threads"] for a in arms] == [1, 2] and all(a["s_per_token"] > 0 for a in arms)
        assert s1.compute_threads == s1.trial.verdict["threads"]
    finally:
        s1.close()
