"""Tokens/s of the tiny MoE: a bare llama-cpp-python loop vs bmoe's engine vs bmoe-server.

    python bench/serve_vs_bare.py [--tokens 2000] [--runs 3]
    python bench/serve_vs_bare.py --model M.gguf --tokens 200 --warmup 300 --no-python

`--model` measures another model than the tiny MoE (for instance the 12-layer benchmark
MoE of bench/plan_accuracy.py, 2.33 GiB, which fits this machine's memory); `--warmup N`
first answers N tokens in the same session (engine and server alike), so the measured
answer starts with the caches as a long session has them; `--no-python` skips the Python
graph callback's runs (slow on a large model).

Baseline (measured in the same run): a bare greedy loop over llama-cpp-python's
low-level API (sample, decode one token, repeat) with the same model, context and
threads. Then bmoe's Session (the engine loop the server runs, with its per-token
telemetry), and a streamed `/v1/chat/completions` through a real bmoe-server
(client-side: tokens ÷ time from the first to the last content chunk), with expert
streaming off (same weights path as the baseline) and on (the server's default for a
MoE file: the graph callback and the expert cache run for every token), the latter with
the native graph callback (the default) and with the Python one (BMOE_EVAL_CALLBACK=python
in the server's environment). BENCH_THREADS=N sets the compute threads (default 2).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp as lc  # noqa: E402

from bmoe.engine import kernels  # noqa: E402
from bmoe.modelmaker import make_model  # noqa: E402
from bmoe.engine.experts import streamer_factory  # noqa: E402
from bmoe.engine.session import Session  # noqa: E402
from bmoe.engine.turn import TurnRequest, prepare, run_turn  # noqa: E402

PROMPT = "Tell me a long story about the sea."
WARMUP_PROMPT = "Describe the mountains in winter."
THREADS = int(os.environ.get("BENCH_THREADS", "2"))
N_CTX = 4096


def bare_loop(model_path: Path, prompt_tokens: list[int], n: int) -> float:
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = kernels.choose("auto").extra_bufts   # the kernels bmoe runs here
    model = lc.llama_model_load_from_file(str(model_path).encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = N_CTX, 512, 512
    cp.n_threads = cp.n_threads_batch = THREADS
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_model_get_vocab(model)
    smpl = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(smpl, lc.llama_sampler_init_greedy())
    arr = (lc.llama_token * len(prompt_tokens))(*prompt_tokens)
    lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(prompt_tokens)))
    one = (lc.llama_token * 1)()
    t0 = time.perf_counter()
    count = 0
    for _ in range(n):
        tok = lc.llama_sampler_sample(smpl, ctx, -1)
        if lc.llama_vocab_is_eog(vocab, tok):
            break
        one[0] = tok
        lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1))
        count += 1
    dt = time.perf_counter() - t0
    lc.llama_sampler_free(smpl)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return count / dt


def engine_loop(model_path: Path, n: int, *, moe_stream: bool = False,
                python_callback: bool = False, warmup: int = 0) -> tuple[float, list[int]]:
    values: dict[str, object] = {"ctx-size": N_CTX, "threads": THREADS}
    if moe_stream:      # the server's defaults for a MoE file: streaming, cache-mb auto
        values.update({"moe-stream": True, "cache-mb": "auto"})
    before = os.environ.pop("BMOE_EVAL_CALLBACK", None)
    if python_callback:
        os.environ["BMOE_EVAL_CALLBACK"] = "python"
    try:
        s = Session(model_path, values, streamer_factory)
    finally:
        os.environ.pop("BMOE_EVAL_CALLBACK", None)
        if before is not None:
            os.environ["BMOE_EVAL_CALLBACK"] = before
    try:
        if warmup:
            w = TurnRequest(messages=[{"role": "user", "content": WARMUP_PROMPT}],
                            max_tokens=warmup, think=False)
            run_turn(s, prepare(s, w), w, threading.Event(), lambda ev, rec: None)
        req = TurnRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=n,
                          think=False)
        p = prepare(s, req)
        r = run_turn(s, p, req, threading.Event(), lambda ev, rec: None)
        g = r.generation
        return len(g.tokens) / g.decode_s, p.tokens
    finally:
        s.close()


def server_stream(model_path: Path, n: int, *, moe_stream: bool,
                  python_callback: bool = False, warmup: int = 0) -> float:
    data = Path(tempfile.mkdtemp(prefix="bmoe-bench-"))
    env = dict(os.environ)
    env.pop("BMOE_EVAL_CALLBACK", None)
    if python_callback:
        env["BMOE_EVAL_CALLBACK"] = "python"
    proc = subprocess.Popen([sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
                             str(data), "-m", str(model_path), "-c", str(N_CTX), "--threads",
                             str(THREADS), "--moe-stream" if moe_stream else "--no-moe-stream"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split("listening on", 1)[1].strip().rstrip("/")
        host, port = url.split("//")[1].rsplit(":", 1)
        while True:
            c = http.client.HTTPConnection(host, int(port))
            c.request("GET", "/api/info")
            if json.loads(c.getresponse().read())["state"] == "ready":
                break
            time.sleep(0.05)
        c = http.client.HTTPConnection(host, int(port), timeout=600)
        if warmup:
            c.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                      body=json.dumps({"messages": [{"role": "user", "content": WARMUP_PROMPT}],
                                       "max_tokens": warmup,
                                       "chat_template_kwargs": {"enable_thinking": False}}))
            c.getresponse().read()
        body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
                           "stream": True, "chat_template_kwargs": {"enable_thinking": False}})
        c.request("POST", "/v1/chat/completions", body=body,
                  headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        first = last = 0.0
        tokens = 0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "bmoe" in chunk and "summary" in chunk["bmoe"]:
                tokens = chunk["bmoe"]["summary"]["tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
        return (tokens - 1) / (last - first) if last > first else 0.0
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", help="a GGUF MoE to measure instead of the tiny one")
    ap.add_argument("--warmup", type=int, default=0,
                    help="tokens answered first in the same session, not timed")
    ap.add_argument("--no-python", action="store_true",
                    help="skip the runs with the Python graph callback")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
        shape = f"{model.stat().st_size / 2**30:.2f} GiB"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bmoe-bench-model-"))
        model = make_model(tmp / "tiny-moe.gguf")  # 4 layers, 8 experts, top-2, 64 wide
        shape = "qwen3moe, 4 layers, 8 experts, top-2, 64 wide"
    w = args.warmup
    bare, eng, srv, srv_streamed, srv_python = [], [], [], [], []
    eng_native, eng_python = [], []
    for _ in range(args.runs):
        e, prompt_tokens = engine_loop(model, args.tokens, warmup=w)
        eng.append(e)
        eng_native.append(engine_loop(model, args.tokens, moe_stream=True, warmup=w)[0])
        if not args.no_python:
            eng_python.append(engine_loop(model, args.tokens, moe_stream=True,
                                          python_callback=True, warmup=w)[0])
        bare.append(bare_loop(model, prompt_tokens, args.tokens))
        srv.append(server_stream(model, args.tokens, moe_stream=False, warmup=w))
        srv_streamed.append(server_stream(model, args.tokens, moe_stream=True, warmup=w))
        if not args.no_python:
            srv_python.append(server_stream(model, args.tokens, moe_stream=True,
                                            python_callback=True, warmup=w))
    nan = [float("nan")]
    b, e, s, x, y = (statistics.median(v or nan)
                     for v in (bare, eng, srv, srv_streamed, srv_python))
    print(f"model: {model.name} ({shape}), {args.tokens} tokens after {w} of warm-up, "
          f"{THREADS} threads, median of {args.runs}")
    print(f"bare llama-cpp-python loop : {b:8.0f} tok/s   (baseline)")
    print(f"bmoe engine (Session)      : {e:8.0f} tok/s   ({e / b:.2f}x baseline)")
    en, ep = statistics.median(eng_native), statistics.median(eng_python or nan)
    print(f"  ... with expert streaming: {en:8.0f} tok/s   ({en / b:.2f}x baseline)  "
          f"native callback; {ep:.0f} tok/s ({ep / b:.2f}x) with the Python one")
    print(f"bmoe-server streamed chat  : {s:8.0f} tok/s   ({s / b:.2f}x baseline)  "
          "experts on llama.cpp's mapping (--no-moe-stream)")
    print(f"  ... with expert streaming: {x:8.0f} tok/s   ({x / b:.2f}x baseline)  "
          "the server's default for a MoE: every expert through the engine's cache")
    print(f"  ... Python graph callback : {y:8.0f} tok/s   ({y / b:.2f}x baseline)  "
          "the same with BMOE_EVAL_CALLBACK=python")
    print(f"streaming on / off in the server: native callback {x / s:.2f}x, "
          f"Python callback {y / s:.2f}x; in the engine: {en / e:.2f}x, {ep / e:.2f}x")
    print("per run (tok/s): off " + ", ".join(f"{v:.0f}" for v in srv)
          + "; native " + ", ".join(f"{v:.0f}" for v in srv_streamed)
          + "; python " + ", ".join(f"{v:.0f}" for v in srv_python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
