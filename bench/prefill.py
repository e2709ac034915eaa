"""Prefill of long prompts (an agent's): resident, streamed and mmap under a memory cap.

    sudo .venv/bin/python bench/prefill.py --keep [--layers 12] [--prompts 1024,8192,32768]

Writes the benchmark MoE of `stream_vs_mmap.py` (24 layers x 64 experts, top-4, F16,
4.65 GiB; `--layers 12` for the 2.33 GiB one), then for every prompt size starts one fresh
`bmoe-server` per mode, with the page cache dropped first, and sends the prompt's token
ids to `/completion` (`n_predict` 1, greedy, no cached prefix):

  resident   --no-auto --no-moe-stream, no cap: llama.cpp on mmap with the file in the
             page cache (read once before the run): the baseline
  stream     --no-auto (expert streaming, cache-mb auto, prompt read-ahead on: the
             next layer's experts read while a layer computes), under the cap
  plan       expert streaming as the plan sets it up under the cap (the server's default:
             its cache, threads and prompt batch; a larger batch passes over the
             experts fewer times)
  mmap       --no-auto --no-moe-stream, under the cap (llama.cpp on mmap, the kernel
             evicting pages)
  resident-1024  resident with a 1,024-token prompt batch (not in the default modes):
             what the plan's larger batch is worth without streaming
  resident-2048  the same with 2,048 (the batch the plan picks on the gpt-oss-120b slice)
  plan-lanes2    the plan with two read lanes instead of four
  plan-keep      the plan with prompt batches keeping their first layers
             (`BMOE_PROMPT_KEEP=1`, off by default): its A/B is `--agent-mode
             plan,plan-keep`
  plan-noreserve the plan without the cache's pages committed ahead of its first fill
             (`BMOE_PAGE_RESERVE=0`): a fresh server's first prompt faults them in,
             in the read lanes; the other streamed modes wait for that commit before
             their first request (`--no-reserve-wait`: they do not)

The cap is `--cap-frac` of the file's size (default 0.4), a fresh memory cgroup per run
(v1 or v2, `bmoe.machine.cgroup.MemoryCap`). Per run: prefill tokens per second (the
server's own `timings`), the expert bytes the streamer read for the prompt (from
`/metrics`, `bmoe:expert_read_bytes_total` before and after; mmap's reads are the
kernel's page faults, not counted) and how many passes over every expert of the model
that is, and the ratio of the mode's rate to the resident
one's measured in the same run.

Then the agent's second request (`--agent-prefix`, default the largest prompt size): on a
server as the plan sets it up under the cap (`--agent-mode` to choose another), a prompt
of that many tokens, then the same prefix plus `--agent-new` new tokens. Its first
token should come within the new tokens' prefill time plus 0.5 s (prefix reuse: nothing
re-read that is still cached). The new tokens' prefill time is measured: the same two
requests on the resident server (no cap, every weight in memory). The bench prints the
time to the first token, the expert bytes it read (and read ahead), the time its layers
waited for reads, the bound, and whether it met it; then the second request's CPU on
both servers (the compute threads' user and system seconds, the read lanes', the
threads' involuntary context switches, the process's major page faults and the host's
TLB shootdowns).

`--pack` writes the model's packed experts file first (its MXFP4 experts already in the
repacked layout, beside the model: `bmoe-server models pack-experts`), so the streamed
modes read it; `--agent-mode plan,plan-unpacked` is then the A/B of that file, the
second mode reading the model and permuting as it reads.

Needs root (cgroups, drop_caches). Deletes the model file at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import MIB, drop_caches  # noqa: E402
from prompt_memory import _post, _wait_loaded, prompt_tokens  # noqa: E402
from stream_vs_mmap import add_model_args, make_bench_model, pack, warm_page_cache  # noqa: E402

from bmoe.machine.cgroup import MemoryCap  # noqa: E402
from bmoe.models.probe import probe_file  # noqa: E402

MODES = {
    "resident": (["--no-auto", "--no-moe-stream"], False),
    "stream": (["--no-auto"], True),
    "plan": ([], True),
    "mmap": (["--no-auto", "--no-moe-stream"], True),
    # resident, no cap, with the prompt batch the plan chooses for streaming here (1,024):
    # what the larger batch alone is worth, apart from streaming
    "resident-1024": (["--no-auto", "--no-moe-stream", "--batch-size", "1024",
                       "--ubatch-size", "1024"], False),
    # the resident server at the prompt batch the plan picks under a 40 % cap on the
    # gpt-oss-120b slice: what that batch costs the compute alone
    "resident-2048": (["--no-auto", "--no-moe-stream", "--batch-size", "2048",
                       "--ubatch-size", "2048"], False),
    # resident-2048 with llama.cpp's repacked-weight kernels off: the file's layout, the
    # kernels a streamed expert runs
    "resident-2048-norepack": (["--no-auto", "--no-moe-stream", "--batch-size", "2048",
                                "--ubatch-size", "2048", "--no-repack"], False),
    # the plan with two read lanes instead of four (fewer lanes preempting the compute
    # threads, for reads that need a fraction of the disk's rate)
    "plan-lanes2": (["--io-threads", "2"], True),
    # the plan reading the model and permuting MXFP4 experts as they land, where a packed
    # experts file (--pack) would otherwise be read: the A/B of that file
    "plan-unpacked": (["--no-packed-experts"], True),
    # the plan with prompt batches keeping their first layers (BMOE_PROMPT_KEEP=1, off by
    # default): later ubatches and the next prompt find them cached
    "plan-keep": ([], True),
    # the plan without the cache's pages committed ahead (BMOE_PAGE_RESERVE=0): the first
    # fill's reads fault fresh pages in, in the read lanes
    "plan-noreserve": ([], True),
}
MODE_ENV = {"plan-keep": {"BMOE_PROMPT_KEEP": "1"},
            "plan-noreserve": {"BMOE_PAGE_RESERVE": "0"}}
COUNTERS = {"read_bytes": "bmoe:expert_read_bytes_total",
            "ahead_bytes": "bmoe:expert_read_ahead_bytes_total",
            "wait_s": "bmoe:expert_read_wait_seconds_total",
            "moved_bytes": "bmoe:expert_pages_moved_bytes_total"}


def expert_bytes(model: Path) -> int:
    """The bytes of every routed expert of the model (one pass over all of them)."""
    p = probe_file(model)
    return int(p.expert_bytes)


def counters(url: str) -> dict[str, float]:
    """The streamer's totals since load: expert bytes read, of them read ahead, and the
    seconds the layers waited for reads (zeros on a server that does not stream)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
    return {key: float(samples.get(name, 0.0)) for key, name in COUNTERS.items()}


