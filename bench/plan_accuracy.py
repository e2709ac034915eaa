"""Does the planner predict its own speed, and does it pick well? Under real memory caps.

    sudo .venv/bin/python bench/plan_accuracy.py          # about 7 minutes here, quiet

Writes the benchmark MoE of bench/stream_vs_mmap.py (qwen3moe, 64 experts, top-4, F16,
router skew and local context; `--layers` sets its size), then for each memory cap
(`--caps`, fractions of the file size; a cgroup-v1 child of this process's memory
cgroup, the page cache dropped before each run):

1. `plan`     — in a process inside the cap, the planner measures (compute, storage,
                memory) and plans with no routing record of this model; the same process
                then loads with the plan's values and teacher-forces `--tokens` tokens of
                English text, timed from the token the cache is full at (and not before
                `--warmup`): predicted s/token, a steady decode's, against the measured
                median. Its decoded tokens' routing is kept.
2. `plan+rec` — the same, now that the routing record exists (the hit rate: the record
                replayed through the engine's own cache and policy). No measured decode
                cost is fed back: the prediction is the cost model's alone.
3. `grid`     — hand-picked settings in the same cap: cache-mb of one token cycle, half
                the plan's and the plan's, at 1 and 2 compute threads.

Targets (issue 15): prediction within ±25 % of measured at every cap once a routing
record exists (±50 % without); the planned setting within 10 % of the grid's best.

Needs root (cgroups, drop_caches). Deletes the model file at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, MemoryCap, drop_caches  # noqa: E402

TEXT = (
    "The history of the city begins with a small village on the river, where fishermen "
    "and farmers traded grain, salt and wool. Over the centuries the village grew into a "
    "market town, then into a port, and at last into the capital of a large province. "
    "Its old streets still follow the paths of the first traders, and the names of many "
    "squares recall the goods that were once sold there. In the museum near the bridge you "
    "can see maps, coins and tools from every period, and a model of the harbour as it was "
    "two hundred years ago, when ships from distant countries brought tea, silk and spices. "
)


# -- the worker (inside the cap) ---------------------------------------------------------------

def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from bmoe.engine import params
    from bmoe.engine.experts import streamer_factory
    from bmoe.engine.session import Session

    values = {**params.defaults(server=True), "temp": 0, **spec["values"]}
    out: dict[str, Any] = {}
    if spec.get("plan"):
        from bmoe.planner.measure import measure
        t0 = time.monotonic()
        plan = measure(spec["model"], values, list(spec["values"]),
                       routing_dir=Path(spec["routing"]))
        body = plan.to_json()
        out["plan_s"] = time.monotonic() - t0
        out["plan"] = {k: body[k] for k in ("regime", "values", "predicted", "machine",
                                            "measurements")}
        out["plan"]["hit_source"] = next((d["source"] for d in body["decisions"]
                                          if d["knob"] == "hit-curve"), "")
        # the plan as it predicted: without the first answer's trial of another thread
        # count or overlap (bmoe/engine/calibrate.py), which changes them mid-run
        values.update({k: v for k, v in plan.values.items() if not k.startswith("trial-")})
    out["values"] = {k: values[k] for k in ("moe-stream", "cache-mb", "threads",
                                            "io-threads", "ctx-size")}
    s = Session(spec["model"], values, streamer_factory)
    st: Any = s.streamer
    if st is not None:
        st.record_routing = True
    tokens = s.tokenize(TEXT)[: spec["tokens"]]
    cancel = threading.Event()
    walls: list[float] = []
    waits: list[float] = []                   # per token: the reads waited for
    totals: list[tuple[float, int]] = []      # after each token: (read wait, bytes read)
    start = len(tokens)                       # the first timed token: warmed up, cache full
    for i in range(1, len(tokens) + 1):
        if st is not None:
            st.token_begin()
            io0 = st.stats()["io_s"]
        t = time.perf_counter()
        s.prefill(tokens[:i], cancel)        # the KV holds tokens[:i-1]: one decoded token
        walls.append(time.perf_counter() - t)
        full = True
        if st is not None:
            st.token_end()
            now = st.stats()
            waits.append(now["io_s"] - io0)
            totals.append((now["io_s"], now["read_bytes"]))
            full = now["resident_bytes"] >= 0.95 * now["budget_bytes"]
        if full and i >= spec["warmup"] and start == len(tokens):
            start = i
    out["walls"] = walls
    out["waits"] = waits
    out["timed_from"] = start
    if st is not None:
        out["hit_pct"] = st.summary()["cache_hit_pct"]
        n = max(1, len(tokens) - start)
        io0, b0 = totals[start - 1] if start else (0.0, 0)
        # per timed token: the reads waited for, and the rest (compute and callbacks)
        out["read_s"] = (totals[-1][0] - io0) / n
        out["read_mib"] = (totals[-1][1] - b0) / n / (1 << 20)
        out["timed_hit_pct"] = 100.0 * (1 - out["read_mib"] * (1 << 20) /
                                        max(1, facts_cycle(spec["model"])))
        timed = sum(walls[start:]) / n
        out["other_s"] = timed - out["read_s"]
        if spec.get("keep_routing"):
            from bmoe.planner.probes import model_facts
            from bmoe.planner.routing import append_record, record_path
            facts = model_facts(spec["model"])
            p = facts.probe
            append_record(record_path(Path(spec["routing"]), spec["model"], facts.size),
                          list(st.routing), model=facts.name, size=facts.size,
                          n_layer=p.n_moe_layer, n_expert=p.n_expert,
                          n_expert_used=p.n_expert_used)
    s.close()
    return out


def facts_cycle(model: str) -> int:
    from bmoe.planner.probes import model_facts
    return model_facts(model).probe.token_cycle_bytes


# -- the parent --------------------------------------------------------------------------------

def run(name: str, spec: dict[str, Any], cap: MemoryCap, args: argparse.Namespace) -> dict:
    drop_caches()
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    t0 = time.monotonic()
    try:
        proc = cap.run(cmd, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        print(f"  {name:14s} timed out after {args.run_timeout:.0f} s", flush=True)
        return {"failed": "timeout"}
    if proc.returncode != 0:
        why = f"rc {proc.returncode}, oom kills {cap.oom_kills()}"
        print(f"  {name:14s} failed ({why}): {proc.stderr.strip()[-300:]}", flush=True)
        return {"failed": why}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    w = res["walls"][res["timed_from"]:]
    res["median"] = statistics.median(w)
    res["elapsed_s"] = time.monotonic() - t0
    res["peak_mib"] = cap.peak() / MIB
    v = res["values"]
    line = (f"  {name:14s} cache {v['cache-mb']!s:>6} MiB  threads {v['threads']}  "
            f"median {res['median']:.4f} s/tok  hits {res.get('hit_pct', -1):5.1f} %  "
            f"peak {res['peak_mib']:.0f} MiB")
    if "read_s" in res:
        timed = list(zip(res["walls"][res["timed_from"]:], res["waits"][res["timed_from"]:],
                         strict=True))
        res["read_median_s"] = statistics.median(r for _, r in timed)
        res["rest_median_s"] = statistics.median(w - r for w, r in timed)
        line += (f"\n  {'':14s} timed from token {res['timed_from'] + 1} (cache full), "
                 f"hits there {res['timed_hit_pct']:.1f} %"
                 f"\n  {'':14s} per timed token: reads waited {res['read_s']:.4f} s "
                 f"({res['read_mib']:.1f} MiB), the rest {res['other_s']:.4f} s (mean); "
                 f"medians {res['read_median_s']:.4f} s and {res['rest_median_s']:.4f} s")
    if "plan" in res:
        pr = res["plan"]["predicted"]
        pred = pr.get("s_per_token", 0.0)
        res["ratio"] = pred / res["median"] if res["median"] else 0.0
        line += (f"\n  {'':14s} predicted {pred:.4f} ({res['ratio']:.2f}x of measured; "
                 f"reads {pr.get('read_s', 0):.4f} s, compute {pr.get('compute_s', 0):.4f} s, "
                 f"hits {pr.get('cache_hit_pct', 0):.1f} % from the {res['plan']['hit_source']} "
                 f"curve; planning {res['plan_s']:.1f} s)")
    print(line, flush=True)
    return res


def make_model(args: argparse.Namespace) -> Path:
    from bmoe.modelmaker import make_model as write
    path = Path(args.dir) / f"plan-bench-{args.layers}x64-top4-f16.gguf"
    if path.exists() and args.keep:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    write(path, n_layer=args.layers, n_expert=64, n_expert_used=4, n_embd=1024,
          n_ff_exp=512, n_head=8, n_head_kv=4, head_dim=128, dtype="f16",
          router_skew=1.5, context_mix=1.5, seed=7)
    print(f"model: wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return path


def one_cap(frac: float, model: Path, routing: Path, args: argparse.Namespace) -> dict:
    """Every run of this cap, `--repeats` times in turn (a disk whose rate drifts over
    minutes then favours no setting), merged: each setting's median over all its timed
    tokens, each prediction against that."""
    size = model.stat().st_size
    limit = int(size * frac)
    print(f"cap {frac:.0%}: {limit / 2**30:.2f} GiB of a {size / 2**30:.2f} GiB file "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    cap = MemoryCap(f"bmoe-plan-bench-{os.getpid()}-{int(frac * 100)}", limit)
    base = {"model": str(model), "tokens": args.tokens, "warmup": args.warmup,
            "routing": str(routing)}
    runs: dict[str, list[dict[str, Any]]] = {}
    grid: list[tuple[int, int]] = []
    pv: dict[str, Any] = {}
    try:
        for rep in range(args.repeats):
            tag = f" #{rep + 1}" if args.repeats > 1 else ""
            for f in routing.glob("*"):
                f.unlink()
            runs.setdefault("plan", []).append(run(
                "plan" + tag, {**base, "plan": True, "values": {}, "keep_routing": True},
                cap, args))
            runs.setdefault("plan+rec", []).append(run(
                "plan+rec" + tag, {**base, "plan": True, "values": {}}, cap, args))
            if rep == 0:
                planned = next((r for r in (runs["plan+rec"][0], runs["plan"][0])
                                if "values" in r), None)
                if planned is None:
                    break
                pv = planned["values"]
                cache = pv["cache-mb"] if isinstance(pv["cache-mb"], int) else 0
                cycle = args.cycle_mib
                for c in sorted({cycle, max(cycle, cache // 2), cache} - {0}):
                    for t in (1, 2):
                        if c == cache and t == pv["threads"]:
                            continue          # the planned setting itself: measured above
                        grid.append((c, t))
            for c, t in grid:
                vals = {**pv, "cache-mb": c, "threads": t}
                runs.setdefault(f"grid {c}x{t}", []).append(
                    run(f"grid {c}x{t}{tag}", {**base, "values": vals}, cap, args))
    finally:
        cap.remove()
    out: dict[str, Any] = {"limit": limit, "runs": runs, "grid": {}}
    if args.repeats > 1:
        print(f"  merged over {args.repeats} repeats:", flush=True)
    for name, rs in runs.items():
        merged = merge(rs, args)
        if name.startswith("grid "):
            out["grid"][name[5:]] = merged
        else:
            out[name] = merged
        if args.repeats > 1 and "median" in merged:
            line = f"    {name:14s} median {merged['median']:.4f} s/tok"
            if "ratio" in merged:
                line += f"  predicted {merged['predicted']:.4f} ({merged['ratio']:.2f}x)"
            print(line, flush=True)
    return out


def merge(rs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One setting's runs as one: the median over every run's timed tokens, the median
    prediction against it."""
    ok = [r for r in rs if "walls" in r]
    if not ok:
        return {"failed": [r.get("failed") for r in rs]}
    walls = [w for r in ok for w in r["walls"][r["timed_from"]:]]
    out: dict[str, Any] = {"median": statistics.median(walls), "values": ok[0]["values"],
                           "runs": [r["median"] for r in ok], "walls": walls}
    preds = [r["plan"]["predicted"].get("s_per_token", 0.0) for r in ok if "plan" in r]
    if preds:
        out["predicted"] = statistics.median(preds)
        out["ratio"] = out["predicted"] / out["median"] if out["median"] else 0.0
    return out


