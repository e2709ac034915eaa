"""More than one machine: llama.cpp's RPC backend through `--rpc` and `rpc-worker`.

Each "machine" is a `bmoe-server rpc-worker` process in its own cgroup-v1 memory cap (and,
for the network path, its own network namespace behind a veth pair). The model is one the
project writes; the answer with helpers must be token for token the single-process one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bmoe.engine import rpc
from bmoe.modelmaker import make_model

from _netns import veth_namespace
from bmoe.engine.experts.layout import read_layout
from conftest import start_server

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
WORKER_CAP = 256 << 20          # each helper "machine": far more than its layers need
MIB = 1 << 20


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 17 MB of weights, most of them in the 4 layers the helpers take."""
    return make_model(tmp_path_factory.mktemp("rpc") / "rpc-moe.gguf", n_layer=4,
                      n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                      n_expert_used=2, n_ff_exp=256, seed=3)


def _own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    pytest.skip("no cgroup-v1 memory controller")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], endpoint: rpc.Endpoint,
                 cgroup: Path) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.cgroup = cgroup

    def memory(self) -> int:
        """Bytes in use now; resets the cgroup's peak to it."""
        (self.cgroup / "memory.max_usage_in_bytes").write_text("0")
        return int((self.cgroup / "memory.usage_in_bytes").read_text())

    def peak(self) -> int:
        return int((self.cgroup / "memory.max_usage_in_bytes").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@contextmanager
def worker(tag: str, *, host: str = "127.0.0.1", netns: str | None = None,
           extra: tuple[str, ...] = (), port: int = 0) -> Iterator[Worker]:
    """An rpc-worker in its own memory cgroup (and namespace), until the block ends."""
    if os.geteuid() != 0:
        pytest.skip("memory cgroups need root")
    cgroup = _own_memory_cgroup() / f"bmoe-rpc-{tag}-{os.getpid()}"
    cgroup.mkdir(exist_ok=True)
    (cgroup / "memory.limit_in_bytes").write_text(str(WORKER_CAP))
    port = port or _free_port()
    cmd = [sys.executable, "-m", "bmoe.server", "rpc-worker", "--host", host,
           "--port", str(port), "--threads", "1", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    procs = str(cgroup / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    proc = subprocess.Popen(cmd, preexec_fn=enter, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    w = Worker(proc, rpc.Endpoint(host, port), cgroup)
    try:
        rpc.wait_for_worker(w.endpoint, 60)
        yield w
    finally:
        w.kill()
        if proc.stderr is not None:
            proc.stderr.close()
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _cli(model: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", str(model), "-p",
                          "The river ran past the old mill and", "--n-predict", "24",
                          "--threads", "1", "--no-moe-stream", "--progress", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _tokens(stdout: str) -> list[str]:
    """The answer after each token (the telemetry contract's BMOE_PROGRESS lines)."""
    return [json.loads(line.split(" ", 1)[1])["text"] for line in stdout.splitlines()
            if line.startswith("BMOE_PROGRESS ")]


# --- parsing, refusals ------------------------------------------------------------------

def test_endpoints_are_parsed_and_bad_ones_refused() -> None:
    assert rpc.parse_endpoints(" 10.0.0.2:50052, host-b:7 ") == (
        rpc.Endpoint("10.0.0.2", 50052), rpc.Endpoint("host-b", 7))
    for bad in ("10.0.0.2", "a:0", "a:70000", "a:1,a:1", "::1:5"):
        with pytest.raises(ValueError):
            rpc.parse_endpoints(bad)
    assert rpc.spelling(rpc.Endpoint("h", 5)) == "h:5"


def test_worker_refuses_a_network_address_without_allow_network() -> None:
    out = subprocess.run([sys.executable, "-m", "bmoe.server", "rpc-worker", "--host",
                          "0.0.0.0", "--port", str(_free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--allow-network" in out.stderr and "unauthenticated" in out.stderr


def test_unreachable_helper_is_refused_by_address(tmp_path: Path, split_model: Path) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    with worker("alive") as w:
        srv = start_server(tmp_path, "-m", str(split_model), "--rpc", f"{w.endpoint},{dead}")
        try:
            info = srv.wait_state("error", "ready")
            assert info["state"] == "error"
            text = json.dumps(info)
            assert dead in text and "cannot be reached" in text
            assert str(w.endpoint) not in text.split("cannot be reached", 1)[1]
            assert srv.proc.poll() is None                       # the server is up
        finally:
            srv.stop()
    out = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", str(split_model), "-p", "x",
                          "--rpc", dead], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and dead in out.stdout + out.stderr


# --- the same answer, token for token ---------------------------------------------------

def test_two_capped_workers_give_the_single_process_tokens(split_model: Path) -> None:
    alone = _tokens(_cli(split_model))
    assert len(alone) == 24
    with worker("a") as a, worker("b") as b:
        before = a.memory(), b.memory()
        split = _tokens(_cli(split_model, "--rpc", f"{a.endpoint},{b.endpoint}"))
        held = a.peak() - before[0], b.peak() - before[1]
    assert split == alone
    # Each helper held its layers (about 2 of the 4 layers' ~16 MB each) in its own memory.
    weights = split_model.stat().st_size
    assert all(h > weights * 0.2 for h in held), (held, weights)


def test_the_layers_left_here_stream_their_experts(split_model: Path) -> None:
    """Two helpers hold the last layer and the output; the three layers left here stream
    their experts through a cache smaller than them, and the tokens do not change."""
    alone = _tokens(_cli(split_model))
    with worker("s1") as a, worker("s2") as b:
        out = _cli(split_model, "--rpc", f"{a.endpoint},{b.endpoint}", "--rpc-layers", "2",
                   "--moe-stream", "--cache-mb", "4", "--force-cache")
    assert _tokens(out) == alone
    steps = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
             if line.startswith("BMOE_PROGRESS ")]
    read = sum(step["read_mb"] for step in steps)
    assert read > 0, "the local layers' experts were read through the cache"
    # never more than the three local layers' routed experts per token (their reads
    # rounded out to whole pages): one expert of the helper's layer read here would add
    # a whole unit beyond that
    layout = read_layout(split_model)
    local = sum(layout.unit_bytes(layer) for layer in (0, 1, 2)) * layout.n_expert_used
    most = max(step["read_mb"] for step in steps[1:]) * MIB
    assert most < local + layout.unit_bytes(3), (steps, local)


def test_worker_in_a_network_namespace_over_veth(split_model: Path) -> None:
    alone = _tokens(_cli(split_model))
    with veth_namespace("rpc", f"10.215.{os.getpid() % 250}") as peer:
        with worker("ns", host=peer.ns_ip, netns=peer.ns, extra=("--allow-network",)) as w:
            held0 = w.memory()
            split = _tokens(_cli(split_model, "--rpc", str(w.endpoint)))
            held = w.peak() - held0
    assert split == alone
    assert held > split_model.stat().st_size * 0.5      # every layer went to the helper


# --- a helper lost in the middle of a turn ----------------------------------------------

def _stream_until_killed(url: str, victim: Worker) -> tuple[int, str]:
    """Stream a long answer; kill `victim` after a few tokens; (tokens seen, tail)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Tell a long story"}],
                       "max_tokens": 4000, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    seen, tail = 0, ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tail = line
            if '"content"' in line:
                seen += 1
                if seen == 5:
                    victim.kill()
    return seen, tail


def test_worker_killed_mid_turn_ends_the_turn_and_the_server_stays_up(
        tmp_path: Path, split_model: Path) -> None:
    with worker("k1") as a, worker("k2") as b:
        srv = start_server(tmp_path, "-m", str(split_model), "--rpc",
                           f"{a.endpoint},{b.endpoint}", "-c", "8192")
        try:
            info = srv.info()
            assert info["state"] == "ready"
            helpers = [d for d in info["devices"] if d["kind"] == "rpc"]
            assert [d["endpoint"] for d in helpers] == [str(a.endpoint), str(b.endpoint)]
            assert sum(d["layers"] for d in helpers) == 5        # 4 layers and the output
            assert all(d["layers"] >= 2 and d["status"] == "ok" for d in helpers)
            seen, tail = _stream_until_killed(srv.url, b)
            assert 5 <= seen < 4000
            assert "stopped answering" in tail and str(b.endpoint) in tail, tail
            assert srv.proc.poll() is None
            status, _, info = srv.request("GET", "/api/info")
            assert status == 200
            assert [d["status"] for d in info["devices"] if d["kind"] == "rpc"] == ["lost"] * 2
            # The next turn is refused with the same sentence until a reload.
            status, _, body = srv.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "again"}], "max_tokens": 4})
            assert status >= 400 and "loaded again" in json.dumps(body)
            # A helper back on the same address: the reload reaches it afresh (not
            # ggml-rpc's dead connection), and the other helper serves again.
            with worker("k3", port=b.endpoint.port):
                status, _, _ = srv.request("POST", "/api/session/load",
                                           {"model": str(split_model)})
                assert status == 202
                assert srv.wait_state("ready", "error")["state"] == "ready"
                status, _, body = srv.request("POST", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "again"}], "max_tokens": 4})
                assert status == 200, body
                assert body["usage"]["completion_tokens"] >= 1
        finally:
            srv.stop()


def test_plan_lists_the_helpers_with_their_memory_and_layers(split_model: Path) -> None:
    from bmoe.planner.helpers import helper_rows
    from bmoe.planner.plan import Plan

    dead = f"127.0.0.1:{_free_port()}"
    with worker("p1") as a, worker("p2") as b:
        rows, pools = helper_rows({"rpc": f"{a.endpoint},{b.endpoint},{dead}"}, split_model)
    by_name = {r["name"]: r for r in rows}
    for w in (a, b):
        row = by_name[str(w.endpoint)]
        assert row["uses"] == ["layers"] and row["status"] == "used" and row["own_memory"]
        assert row["memory_total"] > 0 and 0 < row["round_trip_s"] < 2.0
        assert row["token_ratio"] == 0.0                  # compute rate: not measured
    assert by_name[dead]["status"] == "unusable" and dead in by_name[dead]["why"]
    assert [p["name"] for p in pools] == [str(a.endpoint), str(b.endpoint)]
    layers = rpc.layer_bytes(split_model)
    assert sum(p["held_bytes"] for p in pools) == sum(layers)    # every layer, once
    plan = Plan("m", "experts-stream", "s", "machine", [], {}, {}, [], {},
                helpers=rows, helper_pools=pools)
    body = plan.to_json()
    assert [d["name"] for d in body["devices"]][:3] == ["CPU", str(a.endpoint), str(b.endpoint)]
    assert body["devices_none"] == ""
    assert str(a.endpoint) in body["summary"]["lanes"][1]["on"]


def test_server_plan_lists_the_helpers_once_the_model_is_unloaded(
        tmp_path: Path, split_model: Path) -> None:
    with worker("s1") as a, worker("s2") as b:
        srv = start_server(tmp_path, "-m", str(split_model), "--rpc",
                           f"{a.endpoint},{b.endpoint}")
        try:
            assert srv.info()["state"] == "ready"
            assert srv.request("POST", "/api/session/unload", {})[0] in (200, 202)
            srv.wait_state("empty")
            status, _, plan = srv.request("GET", "/api/plan?measure=1", timeout=300)
            assert status == 200, plan
            helpers = {d["name"]: d for d in plan["devices"] if not d["cpu"]}
            assert set(helpers) == {str(a.endpoint), str(b.endpoint)}
            assert all(d["uses"] == ["layers"] and d["status"] == "used"
                       for d in helpers.values())
            names = [p["name"] for p in plan["memory"]["pools"]]
            assert str(a.endpoint) in names and str(b.endpoint) in names
            # Where the server connects is not an API setting.
            status, _, body = srv.request("PUT", "/api/config",
                                          {"values": {"rpc": "10.9.9.9:50052"}})
            assert "rpc" in body["rejected"] and "when the server starts" in body["rejected"]["rpc"]
            assert srv.request("GET", "/api/config")[2]["values"]["rpc"] == \
                f"{a.endpoint},{b.endpoint}"
        finally:
            srv.stop()


# --- a helper that passes the handshake, then hangs up ----------------------------------

class HangUpHelper:
    """Speaks the RPC protocol as far as HELLO, the device count and the device memory
    (what bmoe checks before a load), then closes the connection at the first command
    llama.cpp's load sends: ggml-rpc's client aborts there, in the middle of the load."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.endpoint = rpc.Endpoint("127.0.0.1", self.sock.getsockname()[1])
        self.hung_up = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self._client(conn)

    def _client(self, conn: socket.socket) -> None:
        replies = {rpc.RPC_CMD_HELLO: bytes([rpc.RPC_PROTO_MAJOR, 0, 0, 0]) + bytes(24),
                   rpc.RPC_CMD_DEVICE_COUNT: struct.pack("<I", 1),
                   rpc.RPC_CMD_GET_DEVICE_MEMORY: struct.pack("<QQ", 1 << 30, 1 << 30)}
        while True:
            head = conn.recv(9, socket.MSG_WAITALL)
            if len(head) < 9:
                return
            cmd, size = struct.unpack("<BQ", head)
            if size:
                conn.recv(size, socket.MSG_WAITALL)
            if cmd not in replies:
                self.hung_up += 1
                return
            conn.sendall(struct.pack("<Q", len(replies[cmd])) + replies[cmd])

    def close(self) -> None:
        self.sock.close()


def test_helper_lost_during_the_load_fails_the_load_not_the_server(
        tmp_path: Path, split_model: Path) -> None:
    fake = HangUpHelper()
    try:
        out = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", str(split_model), "-p",
                              "x", "--rpc", str(fake.endpoint)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-2000:]           # not 134 (abort)
        assert f"{fake.endpoint} stopped answering while the model loaded" in out.stderr
        srv = start_server(tmp_path, "-m", str(split_model), "--rpc", str(fake.endpoint))
        try:
            info = srv.wait_state("error", "ready")
            assert info["state"] == "error" and "while the model loaded" in info["error"]
            assert srv.proc.poll() is None and srv.info()["state"] == "error"
        finally:
            srv.stop()
        assert fake.hung_up >= 2
    finally:
        fake.close()
