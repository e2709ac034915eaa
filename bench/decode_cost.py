"""Request validation cost: each protocol's `decode` (body → turn, every field checked)
on the real clients' captured first requests.

    python bench/decode_cost.py [--runs 200]

The bodies are the captured requests in `tests/fixtures/clients/` (Claude Code on
`/v1/messages`, Codex on `/v1/responses`, opencode on `/v1/chat/completions`: the
whole system prompt and tool list of each). Each is decoded `--runs` times after one
warm-up; the median microseconds per request is printed, with the body's size. No model
is needed: `decode` is sans-I/O (the images' base64 is read later, in a worker thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bmoe.server.protocols import anthropic, openai_chat, responses  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "clients"
DECODERS = {"/v1/messages": anthropic.decode, "/v1/responses": responses.decode,
            "/v1/chat/completions": openai_chat.decode}


class Config:
    values: dict[str, Any] = {"n-predict": 0, "think": True}
    user_keys: list[str] = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    for path in sorted(FIXTURES.glob("*.json")):
        fixture = json.loads(path.read_text())
        body, decode = fixture["body"], DECODERS[fixture["route"]]
        size = len(json.dumps(body).encode())
        decode(body, Config())
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            decode(body, Config())
            times.append(time.perf_counter() - t0)
        print(f"{path.stem:24s} {fixture['route']:22s} {size / 1024:6.0f} KiB  "
              f"{statistics.median(times) * 1e6:8.0f} µs per request (median of {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
