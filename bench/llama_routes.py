"""Time llama-server's routes beside the chat route on a running bmoe-server.

Usage: python bench/llama_routes.py http://127.0.0.1:PORT
(start the server with: bmoe-server --port 0 --threads 1 -m MODEL -c 2048 --metrics).
Each line: twenty requests of 32 tokens each, after one warm-up request.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

PROMPT = "Once upon a time"
TOKENS = 32
RUNS = 20


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def run(url: str, name: str, path: str, body: dict[str, Any]) -> None:
    post(url, path, body)
    t0 = time.monotonic()
    toks = 0
    for _ in range(RUNS):
        out = post(url, path, body)
        toks += out.get("tokens_predicted") or out.get("usage", {}).get("completion_tokens", 0)
    dt = time.monotonic() - t0
    print(f"{name:44s} {RUNS} requests, {toks} tokens, {dt / RUNS * 1000:7.1f} ms/request, "
          f"{toks / dt:6.1f} tok/s")


def main(url: str) -> None:
    url = url.rstrip("/")
    greedy = {"prompt": PROMPT, "n_predict": TOKENS, "temperature": 0, "ignore_eos": True}
    run(url, f"/completion n_predict {TOKENS}", "/completion", greedy)
    run(url, f"/completion n_predict {TOKENS}, n_probs 10", "/completion",
        {**greedy, "n_probs": 10})
    run(url, f"/completion n_predict {TOKENS}, sampled+penalties", "/completion",
        {"prompt": PROMPT, "n_predict": TOKENS, "ignore_eos": True, "repeat_penalty": 1.1,
         "seed": 1})
    run(url, f"/v1/completions max_tokens {TOKENS}", "/v1/completions",
        {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    run(url, f"/v1/chat/completions max_tokens {TOKENS}", "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS})


if __name__ == "__main__":
    main(sys.argv[1])
