"""Where a streamed token's CPU time goes, against the same engine with every expert resident.

    sudo .venv/bin/python bench/cpu_profile.py ~/.cache/bmoe-bench/qwen3-30b-a3b-12L-q4_k_m.gguf

It runs `stream_vs_mmap.py`'s worker twice (`--tokens` tokens teacher-forced one at a time),
each under a system-wide `perf record -g` (the cpu-clock event, so it works in a virtual
machine without hardware counters) that the worker switches on for its timed tokens only
(after `--warmup`, through perf's control FIFO): first streamed under the memory cap
(`--cap-frac` of the file; `auto+prefetch+overlap`, as `ab_stream.py` runs it), then
uncapped with every expert resident, the baseline. System-wide, because the interrupts
that complete the reads and the kernel's TLB flushes run where they land.

Each sample goes to one class, from the leaf of its stack up (the first frame that names
one): llama.cpp's compute (libggml, libllama, libm), OpenMP waiting (libgomp: a compute
thread spinning at a barrier, or idle between two graph splits while the engine thread
is in the routing callback), the kernel's work by what it serves (direct reads: the
page pinning and block requests of `preadv`/AIO; page moves: `mremap`, TLB flush
included; page frees: `madvise`; page faults; interrupts: read completions; thread
wake-ups: futex and the scheduler; other kernel), Python and numpy (the callback, the
cache, the lanes' Python; libc too), bmoe's own C (the graph callback and its read-ahead
guesses, the cache's victim choice), other user code, other processes, and idle. The table gives
each class's CPU milliseconds per token in both runs and the difference: on a machine
with as many compute threads as cores, every millisecond the streamed run adds to a class
is taken from the token's compute or makes it wait.

`--by-thread` also splits the streamed run by thread of the worker, each named by where
its CPU went (the engine thread: the callback's Python beside compute; llama.cpp's other
compute thread; the read lanes: the kernel's side of reads), e.g. to see whose Python it is.

Needs root (cgroups, drop_caches, system-wide perf) and `perf` (Debian: `linux-perf`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, MemoryCap, drop_caches  # noqa: E402
from ab_stream import VALUES as STREAMED  # noqa: E402  (ab_stream.py's overlapped run)
from ab_stream import WORKER  # noqa: E402

RESIDENT: dict[str, Any] = {"moe-stream": True, "load-all": True}

# kernel frames that say what the kernel was doing, first match from the leaf up
KERNEL_MARKS: list[tuple[str, tuple[str, ...]]] = [
    ("interrupts (read completions)", ("common_interrupt", "handle_softirqs",
                                       "__irq_exit_rcu", "blk_done_softirq")),
    ("page faults", ("exc_page_fault",)),
    ("page moves (mremap, TLB flush)", ("do_mremap", "__do_sys_mremap")),
    ("page frees (madvise)", ("do_madvise", "__x64_sys_madvise", "__x64_sys_process_madvise")),
    ("direct reads (preadv, AIO)", ("do_preadv", "iomap_dio_rw", "__x64_sys_io_submit",
                                    "__x64_sys_io_getevents", "__x64_sys_io_pgetevents")),
    ("thread wake-ups (futex, scheduler)", ("__x64_sys_futex", "schedule", "__schedule",
                                            "finish_task_switch.isra.0", "try_to_wake_up")),
]
CLASSES = ["llama.cpp compute", "OpenMP waiting", *[c for c, _ in KERNEL_MARKS],
           "other kernel", "Python and numpy", "bmoe's C (callback, guesses, victims)",
           "other user code", "other processes", "idle"]
PYTHON_DSOS = ("libpython", "python3", "_multiarray", "numpy", "_ctypes", "libffi",
               "libc.so", "ld-linux")
BMOE_DSOS = ("evalcb", "cachepick", "rpcguard")


def classify(comm: str, pid: int, frames: list[tuple[str, str]], worker: int) -> str:
    """One sample's class; `frames` are (symbol, dso) from the leaf up."""
    if pid == 0 or comm.startswith("swapper"):
        return "idle"
    if pid != worker:
        return "other processes"
    for sym, dso in frames:
        if dso != "[kernel.kallsyms]":
            break
        for name, marks in KERNEL_MARKS:
            if sym in marks:
                return name
    sym, dso = frames[0] if frames else ("", "")
    if dso == "[kernel.kallsyms]":
        return "other kernel"
    base = os.path.basename(dso)
    if base.startswith(("libggml", "libllama", "libm.so", "libm-")):
        return "llama.cpp compute"
    if base.startswith("libgomp"):
        return "OpenMP waiting"
    if base.startswith(PYTHON_DSOS):
        return "Python and numpy"
    if base.startswith(BMOE_DSOS):
        return "bmoe's C (callback, guesses, victims)"
    return "other user code"


