"""Per-request sampling: llama-server's fields as one value, and the chain built from it.

Theory of operation
-------------------
The chat routes sample with the session's settings (`temp`, `top-k`, `top-p`, `seed`);
llama-server's own routes (`/completion`, `/v1/completions`) carry their sampling in the
request. A `Sampling` holds those fields, already checked for type and range by the
protocol's decoder. Everything that names a token id (`logit_bias`) is checked here
against the loaded vocabulary before llama.cpp sees it: an id past the vocabulary is
an out-of-bounds write in C, not an error.

The chain follows llama-server's default order for the stages bmoe has: logit bias,
the grammar, penalties, top-k, top-p, min-p, temperature, then the draw (or greedy at
temperature 0). `ignore_eos` is a bias of minus infinity on every end-of-generation id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import llama_cpp as lc

from .errors import EngineError

SEED_RANDOM = 4294967295      # llama.cpp's LLAMA_DEFAULT_SEED: a new seed every request
N_PROBS_MAX = 100             # top entries reported per token (llama-server has no cap; we do)
LOGIT_BIAS_MAX = 100.0        # |bias| beyond this is refused (OpenAI's range)
LOGIT_BIAS_ENTRIES_MAX = 4096


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = SEED_RANDOM
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias); -inf keeps it out
    logit_bias_text: tuple[tuple[str, float], ...] = ()  # (text, bias): each of its tokens
    n_probs: int = 0
    post_sampling_probs: bool = False   # n_probs after the samplers (probabilities), not before
    stop: tuple[str, ...] = ()

    def with_seed(self, seed: int) -> "Sampling":
        return replace(self, seed=seed)

    def settings(self) -> dict[str, Any]:
        """llama-server's `generation_settings` names for these fields."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "repeat_penalty": self.repeat_penalty,
                "repeat_last_n": self.repeat_last_n, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "seed": self.seed,
                "ignore_eos": self.ignore_eos, "n_probs": self.n_probs,
                "post_sampling_probs": self.post_sampling_probs, "stop": list(self.stop),
                "logit_bias": [{"token": t, "bias": b if math.isfinite(b) else None}
                               for t, b in self.logit_bias],
                "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}


def check_tokens(ids: list[int], n_vocab: int, field: str) -> None:
    """Every id a client sent must name a token of this vocabulary (400 naming `field`)."""
    for i, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise EngineError("invalid_request", f"`{field}` holds {t} at [{i}], which is not "
                              f"a token of this model (ids run from 0 to {n_vocab - 1}).",
                              param=field)


def eog_ids(session: Any) -> list[int]:
    """The vocabulary's end-of-generation ids (found once per session)."""
    cached = session.__dict__.get("_eog_ids")
    if cached is None:
        cached = [t for t in range(session.n_vocab) if lc.llama_vocab_is_eog(session.vocab, t)]
        session.__dict__["_eog_ids"] = cached
    return cached


def chain_biases(session: Any, s: Sampling) -> dict[int, float]:
    """The logit biases the chain adds: the request's ids, each token of its texts (as
    llama-server reads a text key), and -inf on end-of-generation with `ignore_eos`."""
    check_tokens([t for t, _ in s.logit_bias], session.n_vocab, "logit_bias")
    bias = dict(s.logit_bias)
    for text, b in s.logit_bias_text:
        for t in session.tokenize(text, special=False, add_special=False):
            bias[t] = b
    if s.ignore_eos:
        bias.update({t: -math.inf for t in eog_ids(session)})
    return bias


def build_chain(session: Any, s: Sampling, grammar_sampler: Any, prompt: list[int]) -> Any:
    """A llama.cpp sampler chain for `s` (engine thread). The caller frees it."""
    bias = chain_biases(session, s)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if bias:
        arr = (lc.llama_logit_bias * len(bias))()
        for i, (t, b) in enumerate(bias.items()):
            arr[i].token = t  # type: ignore[assignment]  # ctypes field
            arr[i].bias = b
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(
            session.n_vocab, len(bias), arr))
    if grammar_sampler is not None:
        lc.llama_sampler_chain_add(chain, grammar_sampler)
    penalised = s.repeat_penalty != 1.0 or s.presence_penalty or s.frequency_penalty
    if penalised and s.repeat_last_n != 0:
        # llama.cpp sizes a ring buffer by this count: never past the context (an id
        # count of 2**31 would be a failed allocation, which aborts the process).
        last_n = session.n_ctx if s.repeat_last_n < 0 else min(s.repeat_last_n, session.n_ctx)
        pen = lc.llama_sampler_init_penalties(session.n_vocab, last_n, s.repeat_penalty, s.frequency_penalty,
                                              s.presence_penalty)
        for t in prompt[-last_n:]:       # the prompt counts, as in llama-server
            lc.llama_sampler_accept(pen, t)
        lc.llama_sampler_chain_add(chain, pen)
    if s.temperature <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    if s.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    if s.top_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    if s.min_p > 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
    return chain


def top_logprobs(row: Any, chosen: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen id's log-probability and the `n` most likely ids with theirs, from the
    model's own logits (before any bias or sampler), most likely first."""
    import numpy as np
    row = row.astype(np.float64)
    row -= row.max()
    logz = math.log(float(np.exp(row).sum()))
    k = min(n, row.shape[0])
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return float(row[chosen] - logz), [(int(i), float(row[i] - logz)) for i in idx]


def post_sampling_logprobs(row: Any, s: Sampling, chosen: int, n: int,
                           biases: Any = ()) -> tuple[float, list[tuple[int, float]]]:
    """As `top_logprobs`, but over what the samplers leave (llama-server's
    `post_sampling_probs`): the logit biases added, then top-k, top-p and min-p keep their
    ids and the temperature reshapes them, in the chain's order (`build_chain`); the
    distribution the id was drawn from, most likely first, at most `n` ids. Greedy
    sampling draws from one id (probability 1). `biases`: the (id, bias) pairs the chain
    adds (`chain_biases`). The repetition penalties are not replayed here (they are off
    by default)."""
    import numpy as np
    if s.temperature <= 0:
        return 0.0, [(chosen, 0.0)]
    x = row.astype(np.float64)
    for tok, bias in biases:
        if 0 <= tok < x.shape[0]:
            x[tok] += bias
    order = np.argsort(-x, kind="stable")
    order = order[np.isfinite(x[order])]
    if s.top_k > 0:
        order = order[:s.top_k]

    def softmax(values: Any) -> Any:
        e = np.exp(values - values.max())
        return e / e.sum()
    if s.top_p < 1.0 and order.size > 1:
        cum = np.cumsum(softmax(x[order]))
        keep = int(np.searchsorted(cum, s.top_p, side="left")) + 1
        order = order[:max(1, keep)]
    if s.min_p > 0.0 and order.size > 1:
        kept = x[order] >= x[order[0]] + math.log(s.min_p)
        order = order[kept] if kept.any() else order[:1]
    logp = np.log(softmax(x[order] / s.temperature))
    found = np.nonzero(order == chosen)[0]
    chosen_lp = float(logp[found[0]]) if found.size else -math.inf
    k = min(n, order.size)
    return chosen_lp, [(int(order[i]), float(logp[i])) for i in range(k)]
