"""The benchmark MoE split over two RPC helpers vs streamed in one process vs mmap.

Each "machine" gets the same cgroup-v1 memory cap, `--cap-frac` of the model file (by
default too small to hold the model in one process, big enough for half of it):

  split     the main process (capped) with `--rpc` to two `bmoe-server rpc-worker`s, each
            in a cap of its own and in a network namespace of its own behind a veth pair;
            the layers are dealt by the helpers' free memory (bmoe/engine/rpc.py)
  stream    bmoe's expert streaming (cache-mb auto) in one capped process
  mmap      llama.cpp on mmap (streaming off) in one capped process
  compute   every expert loaded into memory at load (load-all), no cap: the compute
            floor of one process on this machine

Decode is timed token by token (teacher-forced on the same text, the first `--warmup`
tokens not timed). The bytes that crossed the network per token are the veth pairs'
counters (both directions, both helpers) read around each token by the main process;
they include the protocol's framing and TCP/IP headers. The model is the one
bench/stream_vs_mmap.py writes (same flags). Needs root (cgroups, netns, drop_caches).
The CPU is shared with whatever else runs: the load average is printed at both ends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MIB, MemoryCap, drop_caches  # noqa: E402
from stream_vs_mmap import TEXT, add_model_args, make_bench_model, run_one  # noqa: E402


# -- the split run's main process ----------------------------------------------------------

def _net_bytes(ifaces: list[str]) -> int:
    total = 0
    for name in ifaces:
        for d in ("rx", "tx"):
            total += int(Path(f"/sys/class/net/{name}/statistics/{d}_bytes").read_text())
    return total


def split_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from bmoe.engine.session import Session

    values = {"temp": 0, "ctx-size": 1024, "threads": spec["threads"], "moe-stream": False,
              "rpc": spec["rpc"]}
    t0 = time.monotonic()
    net0 = _net_bytes(spec["ifaces"])
    s = Session(spec["model"], values, None)
    load_s, load_bytes = time.monotonic() - t0, _net_bytes(spec["ifaces"]) - net0
    helpers = s.rpc.describe() if s.rpc is not None else []
    tokens = s.tokenize(TEXT)[: spec["tokens"]]
    cancel = threading.Event()
    walls, net = [], []
    for i in range(1, len(tokens) + 1):
        b0 = _net_bytes(spec["ifaces"])
        t = time.perf_counter()
        s.prefill(tokens[:i], cancel)      # the KV holds tokens[:i-1]: this decodes one token
        walls.append(time.perf_counter() - t)
        net.append(_net_bytes(spec["ifaces"]) - b0)
    s.close()
    return {"load_s": load_s, "load_bytes": load_bytes, "walls": walls, "net": net,
            "helpers": helpers}


# -- the helpers: namespaces, caps, workers ------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Machine:
    """A network namespace behind a veth pair, a memory cap, an rpc-worker inside."""

    def __init__(self, index: int, limit: int, threads: int) -> None:
        tag = f"{os.getpid() % 100000}{index}"
        self.ns, self.veth = f"bmoe_rpcb_{tag}", f"bmr{tag}"
        self.host_ip, self.ip = f"10.216.{index}.1", f"10.216.{index}.2"
        self.port = 50052
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", self.veth + "n")
        _ip("link", "set", self.veth + "n", "netns", self.ns)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.veth)
        _ip("link", "set", self.veth, "up")
        _ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.ip}/24", "dev",
            self.veth + "n")
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.veth + "n", "up")
        _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        self.cap = MemoryCap(f"bmoe-rpcb-{tag}", limit)
        procs = str(self.cap.path / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        (self.cap.path / "memory.max_usage_in_bytes").write_text("0")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-m", "bmoe.server",
             "rpc-worker", "--host", self.ip, "--port", str(self.port), "--threads",
             str(threads), "--allow-network"],
            preexec_fn=enter, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def endpoint(self) -> str:
        return f"{self.ip}:{self.port}"

    def wait(self) -> None:
        from bmoe.engine import rpc
        rpc.wait_for_worker(rpc.Endpoint(self.ip, self.port), 60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.cap.remove()
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def run_split(model: Path, args: argparse.Namespace, limit: int) -> dict[str, Any]:
    machines: list[Machine] = []
    main_cap = MemoryCap(f"bmoe-rpcb-main-{os.getpid()}", limit)
    try:
        for i in range(2):
            machines.append(Machine(i + 1, limit, args.worker_threads))
        for m in machines:
            m.wait()
        spec = {"model": str(model), "tokens": args.tokens, "threads": args.threads,
                "rpc": ",".join(m.endpoint for m in machines),
                "ifaces": [m.veth for m in machines]}
        drop_caches()
        t0 = time.monotonic()
        proc = main_cap.run([sys.executable, __file__, "--split-worker", json.dumps(spec)],
                            timeout=args.run_timeout)
        if proc.returncode != 0:
            raise SystemExit(f"split: main process failed (rc {proc.returncode}, oom kills "
                             f"{main_cap.oom_kills()}):\n{proc.stderr[-3000:]}")
        res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        res["elapsed_s"] = time.monotonic() - t0
        res["peak_mib"] = main_cap.peak() / MIB
        res["helper_peak_mib"] = [m.cap.peak() / MIB for m in machines]
        res["helper_oom_kills"] = [m.cap.oom_kills() for m in machines]
    finally:
        for m in machines:
            m.close()
        main_cap.remove()
    w = res["walls"][args.warmup:]
    res["median"] = statistics.median(w)
    res["p90"] = sorted(w)[int(0.9 * (len(w) - 1))]
    res["net_tok"] = statistics.mean(res["net"][args.warmup:])
    layers = [h["layers"] for h in res["helpers"]]
    print(f"split    load {res['load_s']:6.1f} s ({res['load_bytes'] / MIB:.0f} MiB sent)  "
          f"median {res['median']:.4f} s/tok  p90 {res['p90']:.4f}  network "
          f"{res['net_tok'] / 1024:.1f} KiB/tok  layers {layers}  peaks: main "
          f"{res['peak_mib']:.0f} MiB, helpers "
          f"{', '.join(f'{p:.0f}' for p in res['helper_peak_mib'])} MiB", flush=True)
    return res


# -- main ----------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split-worker", help=argparse.SUPPRESS)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=24, help="tokens teacher-forced per run")
    p.add_argument("--mmap-tokens", type=int, default=10,
                   help="tokens of the mmap run (seconds each under the cap)")
    p.add_argument("--warmup", type=int, default=4, help="first tokens not timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker-threads", type=int, default=2,
                   help="threads of each helper (one helper computes at a time)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--cap-frac", type=float, default=0.60,
                   help="each machine's memory cap / model file size")
    p.add_argument("--cache-floor-mb", type=int, default=128)
    p.add_argument("--runs", default="split,stream,mmap,compute")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the model file")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.split_worker:
        print(json.dumps(split_worker(json.loads(args.split_worker))))
        return 0
    return bench(args)


def bench(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    print("load average at start: {:.2f} {:.2f} {:.2f} (other work on the machine skews "
          "every figure)".format(*os.getloadavg()), flush=True)
    model = make_bench_model(args)
    size = model.stat().st_size
    limit = int(size * args.cap_frac)
    print(f"cap per machine: {limit / 2**30:.2f} GiB ({args.cap_frac:.0%} of "
          f"{size / 2**30:.2f} GiB)", flush=True)
    results: dict[str, Any] = {}
    try:
        for name in args.runs.split(","):
            if name == "split":
                results[name] = run_split(model, args, limit)
                continue
            if name == "compute":
                results[name] = run_one(name, {"moe-stream": True, "load-all": True},
                                        model, args, None)
                continue
            values: dict[str, Any] = {"moe-stream": False} if name == "mmap" else {
                "moe-stream": True, "cache-mb": "auto", "io-threads": args.io_threads,
                "cache-floor-mb": args.cache_floor_mb}
            run_args = args if name != "mmap" else argparse.Namespace(
                **{**vars(args), "tokens": args.mmap_tokens})
            cap = MemoryCap(f"bmoe-rpcb-{name}-{os.getpid()}", limit)
            try:
                results[name] = run_one(name, values, model, run_args, cap)
            finally:
                cap.remove()
    finally:
        if not args.keep:
            model.unlink(missing_ok=True)
    base = results.get("split", {}).get("median")
    if base:
        for name in ("stream", "mmap", "compute"):
            if name in results:
                print(f"{name} / split: {results[name]['median'] / base:.2f}x the split's "
                      "s/token", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "routing"}
             for k, v in results.items()}, indent=1))
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
