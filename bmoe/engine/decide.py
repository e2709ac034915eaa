"""Decide: which of a list of choices the model would answer next, from one prefill.

Theory of operation
-------------------
``prefix + suffix`` is rendered as one user message through the model's chat template
with reasoning off and the generation prompt added, so the next token is the first of
the answer. The prompt is prefilled (no decode) and the last position's logits are
turned into log-probabilities over the whole vocabulary (``log_softmax``); each choice
is scored by its first token, in request order, and not renormalised over the choices.
Two choices that share a first token cannot be told apart and are refused.

*Prefix reuse.* The split between prefix and suffix only says which part is worth
keeping. Two mechanisms keep it, cheapest first:

1. the KV cache: the session keeps the tokens of its last prompt, and a prompt that
   shares a start with them prefills only the rest (free, but the next chat turn
   overwrites it);
2. a saved sequence state (``llama_state_seq_get_data``): after the prefix is prefilled
   its KV is copied out (``store_s``, ``prefix_state_mib``), and a later decision whose
   prompt starts with those tokens restores it (``llama_state_seq_set_data``,
   ``restore_s``) when the KV no longer holds as much, e.g. after a chat turn. One
   state is kept per session; a different prefix replaces it.

``n_reused`` is what the KV or the restored state already held; ``n_prefilled`` what
this decision decoded. Everything here runs on the engine thread.
"""

from __future__ import annotations

import ctypes
import math
import resource
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import llama_cpp as lc

from .errors import Aborted, EngineError
from .session import Session
from .templating import TemplateError

MIB = 1 << 20


@dataclass
class DecideRequest:
    prefix: str
    suffix: str
    choices: list[str]
    reuse_prefix: bool = True


@dataclass
class DecideResult:
    cancelled: bool
    choice_logp: list[float | None]
    n_tokens: int
    n_reused: int = 0
    n_prefilled: int = 0
    restore_s: float = 0.0
    store_s: float = 0.0
    prefill_s: float = 0.0
    prefill_cpu_s: float = 0.0
    streamer: dict[str, float] = field(default_factory=dict)
    prefix_state_mib: float = 0.0

    @property
    def best(self) -> int:
        """The index of the likeliest choice; -1 when none was scored (cancelled)."""
        scored = [(v, i) for i, v in enumerate(self.choice_logp) if v is not None]
        if not scored:
            return -1
        return max(scored, key=lambda vi: (vi[0], -vi[1]))[1]

    def answer(self) -> dict[str, Any]:
        """The `POST /api/decide` answer (the CLI's `BMOE_DECIDE` keys), in the spec's order."""
        s = self.streamer
        return {
            "cancelled": self.cancelled, "best": self.best, "choice_logp": self.choice_logp,
            "n_tokens": self.n_tokens, "n_reused": self.n_reused,
            "n_prefilled": self.n_prefilled, "restore_s": round(self.restore_s, 6),
            "store_s": round(self.store_s, 6), "prefill_s": round(self.prefill_s, 4),
            "prefill_cpu_s": round(self.prefill_cpu_s, 4),
            "prefill_read_mib": round(s.get("read_mib", 0.0), 3),
            "prefill_io_s": round(s.get("io_ms", 0.0) / 1000.0, 4),
            "prefill_stall_s": round(s.get("stall_ms", 0.0) / 1000.0, 4),
            "prefill_mgmt_s": round(s.get("mgmt_ms", 0.0) / 1000.0, 4),
            # No device prefill exists in this engine: its figures are the unmeasured zero.
            "prefill_dev_tokens": 0, "prefill_dev_read_mib": 0.0, "prefill_dev_stall_s": 0.0,
            "prefill_dev_cache_mib": 0.0, "prefill_dev_routed": 0, "prefill_dev_demand": 0,
            "prefix_state_mib": round(self.prefix_state_mib, 3),
        }


# --- pure parts ---------------------------------------------------------------------------

def log_softmax(logits: Sequence[float]) -> list[float]:
    """log p_i = x_i - logsumexp(x), in float64; -inf stays -inf (a masked token)."""
    import numpy as np
    x = np.asarray(logits, dtype=np.float64)
    top = float(np.max(x))
    if not math.isfinite(top):
        return [-math.inf] * len(x)
    lse = top + math.log(float(np.sum(np.exp(x - top))))
    return list(x - lse)


def as_json_logp(value: float) -> float | None:
    """A log-probability for JSON: ``None`` where it is minus infinity (or not a number)."""
    return float(value) if math.isfinite(value) else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def check_first_tokens(choices: list[str], firsts: list[int | None]) -> None:
    """Refuse an empty list, a choice with no token, or two choices sharing a first token."""
    if not choices:
        raise EngineError("invalid_request", "`choices` is empty: give at least one choice.")
    seen: dict[int, int] = {}
    for i, tok in enumerate(firsts):
        if tok is None:
            raise EngineError("invalid_request", f"choices[{i}] is empty: it has no first token.")
        if tok in seen:
            raise EngineError(
                "invalid_request",
                f"choices[{seen[tok]}] ({choices[seen[tok]]!r}) and choices[{i}] "
                f"({choices[i]!r}) start with the same token, so one prefill cannot tell them "
                "apart: make their first words differ.")
        seen[tok] = i


# --- the saved prefix state ----------------------------------------------------------------