def parse(script: str, worker: int, leaves: Counter[tuple[str, str]] | None = None,
          threads: dict[int, Counter[str]] | None = None) -> Counter[str]:
    """`perf script -F comm,pid,tid,ip,sym,dso` output -> samples per class (and per class
    and leaf frame, "library: symbol", into `leaves`; per thread of the worker and class
    into `threads`)."""
    counts: Counter[str] = Counter()
    head: tuple[str, int, int] | None = None
    frames: list[tuple[str, str]] = []
    for line in script.splitlines() + [""]:
        if not line.strip():
            if head is not None:
                c = classify(head[0], head[1], frames, worker)
                counts[c] += 1
                if leaves is not None and frames:
                    sym, dso = frames[0]
                    leaves[(c, f"{os.path.basename(dso)}: {sym}")] += 1
                if threads is not None and head[1] == worker:
                    threads.setdefault(head[2], Counter())[c] += 1
            head, frames = None, []
        elif not line[0].isspace():
            parts = line.rsplit(None, 1)          # "comm with spaces  pid/tid"
            comm = parts[0].strip() if len(parts) > 1 else ""
            ids = parts[-1].split("/") if "/" in parts[-1] else ["-1", "-1"]
            head = (comm, int(ids[0]), int(ids[1]))
        else:
            rest = line.strip().split(None, 1)
            text = rest[1] if len(rest) > 1 else ""
            sym, _, dso = text.rpartition(" (")
            frames.append((sym.split("+")[0], dso.rstrip(")")))
    return counts


READ_CLASSES = ("direct reads (preadv, AIO)", "page moves (mremap, TLB flush)",
                "page frees (madvise)", "interrupts (read completions)")


def thread_role(ms: dict[str, float]) -> str:
    """What a thread of the worker is, from where its CPU went: a read lane (mostly the
    kernel's side of reads), the engine thread (the callback's Python beside compute),
    or a compute thread (llama.cpp and OpenMP only)."""
    total = sum(ms.values()) or 1.0
    reads = sum(ms.get(c, 0.0) for c in READ_CLASSES)
    compute = ms.get("llama.cpp compute", 0.0) + ms.get("OpenMP waiting", 0.0)
    python = ms.get("Python and numpy", 0.0) + ms.get("bmoe's C (callback, guesses, victims)", 0.0)
    if reads >= 0.4 * total and compute < 0.2 * total:
        return "read lane"
    if compute >= 0.2 * total and python >= 0.1 * total:
        return "engine thread"
    if compute >= 0.6 * total:
        return "compute thread (OpenMP)"
    return "other thread"


