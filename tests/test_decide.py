"""Decide: the scoring maths, the engine with its prefix reuse, and POST /api/decide."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from bmoe.engine.decide import (DecideRequest, DecideResult, as_json_logp, check_first_tokens,
                                decide, log_softmax, prefix_state)
from bmoe.engine.errors import EngineError
from bmoe.engine.session import Session

from conftest import ServerProcess, start_server

ANSWER_KEYS = ["cancelled", "best", "choice_logp", "n_tokens", "n_reused", "n_prefilled",
               "restore_s", "store_s", "prefill_s", "prefill_cpu_s", "prefill_read_mib",
               "prefill_io_s", "prefill_stall_s", "prefill_mgmt_s", "prefill_dev_tokens",
               "prefill_dev_read_mib", "prefill_dev_stall_s", "prefill_dev_cache_mib",
               "prefill_dev_routed", "prefill_dev_demand", "prefix_state_mib"]
PREFIX = "You are choosing the next action for a robot in a kitchen.\nTask: make tea.\n"
CHOICES = ["A", "B", "C"]
TOL = 2e-3   # thread count and chunking change the last bits of llama.cpp's sums


def manual_logp(session: Session, content: str, choices: list[str]) -> list[float]:
    """The reference: render, prefill, log-softmax over the whole vocabulary, by hand."""
    text = session.render([{"role": "user", "content": content}], enable_thinking=False)
    session.clear_kv()
    session.prefill(session.tokenize(text), threading.Event())
    x = session.logits_row().astype(np.float64)
    logp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    return [float(logp[session.tokenize(c, special=False)[0]]) for c in choices]


@pytest.fixture(scope="module")
def session(tiny_moe: Path) -> Iterator[Session]:
    s = Session(tiny_moe, {"ctx-size": 4096, "threads": 1})
    yield s
    s.close()


# --- the pure parts ----------------------------------------------------------------------

def test_log_softmax_is_normalised_and_keeps_minus_infinity() -> None:
    x = [2.0, 1.0, -math.inf, 0.5]
    logp = log_softmax(x)
    assert math.isclose(sum(math.exp(v) for v in logp), 1.0, rel_tol=1e-12)
    assert logp[2] == -math.inf and as_json_logp(logp[2]) is None
    assert math.isclose(logp[0] - logp[1], 1.0)
    assert as_json_logp(logp[0]) == pytest.approx(logp[0])


def test_best_is_the_highest_and_minus_one_when_nothing_was_scored() -> None:
    assert DecideResult(False, [-3.2, -0.1, None], 5).best == 1
    assert DecideResult(False, [-1.0, -1.0], 5).best == 0
    assert DecideResult(True, [None, None], 5).best == -1


@pytest.mark.parametrize("choices,firsts,why", [
    ([], [], "empty"), (["x", ""], [5, None], "empty"), (["ab", "ac"], [7, 7], "same token")])
def test_first_token_refusals(choices: list[str], firsts: list[int | None], why: str) -> None:
    with pytest.raises(EngineError, match=why) as e:
        check_first_tokens(choices, firsts)
    assert e.value.code == "invalid_request"


def test_prefix_end_in_the_rendered_prompt() -> None:
    from bmoe.engine.decide import _prefix_end
    text = "<|im_start|>user\nPick one. A or B?<|im_end|>\n"
    assert text[:_prefix_end(text, "Pick one. A or B?", "Pick one.")].endswith("Pick one.")
    trimmed = "<|im_start|>user\nPick one.<|im_end|>\n"   # a template that trims the message
    assert trimmed[:_prefix_end(trimmed, "  Pick one.  ", "  Pick one.")].endswith("one.")
    assert _prefix_end(text, "x", "") == -1 and _prefix_end(text, "nope", "nope") == -1


# --- the engine ------------------------------------------------------------------------

def test_engine_logp_equals_the_manual_computation(session: Session) -> None:
    suffix = "\nWhat next? Answer with the letter."
    expected = manual_logp(session, PREFIX + suffix, CHOICES)
    result = decide(session, DecideRequest(PREFIX, suffix, CHOICES, reuse_prefix=False),
                    threading.Event())
    assert result.choice_logp == pytest.approx(expected, abs=TOL)
    assert result.best == int(np.argmax(expected))
    assert list(result.answer()) == ANSWER_KEYS


def test_engine_prefix_state_survives_a_chat_and_gives_the_same_answer(session: Session) -> None:
    prefix = PREFIX + "Kettle: cold.\n"
    session.clear_kv()
    prefix_state(session).clear()
    first = decide(session, DecideRequest(prefix, "Screen: 1", CHOICES), threading.Event())
    assert first.store_s > 0 and first.prefix_state_mib > 0
    # A chat turn overwrites the KV: the next decision restores the saved prefix state.
    session.prefill(session.tokenize("<|im_start|>user\nsomething else entirely"),
                    threading.Event())
    second = decide(session, DecideRequest(prefix, "Screen: 2", CHOICES), threading.Event())
    assert second.restore_s > 0 and second.store_s == 0
    assert second.n_reused >= len(session.tokenize(prefix)) - 2
    assert second.n_reused + second.n_prefilled == second.n_tokens
    expected = manual_logp(session, prefix + "Screen: 2", CHOICES)
    assert second.choice_logp == pytest.approx(expected, abs=TOL)


def test_engine_cancel_stops_the_prefill(session: Session) -> None:
    cancel = threading.Event()
    cancel.set()
    result = decide(session, DecideRequest("go " * 400, "", CHOICES, reuse_prefix=False), cancel)
    assert result.cancelled and result.best == -1 and result.choice_logp == [None] * 3


def test_engine_refuses_a_prompt_past_the_context(session: Session) -> None:
    with pytest.raises(EngineError) as e:
        decide(session, DecideRequest("word " * 3000, "", CHOICES), threading.Event())
    assert e.value.code == "context_full"


# --- the route -----------------------------------------------------------------------------

def post_decide(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, answer = server.request("POST", "/api/decide", body)
    return status, answer


def test_route_logp_equals_llama_cpp_logits(server: ServerProcess, session: Session) -> None:
    suffix = "\nThe kettle is on. Answer with the letter."
    status, answer = post_decide(server, {"prefix": PREFIX, "suffix": suffix,
                                          "choices": CHOICES, "reuse_prefix": False})
    assert status == 200, answer
    assert list(answer) == ANSWER_KEYS
    expected = manual_logp(session, PREFIX + suffix, CHOICES)
    assert answer["choice_logp"] == pytest.approx(expected, abs=TOL)
    assert answer["best"] == int(np.argmax(expected)) and answer["cancelled"] is False
    assert answer["n_tokens"] == len(session.tokenize(session.render(
        [{"role": "user", "content": PREFIX + suffix}], enable_thinking=False)))


def test_route_second_call_reuses_the_prefix(server: ServerProcess, session: Session) -> None:
    prefix = PREFIX + "Cups: two, both clean. Water: none in the kettle yet.\n"
    status, first = post_decide(server, {"prefix": prefix, "suffix": "Screen: a",
                                         "choices": CHOICES})
    assert status == 200, first
    status, second = post_decide(server, {"prefix": prefix, "suffix": "Screen: b",
                                          "choices": CHOICES})
    assert status == 200, second
    assert second["n_reused"] > first["n_reused"] and second["n_reused"] > 20
    assert second["n_prefilled"] < first["n_prefilled"]
    # A chat turn in between: the saved prefix state is restored.
    status, _, _ = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Unrelated."}], "max_tokens": 2})
    assert status == 200
    status, third = post_decide(server, {"prefix": prefix + "Later: ", "suffix": "Screen: c",
                                         "choices": CHOICES})
    assert status == 200, third
    n_prefix = len(session.tokenize("<|im_start|>user\n" + prefix))
    assert third["n_reused"] >= n_prefix - 1 and third["restore_s"] > 0


@pytest.mark.parametrize("body,code", [
    ({"prefix": "x", "choices": []}, "invalid_request"),
    ({"prefix": "x"}, "invalid_request"),
    ({"prefix": "x", "choices": "A"}, "invalid_request"),
    ({"prefix": "x", "choices": ["A", 3]}, "invalid_request"),
    ({"prefix": 5, "choices": ["A"]}, "invalid_request"),
    ({"prefix": "x", "choices": ["A"], "reuse_prefix": "yes"}, "invalid_request"),
    ({"prefix": "x", "choices": ["A", "A"]}, "invalid_request"),
    ({"prefix": "x", "choices": ["A", ""]}, "invalid_request"),
    ({"prefix": "word " * 3000, "choices": ["A"]}, "context_full"),
])
def test_route_refusals_are_400(server: ServerProcess, body: dict[str, Any], code: str) -> None:
    status, answer = post_decide(server, body)
    assert status == 400, answer
    assert answer["code"] == code and answer["error"]


def test_route_cancel_stops_a_decision(server: ServerProcess) -> None:
    out: dict[str, Any] = {}
    # About 3900 tokens: seconds of prefill on the tiny model, in 8 chunks.
    body = {"prefix": "go " * 1290, "suffix": "", "choices": CHOICES, "reuse_prefix": False}
    t = threading.Thread(target=lambda: out.update(r=post_decide(server, body)))
    t.start()
    deadline = time.monotonic() + 20
    while not server.info()["generating"]:
        assert time.monotonic() < deadline and t.is_alive(), out
        time.sleep(0.005)
    status, _, body = server.request("POST", "/api/cancel")
    assert status == 200 and body == {"cancelled": True}
    t.join(30)
    status, answer = out["r"]
    assert status == 200, answer
    assert answer["cancelled"] is True and answer["best"] == -1
    assert answer["choice_logp"] == [None, None, None]
    # The session is fine afterwards.
    status, answer = post_decide(server, {"prefix": "Pick.", "choices": CHOICES})
    assert status == 200 and answer["cancelled"] is False


def test_route_without_a_model_is_503(tmp_path: Path) -> None:
    srv = start_server(tmp_path, wait_ready=False)
    try:
        status, answer = post_decide(srv, {"prefix": "x", "choices": ["A"]})
        assert status == 503 and answer["code"] == "no_model"
    finally:
        srv.stop()


def test_route_refused_when_the_decide_parameter_is_off(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "512", "--threads", "1",
                       "--no-decide")
    try:
        status, answer = post_decide(srv, {"prefix": "x", "choices": ["A"]})
        assert status == 409 and answer["code"] == "decide_off", answer
        assert "Decisions" in answer["error"]
    finally:
        srv.stop()
