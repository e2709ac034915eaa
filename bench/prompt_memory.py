"""A prompt's peak memory under a memory cap: the engine's budget against the old one.

    sudo .venv/bin/python bench/prompt_memory.py --keep          # see docs/benchmarks.md

Writes the benchmark MoE of `stream_vs_mmap.py` (24 layers x 64 experts, top-4, F16,
4.65 GiB; `--layers 12` for the 2.33 GiB one), then for every memory cap (`--caps`, in
percent of the file's size), front end (`--modes`) and prompt size (`--prompts`, tokens)
starts one fresh process in a fresh memory cgroup of that limit (v1 or v2,
`bmoe.machine.cgroup.MemoryCap`), with the page cache dropped first, loads the model,
sends one prompt and asks for `--n-predict` tokens, and reads from the kernel the
group's peak (`memory.max_usage_in_bytes` / `memory.peak`) and its OOM kills:

  cli-stream     bmoe-cli -m MODEL --session --moe-stream           (cache-mb 0, the CLI's)
  cli-auto       ... --cache-mb auto --cache-floor-mb 0             (the cache takes all)
  cli-mmap       bmoe-cli -m MODEL --session                        (llama.cpp on mmap)
  server-stream  bmoe-server --no-auto -m MODEL                     (cache-mb auto)
  server-plan    bmoe-server --auto -m MODEL                        (the planner decides)
  server-mmap    bmoe-server --no-auto --no-moe-stream -m MODEL

The CLI's prompt is text (the chat template adds its few tokens; `n_prompt` is what
llama.cpp decoded), the server's a list of token ids sent to `/completion`. The engine
measured is the git revision `--engine` (default HEAD, extracted to a temporary folder:
others' uncommitted edits in a shared tree do not leak in); each streamed mode runs a
second time with the engine as it was at `--baseline` ("" skips it), in the same run,
where a baseline OOM-killed by a prompt skips the larger ones (`skipped`). A run ends
`answered`, `refused` (the load or the prompt said why, before any OOM), `killed`
(the kernel's OOM killer) or `failed`/`timeout`.

Needs root (cgroups, drop_caches). Deletes the model file at the end unless --keep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import MIB, drop_caches  # noqa: E402
from stream_vs_mmap import TEXT, add_model_args, make_bench_model  # noqa: E402

from bmoe.machine.cgroup import MemoryCap  # noqa: E402

BASELINE = "5b41990"        # the engine before the prompt budget (issue 29, part 2)
MODES = {
    "cli-stream": ("cli", ["--moe-stream"]),
    "cli-auto": ("cli", ["--moe-stream", "--cache-mb", "auto", "--cache-floor-mb", "0"]),
    "cli-mmap": ("cli", []),
    "server-stream": ("server", ["--no-auto"]),
    "server-plan": ("server", ["--auto"]),
    "server-mmap": ("server", ["--no-auto", "--no-moe-stream"]),
}
STREAMED = ("cli-stream", "cli-auto", "server-stream", "server-plan")


# -- prompts -------------------------------------------------------------------------------

def prompt_tokens(model: Path, n: int) -> list[int]:
    """`n` token ids of real text (the benchmark text repeated), by the model's tokenizer."""
    import llama_cpp as lc
    from bmoe.engine import backend
    backend.start()             # llama.cpp's logs routed (errors only), the backend up
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    m = lc.llama_model_load_from_file(str(model).encode(), mp)
    try:
        vocab = lc.llama_model_get_vocab(m)
        data = (TEXT + "\n") * (n // 100 + 2)
        raw = data.encode()
        buf = (lc.llama_token * (len(raw) + 8))()
        k = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        assert k >= n, (k, n)
        return list(buf[:n])
    finally:
        lc.llama_model_free(m)


def prompt_text(model: Path, n: int) -> str:
    """Text of about `n` tokens (the CLI renders it through the chat template)."""
    import llama_cpp as lc
    ids = prompt_tokens(model, max(1, n - 12))
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    m = lc.llama_model_load_from_file(str(model).encode(), mp)
    try:
        vocab = lc.llama_model_get_vocab(m)
        out = bytearray()
        for t in ids:
            b = (ctypes.c_char * 64)()
            k = lc.llama_token_to_piece(vocab, t, b, 64, 0, False)
            out += b.raw[:k]
        return out.decode("utf-8", "replace")
    finally:
        lc.llama_model_free(m)


# -- one run -------------------------------------------------------------------------------

class Tree:
    """Where a run's bmoe comes from: a revision extracted from git, or this work tree."""

    def __init__(self, rev: str, label: str) -> None:
        self.rev = rev
        self.label = label
        self.dir: Path | None = None
        if rev:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                                 check=True, capture_output=True, text=True).stdout.strip()
            self.rev = rev
            self.dir = Path(tempfile.mkdtemp(prefix="bmoe-baseline-"))
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "bmoe"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(self.dir)], input=archive, check=True)
            for so in (ROOT / "bmoe" / "native").glob("*.so"):   # the built extensions
                shutil.copy(so, self.dir / "bmoe" / "native" / so.name)

    @property
    def name(self) -> str:
        return f"{self.label} {self.rev or 'tree'}"

    @property
    def is_baseline(self) -> bool:
        return self.label == "baseline"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", BMOE_LLAMA_LOG="0")
        if self.dir is not None:
            env["PYTHONPATH"] = str(self.dir)
        return env

    def cwd(self) -> str:
        return str(self.dir) if self.dir is not None else tempfile.gettempdir()

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def run_cli(cap: MemoryCap, tree: Tree, model: Path, flags: list[str], text: str,
            args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bmoe.cli", "-m", str(model), "--session", "-c",
           str(args.ctx_size), "-t", str(args.threads), *flags]
    proc = cap.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, env=tree.env(), cwd=tree.cwd())
    assert proc.stdin is not None
    req = {"cmd": "generate", "id": 1, "prompt": text, "n_predict": args.n_predict,
           "think": False}
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(json.dumps(req) + "\n" + json.dumps({"cmd": "close"})
                                    + "\n", timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"outcome": "timeout", "s": time.monotonic() - t0}
    res: dict[str, Any] = {"s": time.monotonic() - t0, "rc": proc.returncode}
    for line in out.splitlines():
        tag, _, body = line.partition(" ")
        if tag == "BMOE_DONE":
            done = json.loads(body)
            res.update(outcome="answered", n_prompt=done["n_prompt"],
                       prefill_s=done["prefill_s"], cache_mib=done.get("cache_budget_mib"))
        elif tag == "BMOE_ERROR" and "outcome" not in res:
            res.update(outcome="refused", why=json.loads(body)["msg"])
    if "outcome" not in res:
        res.update(outcome="failed", why=err.strip()[-400:])
    return res