def profile(name: str, values: dict[str, Any], cap: MemoryCap | None, args: argparse.Namespace,
            freq: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bmoe-perf-") as tmp:
        ctl, ack, data = (os.path.join(tmp, n) for n in ("ctl", "ack", "perf.data"))
        os.mkfifo(ctl)
        os.mkfifo(ack)
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(freq),
                                 "-a", "-g", "-D", "-1", "--control", f"fifo:{ctl},{ack}",
                                 "-o", data], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        spec = {"model": args.model, "values": values, "tokens": args.tokens,
                "threads": args.threads, "perf_ctl": [ctl, ack], "perf_from": args.warmup}
        cmd = [sys.executable, str(WORKER), "--worker", json.dumps(spec)]
        drop_caches()
        try:
            proc = (cap.run(cmd, timeout=args.run_timeout) if cap is not None
                    else subprocess.run(cmd, capture_output=True, text=True,
                                        timeout=args.run_timeout))
        finally:
            perf.send_signal(signal.SIGINT)
            _, err = perf.communicate(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"the {name} run failed (rc {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        if perf.returncode not in (0, -signal.SIGINT):
            raise SystemExit(f"perf record failed (rc {perf.returncode}): {err[-2000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,ip,sym,dso"],
                                capture_output=True, text=True, check=True).stdout
    n = len(out["walls"]) - args.warmup
    leaves: Counter[tuple[str, str]] = Counter()
    threads: dict[int, Counter[str]] = {}
    counts = parse(script, out["pid"], leaves, threads)
    ms = {c: counts[c] / freq * 1e3 / n for c in CLASSES}
    walls = out["walls"][args.warmup:]
    res = {"s_per_token": statistics.mean(walls), "ms": ms, "samples": sum(counts.values()),
           "tokens": n, "mib": sum(out["reads"][args.warmup:]) / n / MIB,
           "leaves": {k: v / freq * 1e3 / n for k, v in leaves.items()},
           "threads": {tid: {c: v / freq * 1e3 / n for c, v in cnt.items()}
                       for tid, cnt in threads.items()}}
    print(f"{name:9s} {res['s_per_token']:.4f} s/token over {n} tokens, "
          f"{res['mib']:.1f} MiB read per token, {res['samples']} samples", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF with routed experts (e.g. a slice that "
                                  "stream_vs_mmap.py --shape ... --keep made)")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cap-frac", type=float, default=0.4)
    ap.add_argument("--freq", type=int, default=4000, help="samples per second per CPU")
    ap.add_argument("--top", type=int, default=0,
                    help="also list each class's N leaf functions costing the streamed run most")
    ap.add_argument("--by-thread", action="store_true",
                    help="also split the streamed run by thread of the worker (engine "
                         "thread, compute thread, read lanes)")
    ap.add_argument("--run-timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt install linux-perf)")
    if os.geteuid() != 0:
        raise SystemExit("run as root: the memory cap, drop_caches and system-wide perf need it")
    if args.warmup >= args.tokens:
        raise SystemExit("--warmup must be below --tokens")
    size = Path(args.model).stat().st_size
    cap = MemoryCap(f"bmoe-cpu-{os.getpid()}", int(size * args.cap_frac))
    try:
        streamed = profile("streamed", STREAMED, cap, args, args.freq)
    finally:
        cap.remove()
    resident = profile("resident", RESIDENT, None, args, args.freq)
    print(f"\nCPU ms per token by class (both cores; streamed under a {args.cap_frac:.0%} cap, "
          "resident uncapped):")
    print(f"{'class':38s} {'streamed':>9s} {'resident':>9s} {'added':>8s}")
    for c in CLASSES:
        a, b = streamed["ms"][c], resident["ms"][c]
        print(f"{c:38s} {a:9.2f} {b:9.2f} {a - b:+8.2f}")
    ta, tb = (sum(r["ms"][c] for c in CLASSES if c not in ("idle", "other processes"))
              for r in (streamed, resident))
    print(f"{'the worker, all classes':38s} {ta:9.2f} {tb:9.2f} {ta - tb:+8.2f}")
    wa, wb = streamed["s_per_token"] * 1e3, resident["s_per_token"] * 1e3
    print(f"{'wall ms per token':38s} {wa:9.2f} {wb:9.2f} {wa - wb:+8.2f}  "
          f"(streamed / resident {wa / wb:.2f})")
    if args.by_thread:
        print("\nthe streamed run by thread of the worker (CPU ms per token; threads under "
              "0.3 ms left out):")
        for _, cms in sorted(streamed["threads"].items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(cms.values())
            if total < 0.3:
                continue
            most = ", ".join(f"{c} {v:.2f}" for c, v in
                             sorted(cms.items(), key=lambda kv: -kv[1])[:5])
            print(f"  {thread_role(cms):24s} {total:7.2f}  ({most})")
    if args.top:
        print("\nthe streamed run's costliest leaf functions per class (CPU ms per token):")
        for c in CLASSES:
            top = sorted(((v, k[1]) for k, v in streamed["leaves"].items() if k[0] == c),
                         reverse=True)[:args.top]
            if top:
                print(f"{c}:")
                for v, name in top:
                    print(f"  {v:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
