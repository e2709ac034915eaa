"""What a service needs of a running bmoe-server, against real processes: --autoload
(after an unload, after a restart), --log-file, a clean stop on SIGTERM during a
streaming answer, settings that survive kill -9 in the middle of writes, and the
command a service registers, run as the init system would run it.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bmoe.service import NAME, units
from tests._e2e_support import JSON_TYPE, Conn, port_of, request_bytes, wait_for
from tests.conftest import ServerProcess, start_server
from tests.test_service import _tools, home, service  # noqa: F401 - the fixture, by name

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def _chat(server: ServerProcess) -> tuple[int, dict]:  # type: ignore[type-arg]
    status, _, body = server.request("POST", "/v1/chat/completions", CHAT, timeout=120)
    return status, body


def _stop(server: ServerProcess, timeout: float = 60) -> int:
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout)
    if server.proc.stdout is not None:
        server.proc.stdout.close()
    return rc


# --- --autoload ---------------------------------------------------------------------------

def test_autoload_after_an_unload(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path / "a", "--autoload", "-m", str(tiny_moe), "-c", "2048")
    try:
        assert srv.info()["state"] == "ready"
        assert srv.request("POST", "/api/session/unload")[0] == 200
        assert srv.info()["state"] == "empty"
        status, body = _chat(srv)                       # waits for the load it starts
        assert status == 200, body
        assert body["choices"][0]["message"] is not None
        info = srv.info()
        assert info["state"] == "ready" and info["model"]["name"] == tiny_moe.name
    finally:
        srv.stop()
    plain = start_server(tmp_path / "b", "-m", str(tiny_moe), "-c", "2048")
    try:
        assert plain.request("POST", "/api/session/unload")[0] == 200
        status, body = _chat(plain)                     # without the flag: refused as before
        assert status == 503 and body["code"] == "no_model", body
        assert plain.info()["state"] == "empty"
    finally:
        plain.stop()


def test_autoload_after_a_restart(tmp_path: Path, tiny_moe: Path) -> None:
    data = tmp_path / "data"
    first = start_server(data, "-c", "2048", wait_ready=False)
    try:
        status, _, body = first.request("PUT", "/api/config",
                                        {"values": {"model": str(tiny_moe)}})
        assert status == 200 and body["values"]["model"] == str(tiny_moe)
        assert first.info()["state"] == "empty"
    finally:
        assert _stop(first) == 0
    # without --autoload the saved model is not loaded at start (only -m is)
    plain = start_server(data, "-c", "2048", wait_ready=False)
    try:
        time.sleep(1.0)
        assert plain.info()["state"] == "empty"
        status, body = _chat(plain)
        assert status == 503 and body["code"] == "no_model"
    finally:
        assert _stop(plain) == 0
    auto = start_server(data, "-c", "2048", "--autoload")
    try:
        info = auto.info()
        assert info["state"] == "ready" and info["model"]["name"] == tiny_moe.name, info
        assert _chat(auto)[0] == 200
    finally:
        assert _stop(auto) == 0


def test_autoload_with_no_model_chosen(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    srv = start_server(tmp_path / "data", "--autoload", "--log-file", str(log), wait_ready=False)
    try:
        status, body = _chat(srv)
        assert status == 503 and body["code"] == "no_model", body
        assert "choose one" in body["error"]
        assert srv.info()["state"] == "empty"
    finally:
        assert _stop(srv) == 0
    assert "autoload: no model is selected yet" in log.read_text()


# --- a clean stop -------------------------------------------------------------------------

def test_sigterm_during_a_streaming_answer(tmp_path: Path, tiny_moe: Path) -> None:
    data, log = tmp_path / "data", tmp_path / "logs" / "server.log"
    srv = start_server(data, "-m", str(tiny_moe), "-c", "8192", "--log-file", str(log))
    port = port_of(srv)
    status, _, _ = srv.request("PUT", "/api/config", {"values": {"temp": 0.5, "top-k": 7}})
    assert status == 200
    saved = (data / "settings.json").read_text()
    conn = Conn(port, timeout=60)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Tell a long story"}],
                           "stream": True}).encode()          # no max_tokens: up to the context
        conn.send(request_bytes("POST", "/v1/chat/completions", host=f"127.0.0.1:{port}",
                                headers=[JSON_TYPE], body=body))
        status, headers = conn.read_head()
        assert status == 200
        wait_for(lambda: conn._more() and conn.buf.count(b"data: ") >= 5, 60,
                 "the first chunks")
        srv.proc.send_signal(signal.SIGTERM)
        stream = conn._read_chunked().decode()                 # ends with the last chunk
    finally:
        conn.close()
    rc = srv.proc.wait(60)
    assert rc == 0
    events = [line[len("data: "):] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
              if json.loads(e).get("choices")]
    assert finish[-1] is not None and all(f is None for f in finish[:-1]), finish[-3:]
    assert (data / "settings.json").read_text() == saved
    values = json.loads(saved)["values"]
    assert values["temp"] == 0.5 and values["top-k"] == 7
    lines = log.read_text().splitlines()
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines)
    assert sum("stopping on SIGTERM" in line for line in lines) == 1
    assert any("listening on http://127.0.0.1:" in line for line in lines)
    assert any("bmoe: answer:" in line for line in lines)      # the cancelled answer's line
    srv.proc.stdout.close()  # type: ignore[union-attr]


def test_sigint_stops_an_idle_server_with_status_0(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "data", wait_ready=False)
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(60) == 0
    srv.proc.stdout.close()  # type: ignore[union-attr]


# --- settings and kill -9 -----------------------------------------------------------------

WRITER = """
import sys
from pathlib import Path
from bmoe.runtime.config import ConfigStore
store = ConfigStore(Path(sys.argv[1]), {})
for i in range(1, 101):
    store.put({"seed": i, "temp": i / 100}, [], peer_is_local=True, model_dirs=[])
    print(i, flush=True)