def cpu_sample(pid: int) -> dict[str, float]:
    """The server's CPU so far, split between its read lanes (threads named `bmoe-read`)
    and every other thread (the engine, llama.cpp's compute threads, HTTP), user and
    system seconds; its involuntary context switches; its major page faults (pages read
    from a file: the model's dense weights on mmap, re-read if the cap's reclaim took
    them); and the host's TLB shootdowns (interrupts sent to flush another core's page
    table entries, as page moves do)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"lane_user_s": 0.0, "lane_sys_s": 0.0, "other_user_s": 0.0, "other_sys_s": 0.0,
           "preempted": 0.0, "tlb_shootdowns": 0.0, "major_faults": 0.0,
           "minor_faults": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:                     # the thread ended while read
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        who = "lane" if comm.startswith("bmoe-read") else "other"
        out[f"{who}_user_s"] += int(fields[11]) / tick
        out[f"{who}_sys_s"] += int(fields[12]) / tick
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                out["preempted"] += int(line.split()[1])
    try:                                    # the process's page faults that read a file
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        out["minor_faults"], out["major_faults"] = float(fields[7]), float(fields[9])
    except OSError:
        pass
    for line in Path("/proc/interrupts").read_text().splitlines():
        if line.strip().startswith("TLB:"):
            out["tlb_shootdowns"] = float(sum(int(x) for x in line.split()[1:]
                                              if x.isdigit()))
    return out


def cpu_line(r: dict[str, Any]) -> str:
    """One request's CPU and page work (`Server.prompt`'s `cpu`, its moved bytes)."""
    c = r["cpu"]
    return (f"CPU: compute threads {c['other_user_s']:.2f} user + {c['other_sys_s']:.2f} "
            f"sys s, read lanes {c['lane_user_s']:.2f} user + {c['lane_sys_s']:.2f} sys s; "
            f"{c['preempted']:.0f} preemptions, {c['tlb_shootdowns']:.0f} TLB shootdowns; "
            f"pages moved {r.get('moved_bytes', 0) / MIB:.0f} MiB, "
            f"{c['minor_faults']:.0f} minor page faults "
            f"({c['minor_faults'] * 4096 / MIB:.0f} MiB of 4 KiB pages), "
            f"{c['major_faults']:.0f} major")


class Server:
    """One bmoe-server on the model, inside `cap` (None: no cap)."""

    def __init__(self, model: Path, flags: list[str], cap: MemoryCap | None,
                 args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
        self.data = Path(tempfile.mkdtemp(prefix="bmoe-prefill-data-"))
        cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
               str(self.data), "--threads", str(args.threads), "--ctx-size",
               str(args.ctx_size), "--metrics", "--model", str(model), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", BMOE_LLAMA_LOG="0", **(env or {}))
        popen = cap.popen if cap is not None else subprocess.Popen
        self.proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=env, cwd=tempfile.gettempdir())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"the server did not start: {line!r}")
        self.url = line.split("listening on", 1)[1].strip().rstrip("/")
        state = _wait_loaded(self.url, self.proc, time.monotonic() + args.run_timeout)
        if state.get("state") != "ready":
            self.close()
            raise RuntimeError(f"the model did not load: {str(state)[:300]}")
        info = state.get("model") or {}
        self.n_ubatch = int((info.get("context") or {}).get("n_ubatch") or 0)
        notes = info.get("streaming_notes") or {}
        self.ahead = str(notes.get("prefill_ahead", "")) if info.get("streaming") else ""
        self.keeps = str(notes.get("prompt_keeps", "")) if info.get("streaming") else ""
        # the cache's pages committed in the background after the load: an agent's server
        # has been up a while before its first request, so the requests wait for it
        self.reserve = str(notes.get("page_reserve", "")) if info.get("streaming") else ""
        t0 = time.monotonic()
        while (self.reserve == "committing" and not args.no_reserve_wait
               and time.monotonic() - t0 < args.run_timeout):
            time.sleep(0.5)
            state = _wait_loaded(self.url, self.proc, time.monotonic() + 30)
            self.reserve = str(((state.get("model") or {}).get("streaming_notes") or {})
                               .get("page_reserve", ""))

    def prompt(self, ids: list[int], timeout: float, cache: bool = False) -> dict[str, Any]:
        before = counters(self.url)
        cpu0 = cpu_sample(self.proc.pid)
        t0 = time.monotonic()
        status, reply = _post(self.url + "/completion",
                              {"prompt": ids, "n_predict": 1, "temperature": 0,
                               "cache_prompt": cache}, timeout)
        wall = time.monotonic() - t0
        cpu1 = cpu_sample(self.proc.pid)
        cpu = {k: round(v - cpu0[k], 2) for k, v in cpu1.items()}
        if status != 200 or not isinstance(reply, dict):
            return {"outcome": "failed", "why": str(reply)[:300], "status": status}
        t = reply.get("timings", {})
        return {"outcome": "answered", "wall_s": round(wall, 3),
                "n_prompt": t.get("prompt_n"), "prefill_s": t.get("prompt_ms", 0.0) / 1e3,
                "tok_s": t.get("prompt_per_second", 0.0), "cached": reply.get("tokens_cached"),
                "cpu": cpu,
                **{k: v - before[k] for k, v in counters(self.url).items()}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.data, ignore_errors=True)


def run_mode(mode: str, model: Path, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    flags, capped = MODES[mode]
    limit = int(model.stat().st_size * args.cap_frac)
    cap = MemoryCap(f"bmoe-prefill-{os.getpid()}", limit) if capped else None
    try:
        drop_caches()
        if not capped:
            warm_page_cache(model)
        try:
            server = Server(model, flags, cap, args, MODE_ENV.get(mode))
        except RuntimeError as e:
            res: dict[str, Any] = {"outcome": "failed", "why": str(e)}
        else:
            try:
                res = server.prompt(ids, args.run_timeout)
                res.update(n_ubatch=server.n_ubatch, prefill_ahead=server.ahead,
                           prompt_keeps=server.keeps, page_reserve=server.reserve)
            finally:
                server.close()
        if cap is not None and cap.oom_kills():
            res["outcome"] = "killed"
        res.update(mode=mode, prompt=len(ids), cap_mib=round(limit / MIB) if capped else 0)
        return res
    finally:
        if cap is not None:
            cap.remove()


def two_requests(model: Path, mode: str, cap: MemoryCap | None, ids: list[int],
                 new: list[int], args: argparse.Namespace
                 ) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """The prefix, then the prefix plus the new tokens, on one fresh server."""
    drop_caches()
    if cap is None:
        warm_page_cache(model)
    server = Server(model, MODES[mode][0], cap, args, MODE_ENV.get(mode))
    try:
        first = server.prompt(ids, args.run_timeout, cache=True)
        second = server.prompt(ids + new, args.run_timeout, cache=True)
    finally:
        server.close()
    first["page_reserve"] = server.reserve
    return first, second, server.ahead, server.keeps


def agent_second_request(model: Path, ids: list[int], new: list[int],
                         args: argparse.Namespace) -> list[dict[str, Any]]:
    """The new tokens' prefill is measured, not derived: the same two requests on the
    resident server (no cap, the file in the page cache) give what the new tokens cost
    at the end of that context with every weight in memory; the streamed server's
    second request must answer within it + 0.5 s. (The first prompt's average rate,
    printed beside it, understates it: the new tokens attend over the whole prefix.)
    One resident baseline, then every mode of `--agent-mode` in turn."""
    limit = int(model.stat().st_size * args.cap_frac)
    try:
        base_first, base_second, _, _ = two_requests(model, "resident", None, ids, new, args)
    except RuntimeError as e:
        return [{"outcome": "failed", "why": f"resident: {e}"}]
    if any(r["outcome"] != "answered" for r in (base_first, base_second)):
        return [{"outcome": "failed", "runs": (base_first, base_second)}]
    out = []
    for mode in args.agent_mode.split(","):
        # a mode without a cap (resident ones) runs as the baseline did: a repeat of the
        # baseline within the run shows how much the host moves between runs
        cap = MemoryCap(f"bmoe-prefill-agent-{os.getpid()}", limit) if MODES[mode][1] \
            else None
        try:
            try:
                first, second, ahead, keeps = two_requests(model, mode, cap, ids, new, args)
            except RuntimeError as e:
                out.append({"outcome": "failed", "server": mode, "why": str(e)})
                continue
        finally:
            if cap is not None:
                cap.remove()
        if any(r["outcome"] != "answered" for r in (first, second)):
            out.append({"outcome": "failed", "server": mode, "runs": (first, second)})
            continue
        new_s = base_second["wall_s"]
        avg_s = len(new) / (first["tok_s"] or 1.0)
        out.append({
            "outcome": "answered", "server": mode, "prefix": len(ids),
            "new": len(new), "prefill_ahead": ahead, "prompt_keeps": keeps,
            "first_s": first["wall_s"], "second_s": second["wall_s"],
            "first_read_mib": first["read_bytes"] / MIB,
            "first_wait_s": round(first["wait_s"], 3),
            "second_cached": second["cached"], "second_read_mib": second["read_bytes"] / MIB,
            "second_ahead_mib": second["ahead_bytes"] / MIB,
            "second_wait_s": round(second["wait_s"], 3),
            "first": first, "second": second, "resident_second": base_second,
            "resident_first_s": base_first["wall_s"], "new_prefill_s": new_s,
            "avg_rate_s": round(avg_s, 3), "bound_s": round(new_s + 0.5, 3),
            "vs_resident": round(second["wall_s"] / new_s, 3) if new_s else 0.0,
            "met": second["wall_s"] <= new_s + 0.5})
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompts", default="1024,8192,32768", help="prompt sizes, tokens")
    p.add_argument("--modes", default="resident,stream,plan,mmap",
                   help="the prompts' runs (an empty list runs only the agent's two requests)")
    p.add_argument("--cap-frac", type=float, default=0.4)
    p.add_argument("--agent-prefix", type=int, default=0,
                   help="the agent's prefix, tokens (default the largest prompt; 0 skips "
                        "with --no-agent)")
    p.add_argument("--agent-new", type=int, default=500)
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--agent-mode", default="plan",
                   help="the streamed servers of the agent's requests, comma-separated "
                        "(stream, plan, plan-unpacked, plan-keep, plan-lanes2), against "
                        "one resident baseline; a resident mode in the list runs without "
                        "the cap, a repeat of the baseline")
    p.add_argument("--pack", action="store_true",
                   help="write the model's packed experts file first (kept beside the "
                        "model; plan-unpacked reads the model without it)")
    p.add_argument("--no-reserve-wait", action="store_true",
                   help="send the first request as soon as the model is loaded, while the "
                        "cache's pages are still being committed (a prompt that comes "
                        "straight after the server starts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=3600.0)
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the model file")
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args(argv)
    bad = [m for m in args.agent_mode.split(",") + [m for m in args.modes.split(",") if m]
           if m not in MODES]
    if bad:
        p.error(f"unknown mode(s): {', '.join(bad)}; known: {', '.join(MODES)}")
    sizes = [int(x) for x in args.prompts.split(",")]
    prefix = args.agent_prefix or max(sizes)
    args.ctx_size = max(max(sizes), prefix + args.agent_new) + 64
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    t_start = time.monotonic()
    model = make_bench_model(args)
    every = expert_bytes(model)
    all_ids = prompt_tokens(model, max(max(sizes), prefix + args.agent_new))
    results: list[dict[str, Any]] = []
    try:
        if args.pack:
            pack(model)
        for n in sizes:
            base = None
            for mode in [m for m in args.modes.split(",") if m]:
                r = run_mode(mode, model, all_ids[:n], args)
                if mode == "resident" and r["outcome"] == "answered":     # the baseline
                    base = r["tok_s"]
                ratio = (r.get("tok_s", 0) / base) if base and r["outcome"] == "answered" else 0
                passes = r.get("read_bytes", 0) / every if every else 0.0
                r.update(vs_resident=round(ratio, 3), passes=round(passes, 2))
                results.append(r)
                if r["outcome"] == "answered":
                    read = (f"experts read {r['read_bytes'] / MIB:8.0f} MiB = {passes:5.2f} "
                            f"passes ({r['ahead_bytes'] / MIB:.0f} MiB ahead), layers "
                            f"waited {r['wait_s']:.1f} s; read-ahead: "
                            f"{r.get('prefill_ahead') or 'off'}"
                            if mode.startswith(("stream", "plan")) else
                            "experts read by the kernel (not counted)")
                    print(f"{mode:9s} {n:6d} tokens: {r['tok_s']:8.1f} tok/s "
                          f"({r['prefill_s']:.1f} s, ubatch {r.get('n_ubatch')}), {read}, "
                          f"{ratio:.3f}x resident",
                          flush=True)
                    print("  " + cpu_line(r), flush=True)
                    if r.get("page_reserve"):
                        print(f"  pages committed ahead: {r['page_reserve']}", flush=True)
                else:
                    print(f"{mode:9s} {n:6d} tokens: {r['outcome']} {r.get('why', '')}",
                          flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
        if not args.no_agent:
            for a in agent_second_request(model, all_ids[:prefix],
                                          all_ids[prefix:prefix + args.agent_new], args):
                results.append({"mode": "agent", **a})
                if a["outcome"] == "answered":
                    print(f"agent ({a['server']}): {a['prefix']}-token prefix in "
                          f"{a['first_s']:.1f} s (resident {a['resident_first_s']:.1f} s, "
                          f"{a['first_read_mib']:.0f} MiB read, layers waited "
                          f"{a['first_wait_s']:.2f} s; kept layers: "
                          f"{a['prompt_keeps'] or 'none'}); "
                          f"the same plus {a['new']} new tokens answered its first token in "
                          f"{a['second_s']:.2f} s (context {a['second_cached']} tokens, "
                          f"{a['second_read_mib']:.0f} MiB read, {a['second_ahead_mib']:.0f} "
                          f"MiB of it ahead, layers waited {a['second_wait_s']:.2f} s) "
                          f"against the bound {a['bound_s']:.2f} s (the new tokens' prefill "
                          f"on the resident server {a['new_prefill_s']:.2f} s + 0.5 s; at "
                          f"the first prompt's average rate it would be "
                          f"{a['avg_rate_s']:.2f} s), {a['vs_resident']:.3f}x resident: "
                          f"{'met' if a['met'] else 'MISSED'}", flush=True)
                    print(f"  first request: {cpu_line(a['first'])}; pages committed "
                          f"ahead: {a['first'].get('page_reserve') or 'none'}", flush=True)
                    print(f"  second request: {cpu_line(a['second'])}", flush=True)
                    print(f"  the resident one: {cpu_line(a['resident_second'])}", flush=True)
                else:
                    print(f"agent: {a['outcome']}: {json.dumps(a)[:400]}", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep:
            model.unlink(missing_ok=True)
            Path(str(model) + ".bmoe-packed").unlink(missing_ok=True)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
