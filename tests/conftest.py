"""Shared fixtures: models the project writes itself, and a real bmoe-server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from bmoe.modelmaker import make_model

START_TIMEOUT_S = 60.0

# Every bmoe-server a test starts (directly, through a helper, in a namespace) inherits
# this and stops within a second of pytest's end: a crashed run leaves nothing running.
os.environ["BMOE_PARENT_PID"] = str(os.getpid())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_moe(model_dir: Path) -> Path:
    return make_model(model_dir / "tiny-moe.gguf")


@pytest.fixture(scope="session")
def tiny_dense(model_dir: Path) -> Path:
    return make_model(model_dir / "tiny-dense.gguf", arch="qwen3")


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[str], url: str, data_dir: Path) -> None:
        self.proc = proc
        self.url = url.rstrip("/")
        self.data_dir = data_dir
        self.key: str | None = None

    def request(self, method: str, path: str, body: Any = None, *,
                headers: dict[str, str] | None = None, raw: bytes | None = None,
                timeout: float = 60.0) -> tuple[int, dict[str, str], Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"} if method != "GET" else {}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        h.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                payload = resp.read()
                status, hdrs = resp.status, dict(resp.headers)
        except urllib.error.HTTPError as e:
            payload, status, hdrs = e.read(), e.code, dict(e.headers)
        try:
            return status, hdrs, json.loads(payload) if payload else None
        except ValueError:
            return status, hdrs, payload

    def info(self) -> dict[str, Any]:
        return self.request("GET", "/api/info")[2]

    def wait_state(self, *states: str, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if info["state"] in states:
                return info
            time.sleep(0.05)
        raise AssertionError(f"server never reached {states}: {self.info()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_server(data_dir: Path, *args: str, env: dict[str, str] | None = None,
                 wait_ready: bool = True, auto_plan: bool | None = False,
                 threads: int | None = 1) -> ServerProcess:
    """A bmoe-server on port 0. Loads do not plan first (``--no-auto``) unless the test
    says so: a plan would change the settings a test expects (its context size, its
    threads). ``auto_plan=None`` passes neither flag (the server's own default)."""
    flag = {True: ["--auto"], False: ["--no-auto"], None: []}[auto_plan]
    if "--auto" in args or "--no-auto" in args:
        flag = []
    if threads is not None:
        flag += ["--threads", str(threads)]
    cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data_dir),
           *flag, *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=full_env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"bmoe-server did not start: {line!r}")
    url = line.split("listening on", 1)[1].strip()
    server = ServerProcess(proc, url, data_dir)
    if wait_ready:
        server.wait_state("ready", "error")
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    """A bmoe-server on port 0 with the tiny MoE loaded (shared by read-only tests)."""
    data = tmp_path_factory.mktemp("server-data")
    srv = start_server(data, "-m", str(tiny_moe), "-c", "4096")
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


# -- a run that would hang at its end says why, and ends ---------------------------------
# Python waits at exit for every thread that is not a daemon (the engine's thread is not:
# it must finish what llama.cpp is doing). A test that leaves one running would make the
# whole run hang after its last test with no summary. Here such threads get 30 s to end;
# any still alive are named with their stacks and the run ends failed.

LEFT_THREADS_GRACE_S = 30.0


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import threading
    import traceback

    deadline = time.monotonic() + LEFT_THREADS_GRACE_S
    left = []
    for t in threading.enumerate():
        if t is threading.main_thread() or t.daemon:
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            left.append(t)
    if not left:
        return
    frames = sys._current_frames()
    out = [f"\n{len(left)} thread(s) that are not daemons were still running after the last "
           f"test (they would keep this run from ending): a test left them:"]
    for t in left:
        out.append(f"--- {t.name} (ident {t.ident})")
        frame = frames.get(t.ident or -1)
        if frame is not None:
            out.extend(line.rstrip() for line in traceback.format_stack(frame))
    print("\n".join(out), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(3)