"""


def test_kill_9_during_100_settings_writes(tmp_path: Path) -> None:
    """Killed at a random write of 100, settings.json is always a whole earlier write."""
    rng = random.Random(17)
    for round_ in range(8):
        data = tmp_path / f"r{round_}"
        target = rng.randint(1, 99)
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(data)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        done = 0
        for line in child.stdout:
            done = int(line)
            if done >= target:
                child.kill()                    # SIGKILL, somewhere after write `done`
                break
        child.wait()
        child.stdout.close()
        # The writer runs ahead of this reader: lines still in the pipe are writes that
        # finished before the kill landed, so the file holds write `done` or a later one,
        # always whole (seed and temp from the same write), never an earlier one.
        saved = json.loads((data / "settings.json").read_text())["values"]
        assert done <= saved["seed"] <= 100 and saved["temp"] == saved["seed"] / 100


def test_kill_9_server_during_settings_puts(tmp_path: Path) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    srv = start_server(data, "--log-file", str(log), wait_ready=False)
    answered: list[int] = []

    def writes() -> None:
        for i in range(1, 101):
            try:
                status, _, _ = srv.request("PUT", "/api/config", {"values": {"seed": i}},
                                           timeout=10)
            except (OSError, http.client.HTTPException):   # the kill, mid-answer
                return
            if status == 200:
                answered.append(i)

    writer = threading.Thread(target=writes)
    writer.start()
    wait_for(lambda: len(answered) >= 50, 60, "50 settings writes")
    os.kill(srv.proc.pid, signal.SIGKILL)
    writer.join(30)
    srv.proc.wait(10)
    srv.proc.stdout.close()  # type: ignore[union-attr]
    seed = json.loads((data / "settings.json").read_text())["values"]["seed"]
    assert answered[-1] <= seed <= answered[-1] + 1
    # the log keeps every line the killed server wrote
    wait_for(lambda: "listening on" in log.read_text(), 10, "the log's lines")


def test_the_registered_command_serves(tmp_path: Path, home: Path, tiny_moe: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Install (through the stand-in), then run the unit's ExecStart= as systemd would."""
    _tools(tmp_path, monkeypatch, ["systemctl", "loginctl"])
    data = home / "data"
    monkeypatch.chdir(tiny_moe.parent)
    assert service(["install", "--data-dir", str(data), "--host", "0.0.0.0", "--port", "0",
                     "--threads", "1", "-c", "2048", "-m", tiny_moe.name, "--open"]) == 0
    key = (data / "api-key").read_text().strip()
    assert f"key:     {key}" in capsys.readouterr().out
    unit = (home / ".config" / "systemd" / "user" / f"{NAME}.service").read_text()
    cmd = units.systemd_command(unit)
    workdir = next(line.split("=", 1)[1] for line in unit.splitlines()
                   if line.startswith("WorkingDirectory="))
    monkeypatch.undo()                                  # the real PATH and HOME again
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    srv = ServerProcess(proc, line.split("listening on", 1)[1].strip(), data)
    try:
        assert srv.request("GET", "/api/info")[0] == 401       # beyond loopback: the key
        srv.key = key
        info = srv.wait_state("ready", "error")
        assert info["state"] == "ready" and info["model"]["name"] == tiny_moe.name
    finally:
        assert _stop(srv) == 0
    log = (data / "bmoe-server.log").read_text()
    assert "bmoe: loaded tiny-moe.gguf" in log and "stopping on SIGTERM" in log


def test_a_crash_leaves_its_lines_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    srv = start_server(tmp_path / "data", "--log-file", str(log), wait_ready=False)
    # The start-up line reaches the log through the tee; crash only once it is there.
    wait_for(lambda: log.exists() and "listening on" in log.read_text(), 30,
             "the start-up line in the log")
    os.kill(srv.proc.pid, signal.SIGSEGV)
    assert srv.proc.wait(30) == -signal.SIGSEGV
    srv.proc.stdout.close()  # type: ignore[union-attr]
    wait_for(lambda: "Segmentation fault" in log.read_text(), 10, "the crash in the log")
    text = log.read_text()
    assert "listening on" in text and "Fatal Python error: Segmentation fault" in text