def run_server(cap: MemoryCap, tree: Tree, model: Path, flags: list[str], ids: list[int],
               args: argparse.Namespace) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="bmoe-pm-data-"))
    cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
           "--threads", str(args.threads), "--ctx-size", str(args.ctx_size), "--model", str(model),
           *flags]
    proc = cap.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                     env=tree.env(), cwd=tree.cwd())
    t0 = time.monotonic()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.wait(30)
            return {"outcome": "failed", "why": f"no server: {line!r}", "rc": proc.returncode}
        url = line.split("listening on", 1)[1].strip().rstrip("/")
        state = _wait_loaded(url, proc, t0 + args.run_timeout)
        if state.get("state") != "ready":
            if proc.poll() is not None:
                return {"outcome": "failed", "rc": proc.returncode, "why": "died loading"}
            return {"outcome": "refused", "why": str(state.get("error", state))[:600]}
        body = {"prompt": ids, "n_predict": args.n_predict, "temperature": 0,
                "cache_prompt": False}
        status, reply = _post(url + "/completion", body, args.run_timeout)
        res: dict[str, Any] = {"s": time.monotonic() - t0, "status": status}
        if status == 200 and isinstance(reply, dict):
            timings = reply.get("timings", {})
            res.update(outcome="answered", n_prompt=timings.get("prompt_n"),
                       prefill_s=round(timings.get("prompt_ms", 0.0) / 1000.0, 3))
        elif status is None:
            res.update(outcome="failed", why=str(reply)[:300])
        else:
            res.update(outcome="refused", why=json.dumps(reply)[:600])
        return res
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(data, ignore_errors=True)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: Any, timeout: float) -> tuple[int | None, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        payload = e.read()
        try:
            return e.code, json.loads(payload)
        except ValueError:
            return e.code, payload.decode(errors="replace")
    except (OSError, ValueError) as e:         # the server died (OOM-killed) mid-request
        return None, repr(e)


def _wait_loaded(url: str, proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            info = _get(url + "/api/info")
        except (OSError, ValueError):
            info = {}
        if info.get("state") in ("ready", "error"):
            return info
        time.sleep(0.2)
    return {"state": "gone" if proc.poll() is not None else "timeout"}


def run_one(mode: str, frac: float, n: int, tree: Tree, model: Path, prompts: dict[str, Any],
            args: argparse.Namespace) -> dict[str, Any]:
    kind, flags = MODES[mode]
    limit = int(model.stat().st_size * frac)
    cap = MemoryCap(f"bmoe-pm-{os.getpid()}", limit)
    try:
        drop_caches()
        if kind == "cli":
            res = run_cli(cap, tree, model, flags, prompts["text"][n], args)
        else:
            res = run_server(cap, tree, model, flags, prompts["ids"][n], args)
        kills = cap.oom_kills()
        if kills:
            res["outcome"] = "killed"
        peak = cap.peak()
        res.update(mode=mode, cap_pct=round(frac * 100), prompt=n, engine=tree.name,
                   cap_mib=round(limit / MIB), cap_bytes=limit, peak_mib=round(peak / MIB, 1),
                   peak_bytes=peak, oom_kills=kills)
        return res
    finally:
        cap.remove()


def skipped(mode: str, frac: float, n: int, tree: Tree, model: Path,
            killed_at: int) -> dict[str, Any]:
    """A baseline run not made: the same engine was OOM-killed by a smaller prompt (a
    larger one routes to at least as many experts) — saves the run's minutes."""
    limit = int(model.stat().st_size * frac)
    return {"mode": mode, "cap_pct": round(frac * 100), "prompt": n, "engine": tree.name,
            "cap_mib": round(limit / MIB), "cap_bytes": limit, "peak_mib": 0.0,
            "peak_bytes": 0, "oom_kills": 0, "outcome": "skipped",
            "why": f"killed at {killed_at} tokens"}


# -- the parent ----------------------------------------------------------------------------

def line_of(r: dict[str, Any]) -> str:
    why = f"  {r['why'][:150]}" if r.get("why") and r["outcome"] != "answered" else ""
    n = r.get("n_prompt")
    return (f"{r['mode']:13s} {r['engine']:17s} cap {r['cap_pct']:3d} % ({r['cap_mib']:5d} MiB) "
            f"prompt {r['prompt']:5d} ({n if n is not None else '-':>5}) "
            f"peak {r['peak_mib']:7.1f} MiB  oom {r['oom_kills']}  {r['outcome']:8s} "
            f"{r.get('s', 0):6.1f} s{why}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--caps", default="25,40,60", help="memory caps, %% of the file size")
    p.add_argument("--prompts", default="1,512,2048,8000", help="prompt sizes, tokens")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--engine", default="HEAD",
                   help="git revision of the engine measured (default HEAD: what is committed, "
                        "whatever others edit in the tree meanwhile; '' for the work tree)")
    p.add_argument("--baseline", default=BASELINE,
                   help=f"git revision of the old engine (default {BASELINE}; '' skips it)")
    p.add_argument("--ctx-size", type=int, default=8448, help="holds 8,000 tokens and the answer")
    p.add_argument("--n-predict", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the model file")
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    model = make_bench_model(args)
    sizes = [int(x) for x in args.prompts.split(",")]
    prompts = {"ids": {n: prompt_tokens(model, n) for n in sizes},
               "text": {n: prompt_text(model, n) for n in sizes}}
    trees = [Tree(args.engine, "engine")] + (
        [Tree(args.baseline, "baseline")] if args.baseline else [])
    results: list[dict[str, Any]] = []
    try:
        for frac in (int(c) / 100 for c in args.caps.split(",")):
            for mode in args.modes.split(","):
                for tree in trees:
                    if tree.is_baseline and mode not in STREAMED:
                        continue          # plain mmap: the budget is not involved
                    killed_at = 0
                    for n in sizes:
                        if killed_at and tree.is_baseline:
                            r = skipped(mode, frac, n, tree, model, killed_at)
                        else:
                            r = run_one(mode, frac, n, tree, model, prompts, args)
                            killed_at = killed_at or (n if r["outcome"] == "killed" else 0)
                        results.append(r)
                        print(line_of(r), flush=True)
                        if args.json:
                            Path(args.json).write_text(json.dumps(results, indent=1))
        report(results)
    finally:
        for tree in trees:
            tree.close()
        if not args.keep:
            model.unlink(missing_ok=True)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


def report(results: list[dict[str, Any]]) -> None:
    """Per engine: outcomes, OOM kills, and runs whose peak went over the cap (the kernel
    keeps a group at its limit, so that count is 0 unless the accounting is off)."""
    print("\nengine            runs  answered  refused  killed  skipped  other  oom kills  "
          "peak > cap")
    for engine in dict.fromkeys(r["engine"] for r in results):
        rs = [r for r in results if r["engine"] == engine]
        kinds = ("answered", "refused", "killed", "skipped")
        count = {k: sum(r["outcome"] == k for r in rs) for k in kinds}
        over = sum(r["peak_bytes"] > r["cap_bytes"] for r in rs)
        kills = sum(r["oom_kills"] for r in rs)
        other = len(rs) - sum(count.values())
        print(f"{engine:17s} {len(rs):4d}  {count['answered']:8d}  {count['refused']:7d}  "
              f"{count['killed']:6d}  {count['skipped']:7d}  {other:5d}  {kills:9d}  "
              f"{over:10d}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
