"""Embeddings and reranking scores: what a context made with `--embedding` computes.

Theory of operation
-------------------
With the `embedding` parameter the session's context is made with llama.cpp's
embeddings on and the pooling the `pooling` parameter names (or the model's own:
`bert.pooling_type`, mean / cls / last / rank). `embed` decodes each prompt alone, as one
sequence, and reads its vector back: the pooled one (`llama_get_embeddings_seq`), or one
per token when the pooling is none (`llama_get_embeddings_ith`). A pooled vector is
normalised as llama-server does (`normalize`: 2 Euclidean, the default; -1 none; 0
max-absolute to the int16 range; 1 taxicab; p > 2 a p-norm); per-token vectors never are.
With rank pooling (a reranker: the classifier head) the "vector" is the head's output
and its first value the score.

Bounds, checked here before llama.cpp sees them (llama.cpp aborts the process on them):
every id is a token of the vocabulary; no prompt is empty; a prompt fits the context;
and it fits one micro-batch unless the model keeps a KV cache and pools the last token
(an encoder, BERT, has no cache and computes its whole input in one micro-batch:
`encoder requires n_ubatch >= n_tokens` is an assertion in llama.cpp).

Runs on the engine thread, between turns; the KV is cleared for each prompt (an
embedding leaves nothing to reuse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

from .errors import EngineError
from .sampling import check_tokens

POOLING_NAMES = {lc.LLAMA_POOLING_TYPE_NONE: "none", lc.LLAMA_POOLING_TYPE_MEAN: "mean",
                 lc.LLAMA_POOLING_TYPE_CLS: "cls", lc.LLAMA_POOLING_TYPE_LAST: "last",
                 lc.LLAMA_POOLING_TYPE_RANK: "rank"}
POOLING_TYPES = {name: value for value, name in POOLING_NAMES.items()}
MAX_PROMPTS = 2048          # inputs in one request


@dataclass(frozen=True)
class Embedded:
    """One prompt's result: its vectors (one pooled, or one per token) and its size."""

    vectors: list[list[float]]
    n_tokens: int


def pooling(session: Any) -> str:
    """The context's pooling, by name (`none` without an embedding context)."""
    if not getattr(session, "embeddings", False) or not session.ctx:
        return "none"
    return POOLING_NAMES.get(lc.llama_pooling_type(session.ctx), "none")


def context_pooling(values: dict[str, Any]) -> int:
    """The `pooling_type` a context is made with: the setting's, or the model's own."""
    name = str(values.get("pooling") or "auto")
    return POOLING_TYPES.get(name, lc.LLAMA_POOLING_TYPE_UNSPECIFIED)


def normalized(vector: list[float], norm: int) -> list[float]:
    """llama-server's `embd_normalize` of one vector."""
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = max((abs(x) for x in vector), default=0.0) / 32760.0
    elif norm == 2:
        total = math.sqrt(math.fsum(x * x for x in vector))
    else:
        total = math.fsum(abs(x) ** norm for x in vector) ** (1.0 / norm)
    scale = 1.0 / total if total > 0 else 0.0
    return [x * scale for x in vector]


def _fits(session: Any, n: int) -> None:
    splits = bool(session.memory) and pooling(session) == "last"
    if n > session.n_ubatch and not splits:
        raise EngineError("invalid_request",
                          f"input ({n} tokens) is too large to process. increase the "
                          f"physical batch size (current batch size: {session.n_ubatch}): "
                          "start the "
                          "server with a larger -ub (and -b).")
    if n > session.n_ctx:
        raise EngineError("context_full",
                          f"The input is {n} tokens and the context ({{ctx-size}}) holds "
                          f"{session.n_ctx}: shorten it or raise {{ctx-size}}.",
                          param="ctx-size", n_prompt=n, n_ctx=session.n_ctx)


def _decode(session: Any, tokens: list[int]) -> None:
    b = session._batch
    for start in range(0, len(tokens), session.n_batch):
        chunk = tokens[start:start + session.n_batch]
        for i, tok in enumerate(chunk):
            b.token[i] = tok
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        b.n_tokens = len(chunk)
        rc = lc.llama_decode(session.ctx, b)
        if session.streamer is not None:
            message = session.streamer.failure()
            if message:
                raise EngineError("failed", message)
        if rc != 0:
            raise EngineError("failed", f"llama.cpp could not compute this input's "
                              f"embedding (llama_decode returned {rc}).")


def _vectors(session: Any, n_tokens: int, norm: int) -> list[list[float]]:
    kind = lc.llama_pooling_type(session.ctx)
    if kind == lc.LLAMA_POOLING_TYPE_RANK:
        width = max(1, lc.llama_model_n_cls_out(session.model))
    else:
        width = lc.llama_model_n_embd_out(session.model)
    if kind == lc.LLAMA_POOLING_TYPE_NONE:
        out = []
        for i in range(n_tokens):
            ptr = lc.llama_get_embeddings_ith(session.ctx, i)
            if not ptr:
                raise EngineError("failed", "llama.cpp returned no embedding for a token.")
            out.append([float(x) for x in ptr[:width]])
        return out
    ptr = lc.llama_get_embeddings_seq(session.ctx, 0)
    if not ptr:
        raise EngineError("failed", "llama.cpp returned no pooled embedding.")
    vector = [float(x) for x in ptr[:width]]
    return [vector if kind == lc.LLAMA_POOLING_TYPE_RANK else normalized(vector, norm)]


def embed(session: Any, prompts: list[list[int]], normalize: int = 2) -> list[Embedded]:
    """Each prompt's embedding (see the module's text); raises EngineError on bad input."""
    if not getattr(session, "embeddings", False):
        raise EngineError("not_supported", "This server does not compute embeddings: start "
                          "it with --embedding (for an embedding model).")
    if not prompts:
        raise EngineError("invalid_request", '"input" must not be empty.')
    if len(prompts) > MAX_PROMPTS:
        raise EngineError("invalid_request", f"At most {MAX_PROMPTS} inputs fit one request.")
    for tokens in prompts:
        if not tokens:
            raise EngineError("invalid_request", "Input content cannot be empty: give text "
                              "or token ids.")
        check_tokens(tokens, session.n_vocab, "input")
        _fits(session, len(tokens))
    session._check_usable()
    results = []
    if session.streamer is not None:
        session.streamer.prefill_begin()
    try:
        for tokens in prompts:
            session.clear_kv()
            _decode(session, tokens)
            results.append(Embedded(_vectors(session, len(tokens), normalize), len(tokens)))
    finally:
        if session.streamer is not None:
            session.streamer.prefill_end()
        session.clear_kv()
    return results
