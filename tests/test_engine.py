"""The engine session on its own: KV reuse, cancel, sampling, lazy grammars."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from bmoe.engine.errors import EngineError
from bmoe.engine.session import Session, TokenEvent


@pytest.fixture(scope="module")
def session(tiny_moe: Path) -> Iterator[Session]:
    s = Session(tiny_moe, {"ctx-size": 1024, "threads": 1})
    yield s
    s.close()


def _gen(s: Session, prompt: list[int], n: int, **kw: object) -> tuple[list[int], str, object]:
    events: list[TokenEvent] = []
    g = s.generate(prompt, max_tokens=n, cancel=threading.Event(), on_token=events.append, **kw)
    assert [e.step for e in events] == list(range(1, len(events) + 1))
    return g.tokens, g.text, g


def test_greedy_is_deterministic_and_reuses_the_prefix(session: Session) -> None:
    prompt = session.tokenize("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")
    session.clear_kv()                      # whatever ran before, this prefills in full
    a, text_a, ga = _gen(session, prompt, 20)
    assert ga.n_cached == 0 and ga.n_prefilled == len(prompt)
    b, text_b, gb = _gen(session, prompt, 20)
    assert a == b and text_a == text_b
    assert gb.n_cached == len(prompt) - 1  # all but the token decoded for fresh logits
    longer = prompt + session.tokenize("more words")
    _, _, gc = _gen(session, longer, 4)
    assert gc.n_cached >= len(prompt) - 1


def test_budget_and_context_bounds(session: Session) -> None:
    prompt = session.tokenize("count")
    toks, _, g = _gen(session, prompt, 7)
    assert len(toks) == 7 and g.finish == "length"
    with pytest.raises(EngineError) as e:
        _gen(session, session.tokenize("word " * 2000), 5)
    assert e.value.code == "context_full"


def test_cancel_between_tokens(session: Session) -> None:
    cancel = threading.Event()
    seen: list[int] = []

    def on_token(ev: TokenEvent) -> None:
        seen.append(ev.token)
        if len(seen) == 5:
            cancel.set()

    g = session.generate(session.tokenize("go"), max_tokens=100, cancel=cancel,
                         on_token=on_token)
    assert g.finish == "cancelled" and len(g.tokens) == 5


def test_lazy_grammar_holds_only_after_its_trigger(session: Session) -> None:
    prompt = session.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    free, _, _ = _gen(session, prompt, 3)
    trigger = free[1]  # the second token the model writes freely
    piece = session.token_text(trigger).replace("\\", "\\\\").replace('"', '\\"')
    grammar = f'root ::= "{piece}" "xyz"'
    toks, text, g = _gen(session, prompt, 30, grammar=grammar, grammar_triggers=[trigger])
    assert toks[:2] == free[:2]          # free text up to and including the trigger
    assert text.endswith(session.token_text(trigger) + "xyz")
    assert g.finish == "stop"            # the grammar is complete: end of generation