def report(results: dict[str, Any]) -> None:
    print("\ncap    predicted/measured (no record)  (record)   planned s/tok  grid best  "
          "planned/best")
    for frac, r in results.items():
        a, b = r.get("plan", {}), r.get("plan+rec", {})
        runs = [x for x in [b, *r.get("grid", {}).values()] if "median" in x]
        best = min((x["median"] for x in runs), default=0.0)
        planned = b.get("median", 0.0)
        if a.get("values") and a.get("values") == b.get("values"):
            # the same setting measured twice as often: both runs' tokens
            planned = statistics.median(a["walls"] + b["walls"])
            best = min([planned] + [x["median"] for x in runs[1:]])
        print(f"{frac:>4}   {a.get('ratio', 0):>6.2f}x {'':22s} {b.get('ratio', 0):>6.2f}x   "
              f"{planned:>9.4f}     {best:>8.4f}   {planned / best if best else 0:>6.2f}x")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=os.path.expanduser("~/.cache/bmoe-bench"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--caps", default="0.25,0.40,0.70")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2,
                   help="run every setting this often, in turn, and merge")
    p.add_argument("--run-timeout", type=float, default=400.0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    t_start = time.monotonic()
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    model = make_model(args)
    from bmoe.planner.probes import model_facts
    args.cycle_mib = -(-model_facts(model).probe.token_cycle_bytes // MIB)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bmoe-plan-bench-") as tmp:
        try:
            for frac in (float(x) for x in args.caps.split(",")):
                results[f"{frac:.0%}"] = one_cap(frac, model, Path(tmp), args)
        finally:
            if not args.keep:
                model.unlink(missing_ok=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
