"""A child process that compiles grammars with the real llama.cpp and samples with them.

Run as ``python tests/grammar_worker.py MODEL.gguf``: it loads the model's vocabulary
only, then reads one JSON object per line on stdin::

    {"grammar": "<GBNF>", "triggers": [token ids] | null, "steps": N}

and for each builds llama.cpp's grammar sampler (lazy when triggers are given), then
runs N sampling steps over the whole vocabulary with random logits (apply, pick the best
allowed token, accept it), on a thread with the engine thread's stack size, and writes
one JSON line back: ``{"built": bool, "steps": k, "ms": float}``. A grammar that crashes
llama.cpp kills this process, not the test runner: the parent sees the stream end and
the exit signal.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import llama_cpp as lc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bmoe.engine.thread import ENGINE_STACK_BYTES  # noqa: E402


def _silence() -> None:
    @lc.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        pass
    _silence.keep = _log  # type: ignore[attr-defined]
    lc.llama_log_set(_log, ctypes.c_void_p(0))


def _load_vocab(path: str) -> tuple[object, object, int]:
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise SystemExit(f"cannot load {path}")
    vocab = lc.llama_model_get_vocab(model)
    return model, vocab, lc.llama_vocab_n_tokens(vocab)


def _single_token(vocab: object, text: bytes) -> int | None:
    buf = (lc.llama_token * 8)()
    n = lc.llama_tokenize(vocab, text, len(text), buf, 8, False, True)
    return buf[0] if n == 1 else None


def _run_one(vocab: object, n_vocab: int, job: dict, rng: random.Random) -> dict:
    text = job["grammar"].encode()
    triggers = job.get("triggers")
    t0 = time.perf_counter()
    if triggers:
        toks = (lc.llama_token * len(triggers))(*triggers)
        smpl = lc.llama_sampler_init_grammar_lazy_patterns(
            vocab, text, b"root", None, 0, toks, len(triggers))
    else:
        smpl = lc.llama_sampler_init_grammar(vocab, text, b"root")
    if not smpl:
        return {"built": False, "steps": 0, "ms": (time.perf_counter() - t0) * 1e3}
    data = (lc.llama_token_data * n_vocab)()
    steps = 0
    try:
        for _ in range(int(job.get("steps", 1))):
            for i in range(n_vocab):
                data[i].id, data[i].logit, data[i].p = i, rng.uniform(-4, 4), 0.0
            arr = lc.llama_token_data_array(data, n_vocab, -1, False)
            lc.llama_sampler_apply(smpl, ctypes.byref(arr))
            allowed = [data[i] for i in range(arr.size) if data[i].logit != float("-inf")]
            if not allowed:
                break
            tok = max(allowed, key=lambda d: d.logit).id
            lc.llama_sampler_accept(smpl, tok)
            steps += 1
    finally:
        lc.llama_sampler_free(smpl)
    return {"built": True, "steps": steps, "ms": (time.perf_counter() - t0) * 1e3}


def main() -> None:
    _silence()
    _model, vocab, n_vocab = _load_vocab(sys.argv[1])
    rng = random.Random(0)
    out: dict = {}

    def work(job: dict) -> None:
        out["result"] = _run_one(vocab, n_vocab, job, rng)

    # The engine thread's stack, unless a measurement asks for another (0: the default).
    threading.stack_size(int(os.environ.get("BMOE_WORKER_STACK", ENGINE_STACK_BYTES)))
    call_open = _single_token(vocab, b"<tool_call>")
    print(json.dumps({"ready": True, "n_vocab": n_vocab, "call_open": call_open}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t = threading.Thread(target=work, args=(job,))
        t.start()
        t.join()
        print(json.dumps(out.pop("result")), flush=True)


if __name__ == "__main__":
    main()
