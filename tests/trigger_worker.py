"""A child process that runs a family's lazy call grammar in the real llama.cpp sampler.

Run as ``python tests/trigger_worker.py VOCAB.gguf``: it loads the vocabulary only, then
reads one JSON object per line on stdin::

    {"framing": "...", "tools": [...], "text": "what the model writes", "bare_words": bool}

and for each builds the turn's lazy grammar and its triggers as the engine does
(`turn._lazy_call_grammar`, `triggers.resolve` with this vocabulary, the sampler by
`session.grammar_sampler`), tokenizes the text (special tokens parsed) and hands the
tokens to the sampler one by one as if the model had written them. After each token it
asks the sampler which tokens it still allows (the whole vocabulary, equal logits): while
the grammar waits for its trigger it allows all; once it holds, a token it refuses ends
the text (the model could not have sampled it). ``bare_words`` makes each marker's
pattern the bare word (what the engine must not do). It writes back::

    {"tokens": [trigger ids], "patterns": [...], "pieces": [...], "piece_bytes": [...],
     "held_from": index of the first token after which the grammar held, or null,
     "refused_at": index of the first token the holding grammar refused, or null,
     "eog_allowed": whether the end of generation is allowed after the last token}

A grammar handed text it refuses aborts llama.cpp: then this process dies, and the parent
sees the stream end.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp as lc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bmoe.engine.session import grammar_sampler  # noqa: E402
from bmoe.engine.triggers import escape, resolve  # noqa: E402
from bmoe.engine.turn import _lazy_call_grammar  # noqa: E402


def _silence() -> None:
    @lc.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        pass
    _silence.keep = _log  # type: ignore[attr-defined]
    lc.llama_log_set(_log, ctypes.c_void_p(0))


def tokenize(vocab: object, text: str) -> list[int]:
    data = text.encode()
    cap = len(data) + 8
    buf = (lc.llama_token * cap)()
    n = lc.llama_tokenize(vocab, data, len(data), buf, cap, False, True)
    return list(buf[:n])


def piece_bytes(vocab: object, token: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    return buf.raw[:max(n, 0)]


def piece(vocab: object, token: int) -> str:
    return piece_bytes(vocab, token).decode("utf-8", "replace")


def run(vocab: object, n_vocab: int, job: dict) -> dict:
    lazy = _lazy_call_grammar(job["framing"], job["tools"])
    assert lazy is not None
    found = resolve(lazy.triggers, lazy.heads, lambda w: tokenize(vocab, w),
                    lambda t: piece(vocab, t))
    if job.get("bare_words"):       # the bare word as the pattern, whatever follows it
        found.patterns = [f"({escape(w)})" for w in lazy.triggers]
    ids = tokenize(vocab, job["text"])
    out = {"tokens": found.tokens, "patterns": found.patterns,
           "pieces": [piece(vocab, t) for t in ids],
           "piece_bytes": [len(piece_bytes(vocab, t)) for t in ids],
           "held_from": None, "refused_at": None,
           "eog_allowed": True}
    if not found:
        return out
    smpl = grammar_sampler(vocab, lazy.text, found.tokens, found.patterns)
    data = (lc.llama_token_data * n_vocab)()
    view = np.frombuffer(data, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    eog = [t for t in range(n_vocab) if lc.llama_vocab_is_eog(vocab, t)]
    allowed = None
    try:
        for i, tok in enumerate(ids):
            if allowed is not None and tok not in set(allowed.tolist()):
                out["refused_at"] = i           # the grammar holds and would not sample it
                break
            lc.llama_sampler_accept(smpl, tok)
            view["id"], view["logit"], view["p"] = np.arange(n_vocab), 0.0, 0.0
            arr = lc.llama_token_data_array(data, n_vocab, -1, False)
            lc.llama_sampler_apply(smpl, ctypes.byref(arr))
            allowed = view["id"][np.isfinite(view["logit"])]
            if len(allowed) == n_vocab:
                allowed = None                   # still waiting for its trigger
            elif out["held_from"] is None:
                out["held_from"] = i
            out["eog_allowed"] = allowed is None or bool(np.isin(eog, allowed).any())
    finally:
        lc.llama_sampler_free(smpl)
    return out


def main() -> None:
    _silence()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(sys.argv[1].encode(), params)
    if not model:
        raise SystemExit(f"cannot load {sys.argv[1]}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    print(json.dumps({"ready": True, "n_vocab": n_vocab}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(vocab, n_vocab, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
