"""A child process that answers one chat turn per request line, the way the server runs it.

Used by tests/test_quantized.py so that a kernel that faults (a SIGSEGV in a repacked or
AMX matmul, a GGML_ASSERT at context creation) ends this child and fails one test, never
the test run. One JSON request a line on stdin: ``{"path", "values", "messages",
"max_tokens"}``; one JSON answer a line on stdout: the greedy tokens, the sha256 of the
last logits row's bytes (bit-for-bit comparison without shipping the row), whether every
logit is finite, the prompt's token count, the kernel choice and, when streamed, the
streamer's summary and read bytes. A Python error is an answer with ``error``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import traceback
from typing import Any

import numpy as np

from bmoe.engine import kernels
from bmoe.engine.experts import streamer_factory
from bmoe.engine.session import Session
from bmoe.engine.turn import TurnRequest, prepare, run_turn


def answer(request: dict[str, Any]) -> dict[str, Any]:
    session = Session(request["path"], request["values"], streamer_factory)
    try:
        req = TurnRequest(messages=request["messages"], max_tokens=request["max_tokens"],
                          think=False)
        result = run_turn(session, prepare(session, req), req, threading.Event(),
                          lambda _ev, _rec: None)
        row = np.asarray(session.logits_row(), dtype=np.float32)
        out: dict[str, Any] = {
            "tokens": list(result.generation.tokens),
            "logits_sha256": hashlib.sha256(row.tobytes()).hexdigest(),
            "finite": bool(np.isfinite(row).all()),
            "n_prompt": int(result.summary["n_prompt"]),
            "arch": session.arch,
            "kernels": session.kernels.to_json(),
            "streamed": session.streamer is not None,
        }
        streamer: Any = session.streamer
        if streamer is not None:
            out["summary"] = streamer.summary()
            out["read_bytes"] = int(streamer.stats()["read_bytes"])
        return out
    finally:
        session.close()


def main() -> int:
    hello = {"hello": True, "registered": list(kernels.registered_extra_bufts())}
    sys.stdout.write(json.dumps(hello) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception as e:  # noqa: BLE001 - the test reads the error, not a trace
            reply = {"error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc(limit=4)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
