"""What the models tests share: a hub stocked with models, servers pointed at it, and a
reader of the server's event stream."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _gguf_files import make_model, split_model, write_kind
from _hub import Hub
from conftest import ServerProcess, start_server

TINY = "bmoe-test/tiny-moe-GGUF"
SPLIT = "bmoe-test/tiny-dense-split-GGUF"
GATED = "bmoe-test/gated-GGUF"
BIG = "bmoe-test/big-moe-GGUF"
SLOW = "bmoe-test/slow-GGUF"
BIG_NAME = "big-moe-120B-A5B-Q4_0.gguf"


def stock_hub(hub: Hub, folder: Path) -> dict[str, Any]:
    """Models on the hub; returns what the tests need to know of them."""
    moe = make_model(folder / "tiny-moe-F32.gguf")
    dense = make_model(folder / "tiny-dense.gguf", arch="qwen3")
    shards = split_model(dense, folder, "tiny-dense-F32", 3)
    slow = make_model(folder / "slow-moe-F32.gguf", n_layer=6, n_embd=128, n_ff_exp=64,
                      n_expert=16, seed=1)
    hub.add_file(TINY, "tiny-moe-F32.gguf", moe, downloads=300, likes=7)
    hub.add_file(TINY, "mmproj-tiny-F16.gguf",
                 write_kind(folder / "mmproj.gguf", arch="clip", kv={"general.type": "mmproj"}))
    hub.add_file(TINY, "tiny-moe-broken.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    for p in shards:
        hub.add_file(SPLIT, f"F32/{p.name}", p, downloads=200)
    hub.add_file(GATED, "gated-moe-F32.gguf", moe, gated=True, downloads=100)
    big_header, big_size = big_moe_header(folder / "big-header.gguf")
    hub.add_file(BIG, BIG_NAME, big_header, size=big_size, downloads=50)
    hub.add_file(SLOW, "slow-moe-F32.gguf", slow, downloads=10)
    return {"moe": moe, "dense": dense, "shards": shards, "slow": slow, "big_size": big_size}


def big_moe_header(path: Path) -> tuple[bytes, int]:
    """The header of a gpt-oss-120b-shaped MoE (36 layers x 128 experts, top 4, Q4_0),
    about 65 GB: a file much larger than this machine's memory. Only the header exists."""
    import gguf
    import numpy as np
    arch, n_layer, n_embd, n_ff, n_expert, vocab = "qwen3moe", 36, 2880, 2880, 128, 201088
    w = gguf.GGUFWriter(path=None, arch=arch)
    w.add_name("big-moe-120B")
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(4)
    q4 = gguf.GGMLQuantizationType.Q4_0
    infos: list[tuple[str, list[int], gguf.GGMLQuantizationType]] = [
        ("token_embd.weight", [vocab, n_embd], q4), ("output.weight", [vocab, n_embd], q4)]
    for i in range(n_layer):
        infos += [(f"blk.{i}.attn_q.weight", [n_embd * 2, n_embd], q4),
                  (f"blk.{i}.attn_k.weight", [512, n_embd], q4),
                  (f"blk.{i}.attn_v.weight", [512, n_embd], q4),
                  (f"blk.{i}.attn_output.weight", [n_embd, n_embd * 2], q4),
                  (f"blk.{i}.ffn_gate_inp.weight", [n_expert, n_embd], gguf.GGMLQuantizationType.F32),
                  (f"blk.{i}.ffn_gate_exps.weight", [n_expert, n_ff, n_embd], q4),
                  (f"blk.{i}.ffn_up_exps.weight", [n_expert, n_ff, n_embd], q4),
                  (f"blk.{i}.ffn_down_exps.weight", [n_expert, n_embd, n_ff], q4)]
    total = 0
    for name, shape, qt in infos:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        n = int(np.prod(shape)) // block * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), n, raw_dtype=qt)
        total += -(-n // 32) * 32
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    header = path.read_bytes()
    return header, -(-len(header) // 32) * 32 + total


def models_server(data: Path, hub: Hub, *args: str, stall_s: int = 30,
                  env: dict[str, str] | None = None) -> ServerProcess:
    return start_server(data, "--hf-endpoint", hub.url, "--hf-ca-file", hub.cert,
                        "--download-stall-s", str(stall_s), *args, env=env, wait_ready=False)


class Events:
    """Every event of a server's ``/api/events`` stream, read by a thread."""

    def __init__(self, server: ServerProcess) -> None:
        self.items: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        host, port = server.url.split("://", 1)[1].rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.conn.connect()
        self.sock = self.conn.sock
        self.conn.request("GET", "/api/events")
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.status
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        name = None
        try:
            for raw in self.resp:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: ") and name:
                    with self.lock:
                        self.items.append((name, json.loads(line[6:])))
        except Exception:  # noqa: BLE001 - the stream closed under the reader: done
            return

    def of(self, name: str, pred: Callable[[Any], bool] = lambda d: True) -> list[Any]:
        with self.lock:
            return [d for n, d in self.items if n == name and pred(d)]

    def wait(self, name: str, pred: Callable[[Any], bool], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.of(name, pred)
            if found:
                return found[-1]
            time.sleep(0.05)
        raise AssertionError(f"no {name} event matched within {timeout} s: {self.of(name)[-5:]}")

    def close(self) -> None:
        """Shut the socket first: a reader blocked in a read returns at once (closing the
        response alone would wait for the reader's lock)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(5)
        self.resp.close()
        self.conn.close()


def download_events(ev: Events, eid: str) -> list[dict[str, Any]]:
    return ev.of("download", lambda d: d["id"] == eid)


def wait_download(ev: Events, eid: str, states: tuple[str, ...] = ("done", "error", "cancelled"),
                  timeout: float = 90.0) -> dict[str, Any]:
    return ev.wait("download", lambda d: d["id"] == eid and d["state"] in states, timeout)


def curl_spy(folder: Path) -> tuple[dict[str, str], Path]:
    """A ``curl`` first on PATH that records its arguments, then runs the real one."""
    real = "/usr/bin/curl"
    log = folder / "curl-calls.jsonl"
    spy = folder / "spy-bin"
    spy.mkdir(exist_ok=True)
    script = spy / "curl"
    script.write_text(
        "#!/usr/bin/env python3\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"os.execv({real!r}, [{real!r}] + sys.argv[1:])\n")
    script.chmod(0o755)
    return {"PATH": f"{spy}:{os.environ.get('PATH', '')}"}, log