class PrefixState:
    """One saved KV sequence state and the tokens it holds."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._buf: Any = None
        self._size = 0

    @property
    def mib(self) -> float:
        return self._size / MIB

    def covers(self, tokens: Sequence[int]) -> bool:
        n = len(self.tokens)
        return n > 0 and len(tokens) > n and list(tokens[:n]) == self.tokens

    def save(self, session: Session, tokens: list[int]) -> None:
        size = lc.llama_state_seq_get_size(session.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(session.ctx, buf, size, 0)
        if written == 0:
            self.clear()
            return
        self._buf, self._size, self.tokens = buf, written, list(tokens)

    def restore(self, session: Session) -> bool:
        """Put the saved state in sequence 0; False (KV cleared) when llama.cpp refused it."""
        lc.llama_memory_seq_rm(session.memory, 0, -1, -1)
        read = lc.llama_state_seq_set_data(session.ctx, self._buf, self._size, 0)
        if read == 0:
            session.clear_kv()
            self.clear()
            return False
        session.kv_tokens = list(self.tokens)
        return True

    def clear(self) -> None:
        self.tokens, self._buf, self._size = [], None, 0


_states: "weakref.WeakKeyDictionary[Session, PrefixState]" = weakref.WeakKeyDictionary()


def prefix_state(session: Session) -> PrefixState:
    """The session's saved prefix state (one per session, freed with it)."""
    state = _states.get(session)
    if state is None:
        state = _states[session] = PrefixState()
    return state


# --- the decision ----------------------------------------------------------------------------

def render_prompt(session: Session, req: DecideRequest) -> tuple[list[int], int]:
    """The prompt's tokens and how many of them belong to the prefix alone."""
    content = req.prefix + req.suffix
    try:
        text = session.render([{"role": "user", "content": content}], enable_thinking=False)
    except TemplateError as e:
        raise EngineError("template_rejected", str(e)) from e
    tokens = session.tokenize(text)
    end = _prefix_end(text, content, req.prefix)
    if end <= 0:
        return tokens, 0
    # The prefix's own tokenization may merge differently at its end: keep the common part.
    head = session.tokenize(text[:end])
    return tokens, min(common_prefix(head, tokens), len(tokens) - 1)


def _prefix_end(text: str, content: str, prefix: str) -> int:
    """Where the prefix ends in the rendered prompt; -1 when it cannot be found (a
    template that trims the message, say): then nothing is kept."""
    if not prefix.strip():
        return -1
    at = text.find(content)
    if at >= 0:
        return at + len(prefix)
    head = prefix.strip()
    at = text.find(head)
    return at + len(head) if at >= 0 else -1


def first_token(session: Session, choice: str) -> int | None:
    toks = session.tokenize(choice, special=False)
    bos = lc.llama_vocab_bos(session.vocab)
    if toks and lc.llama_vocab_get_add_bos(session.vocab) and toks[0] == bos:
        toks = toks[1:]
    return toks[0] if toks else None


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def decide(session: Session, req: DecideRequest, cancel: threading.Event) -> DecideResult:
    """Score ``req.choices`` after one prefill (engine thread). EngineError on refusal."""
    if session.ctx is None:
        raise EngineError("failed", "The model was unloaded before this decision ran.")
    firsts = [first_token(session, c) for c in req.choices]
    check_first_tokens(req.choices, firsts)
    tokens, n_keep = render_prompt(session, req)
    if len(tokens) > session.n_ctx:
        raise EngineError(
            "context_full", f"The decision's prompt is {len(tokens)} tokens and the context "
            f"({{ctx-size}}) holds {session.n_ctx}. Raise {{ctx-size}} or shorten the prompt.")
    saved = prefix_state(session)
    result = DecideResult(cancelled=False, choice_logp=[None] * len(req.choices),
                          n_tokens=len(tokens))
    in_kv = min(common_prefix(session.kv_tokens, tokens), len(tokens) - 1)
    if req.reuse_prefix and saved.covers(tokens) and len(saved.tokens) > in_kv:
        t0 = time.monotonic()
        if saved.restore(session):
            in_kv = len(saved.tokens)
        result.restore_s = time.monotonic() - t0
    result.n_reused = in_kv
    try:
        _prefill(session, req, tokens, n_keep, saved, cancel, result)
    except Aborted:
        result.cancelled = True
        return result
    logp = log_softmax(session.logits_row())
    result.choice_logp = [as_json_logp(logp[t]) for t in firsts if t is not None]
    return result


def _prefill(session: Session, req: DecideRequest, tokens: list[int], n_keep: int,
             saved: PrefixState, cancel: threading.Event, result: DecideResult) -> None:
    streamer = session.streamer
    if streamer is not None:
        streamer.token_begin()
    cpu0, t0 = _cpu_s(), time.monotonic()
    try:
        if req.reuse_prefix and n_keep > 0 and saved.tokens != tokens[:n_keep]:
            reused, _ = session.prefill(tokens[:n_keep], cancel)
            result.n_prefilled += n_keep - reused
            t_store = time.monotonic()
            saved.save(session, tokens[:n_keep])
            result.store_s = time.monotonic() - t_store
        reused, _ = session.prefill(tokens, cancel)
        result.n_prefilled += len(tokens) - reused
    finally:
        result.prefill_s = time.monotonic() - t0 - result.store_s
        result.prefill_cpu_s = _cpu_s() - cpu0
        result.prefix_state_mib = saved.mib
        if streamer is not None:
            figures = streamer.token_end()
            result.streamer = {k: float(figures.get(k, 0.0) or 0.0)
                               for k in ("read_mib", "io_ms", "stall_ms", "mgmt_ms")}
