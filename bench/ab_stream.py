"""A/B of streamed decode under a memory cap: variants alternated run by run.

Each variant is a set of environment variables (for the switches the engine reads from
its environment, such as `BMOE_EVAL_CALLBACK=python` or `BMOE_AIO=0`) and optionally of
streamer values; every round runs each variant once, in its own process, inside the same
memory cap (`--cap-frac` of the file), with the page cache dropped before each run. The
run is `stream_vs_mmap.py`'s worker: `--tokens` tokens teacher-forced one at a time, the
first `--warmup` not counted. The first variant is the baseline: the summary prints each
variant's mean and median s/token, its read stall and the callback's management time per
token, and its ratio to the baseline. Alternating rounds is what makes a difference of a
few per cent visible on a machine whose disk rate moves by 2-3x within a day (see
docs/benchmarks.md).

    sudo .venv/bin/python bench/ab_stream.py ~/.cache/bmoe-bench/gpt-oss-120b-12L-mxfp4_moe.gguf \\
        --rounds 5 'python={"env": {"BMOE_EVAL_CALLBACK": "python"}}' 'native={}'

A variant may also name another checkout of the project (`"tree": PATH`, its native
extension built): its worker, and so its code, runs that variant, to compare two
revisions of the engine run by run:

    git worktree add /tmp/before HEAD~1 && cp bmoe/native/*.so /tmp/before/bmoe/native/
    sudo .venv/bin/python bench/ab_stream.py MODEL --rounds 5 'before={"tree": "/tmp/before"}' 'now={}'

`--throttle-mibps` runs every worker in a blkio cgroup whose reads are throttled to that
rate (cgroup v1), to compare variants where reads bound the token.

Needs root (cgroups, drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, MemoryCap, direct_read_rate, drop_caches  # noqa: E402

WORKER = Path(__file__).resolve().parent / "stream_vs_mmap.py"
# the overlapped run of stream_vs_mmap.py, as the plan sets it for a partial cache
VALUES: dict[str, Any] = {"moe-stream": True, "cache-mb": "auto", "overlap": True,
                          "prefetch": 2, "spec-gate": 0.0, "io-threads": 4,
                          "cache-floor-mb": 128}
BLKIO = Path("/sys/fs/cgroup/blkio")


def parse_variant(text: str) -> tuple[str, dict[str, str], dict[str, Any], Path]:
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"a variant is NAME=JSON, not {text!r}")
    try:
        d = json.loads(spec or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"variant {name}: {spec!r} is not JSON ({e.msg})") from None
    if not isinstance(d, dict) or set(d) - {"env", "values", "tree"}:
        raise SystemExit(f"variant {name}: give an object with 'env', 'values' and/or 'tree'")
    worker = WORKER
    if "tree" in d:
        worker = Path(str(d["tree"])).expanduser().resolve() / "bench" / WORKER.name
        if not worker.is_file():
            raise SystemExit(f"variant {name}: {worker} does not exist: 'tree' is a "
                             "checkout of this project")
    return (name, {k: str(v) for k, v in d.get("env", {}).items()}, dict(d.get("values", {})),
            worker)


def throttle(mibps: float, path: Path) -> Path | None:
    """Move this process (and so its workers) into a blkio cgroup whose reads of the device
    holding `path` run at `mibps` (a file system on a whole disk: blkio throttles disks,
    not partitions)."""
    if not mibps:
        return None
    if not BLKIO.is_dir():
        raise SystemExit("--throttle-mibps needs the cgroup v1 blkio controller")
    dev = os.stat(path).st_dev
    g = BLKIO / f"bmoe-ab-{os.getpid()}"
    g.mkdir(exist_ok=True)
    (g / "blkio.throttle.read_bps_device").write_text(
        f"{os.major(dev)}:{os.minor(dev)} {int(mibps * MIB)}")
    (g / "cgroup.procs").write_text(str(os.getpid()))
    return g


def run(cap: MemoryCap, model: str, values: dict[str, Any], env: dict[str, str],
        args: argparse.Namespace, worker: Path = WORKER) -> dict[str, float]:
    spec = {"model": model, "values": {**VALUES, **values}, "tokens": args.tokens,
            "threads": args.threads}
    drop_caches()
    proc = cap.run([sys.executable, str(worker), "--worker", json.dumps(spec)],
                   timeout=args.run_timeout, env=dict(os.environ, **env))
    if proc.returncode != 0:
        raise SystemExit(f"worker failed (rc {proc.returncode}, oom kills "
                         f"{cap.oom_kills()}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    w = out["walls"][args.warmup:]
    return {"mean": statistics.mean(w), "median": statistics.median(w),
            "stall_ms": statistics.mean(out["stall_s"][args.warmup:]) * 1e3,
            "mgmt_ms": statistics.mean(out["mgmt"][args.warmup:]) * 1e3,
            "mib": sum(out["reads"][args.warmup:]) / len(w) / MIB,
            # the engine's read rate: its bytes over the time it waited for them (a serial
            # run's; an overlapped run waits for only part of its reads: 0, printed "-")
            "rd_mibps": 0.0 if spec["values"].get("overlap") else (
                sum(out["reads"][args.warmup:]) / MIB
                / max(1e-9, sum(out["io"][args.warmup:])))}


def rate(mibps: float) -> str:
    return f"{mibps:.0f}" if mibps else "-"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a GGUF file with routed experts (e.g. a slice that "
                                 "stream_vs_mmap.py --shape ... --keep made)")
    p.add_argument("variants", nargs="+",
                   help='NAME=JSON, the JSON {"env": {...}, "values": {...}} (both optional); '
                        "the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=150)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cap-frac", type=float, default=0.40)
    p.add_argument("--throttle-mibps", type=float, default=0.0,
                   help="throttle the workers' reads to this rate (blkio)")
    p.add_argument("--run-timeout", type=float, default=1500.0)
    args = p.parse_args(argv)
    if args.warmup >= args.tokens:
        raise SystemExit("--warmup must be below --tokens")
    variants = [parse_variant(v) for v in args.variants]
    path = Path(args.model)
    size = path.stat().st_size
    cap = MemoryCap(f"bmoe-ab-{os.getpid()}", int(size * args.cap_frac))
    group = None
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in variants}
    try:
        group = throttle(args.throttle_mibps, path)
        print(f"disk (before): {direct_read_rate(path, 1 << 20, 512, 4) / MIB:.0f} MiB/s"
              + (f", reads throttled to {args.throttle_mibps:.0f} MiB/s" if group else ""),
              flush=True)
        for r in range(args.rounds):
            for name, env, values, worker in variants:
                t0 = time.monotonic()
                row = run(cap, str(path), values, env, args, worker)
                rows[name].append(row)
                print(f"round {r} {name:12s} mean {row['mean']:.4f} median {row['median']:.4f} "
                      f"s/tok  stall {row['stall_ms']:.1f} ms  mgmt {row['mgmt_ms']:.1f} ms  "
                      f"{row['mib']:.1f} MiB/tok  rd {rate(row['rd_mibps']):>5s} MiB/s  "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
        print(f"disk (after): {direct_read_rate(path, 1 << 20, 512, 4) / MIB:.0f} MiB/s")
    finally:
        cap.remove()
        if group is not None:
            (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
    base = statistics.mean(r["mean"] for r in rows[variants[0][0]])
    print(f"\n{'variant':12s} {'mean':>7s} {'median':>7s} {'stall ms':>8s} {'mgmt ms':>7s} "
          f"{'x base':>6s} {'rd MiB/s':>8s}   (means over {args.rounds} rounds of each run's "
          f"mean, median of medians; {args.tokens} tokens, the first {args.warmup} not counted)")
    for name, *_ in variants:
        rs = rows[name]
        mean = statistics.mean(r["mean"] for r in rs)
        print(f"{name:12s} {mean:7.4f} {statistics.median(r['median'] for r in rs):7.4f} "
              f"{statistics.mean(r['stall_ms'] for r in rs):8.1f} "
              f"{statistics.mean(r['mgmt_ms'] for r in rs):7.1f} {mean / base:6.3f} "
              f"{rate(statistics.mean(r['rd_mibps'] for r in rs)):>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
