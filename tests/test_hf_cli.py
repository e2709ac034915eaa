"""A model from the command line, against the local hub with real curl: `bmoe-server -hf
REPO[:QUANT]` (a split set fetched shard by shard, said and loaded, found at once the
second time, `--offline` with and without the files), a tag that does not exist, a gated
repository without a token, a cut connection resumed, Ctrl-C (SIGINT to the child)
keeping the part and the next start resuming it, a set the disk cannot hold refused
before a byte moves, and `bmoe-server models list/pull/rm/inspect` on the data folder and
through a running server (whose listing then has the download)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _hub import TOKEN, Hub
from _models_support import (GATED, SLOW, SPLIT, TINY, big_moe_header, models_server,
                             stock_hub)
from conftest import START_TIMEOUT_S, ServerProcess

HUGE = "bmoe-test/huge-moe-GGUF"
HUGE_NAME = "huge-moe-1000B-A5B-Q4_0.gguf"
SLOW_FILE = "slow-moe-F32.gguf"
SHARDS = [f"tiny-dense-F32-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("hub")
    h = Hub(folder)
    info = stock_hub(h, folder)
    header, _ = big_moe_header(folder / "huge-header.gguf")
    h.add_file(HUGE, HUGE_NAME, header, size=1 << 50)          # a petabyte: no disk holds it
    yield h, info
    h.close()


@pytest.fixture
def site(hub: tuple[Hub, dict[str, Any]]) -> list[str]:
    h, _ = hub
    h.clear()
    return ["--hf-endpoint", h.url, "--hf-ca-file", h.cert, "--download-stall-s", "5"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetched(h: Hub) -> list[dict[str, Any]]:
    """The downloads asked of the hub (its CDN): a file from its start or resumed, not a
    header's range read (`bytes=A-B`)."""
    return [r for r in h.requests if r["path"].startswith("/cdn/") and r["method"] == "GET"
            and (r["range"] is None or r["range"].endswith("-"))]


def header_reads(h: Hub) -> list[dict[str, Any]]:
    return [r for r in h.requests if r["path"].startswith("/cdn/") and r["method"] == "GET"
            and r["range"] and not r["range"].endswith("-")]


class Launched:
    """A bmoe-server started with a model's origin: stderr to a file, stdout's first line
    the address (or nothing, when the start was refused or interrupted)."""

    def __init__(self, data: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = data.parent / f"{data.name}-stderr-{time.monotonic_ns()}.txt"
        cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
               "--no-auto", "--threads", "1", "-c", "256", *args]
        with open(self.log, "w") as err:                # the child keeps its own copy
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                  **(env or {})))
        self.data = data

    @property
    def stderr(self) -> str:
        return self.log.read_text()

    def serving(self) -> ServerProcess:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, (line, self.stderr)
        srv = ServerProcess(self.proc, line.split("listening on", 1)[1].strip(), self.data)
        srv.wait_state("ready", "error")
        return srv

    def ended(self, timeout: float = START_TIMEOUT_S) -> int:
        rc = self.proc.wait(timeout)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return rc


def refused(data: Path, *args: str, env: dict[str, str] | None = None) -> str:
    run = Launched(data, *args, env=env)
    rc = run.ended()
    assert rc not in (0, 130), run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    return run.stderr


def models(data: Path, *args: str, env: dict[str, str] | None = None,
           ok: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bmoe.server", "models", "--data-dir", str(data), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))
    assert "Traceback" not in done.stderr, done.stderr
    if ok:
        assert done.returncode == 0, (done.stdout, done.stderr)
    return done


# -- -hf at start ----------------------------------------------------------------------

def test_split_set_fetched_loaded_then_found_at_once_and_offline(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, info = hub
    data = tmp_path / "data"
    run = Launched(data, *site, "-hf", SPLIT)
    srv = run.serving()
    try:
        assert srv.info()["state"] == "ready", (srv.info(), run.stderr)
        assert srv.info()["model"]["path"] == str(data / "models" / SHARDS[0])
    finally:
        srv.stop()
    said = run.stderr
    assert "no quantization named, so F32" in said, said
    verdict = said.index("disk: needs")
    assert verdict < said.index("fetching tiny-dense-F32-00001-of-00003.gguf"), said
    assert "in 3 files" in said, said
    for name, src in zip(SHARDS, info["shards"], strict=True):
        assert sha(data / "models" / name) == sha(src)
        assert f"{name}: " in said and "whole" in said, said
    assert {r["path"].rsplit("/", 1)[-1] for r in fetched(h)} == set(SHARDS)

    h.clear()
    run = Launched(data, *site, "-hfr", SPLIT)              # the second start: at once
    srv = run.serving()
    srv.stop()
    assert "not fetched" in run.stderr and fetched(h) == [], run.stderr
    run = Launched(data, *site, "--hf-repo", f"{SPLIT}:F32", "--offline")
    srv = run.serving()
    try:
        assert srv.info()["model"]["name"] == SHARDS[0]
    finally:
        srv.stop()
    assert h.requests == []                                 # --offline asks nothing
    said = refused(tmp_path / "empty", *site, "-hf", SPLIT, "--offline")
    assert "--offline fetches nothing" in said and h.requests == [], said


def test_a_tag_that_does_not_exist_lists_the_ones_that_do(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    said = refused(tmp_path / "d", *site, "-hf", f"{TINY}:Q2_K")
    assert f"{TINY} has no Q2_K model (it has F32;" in said, said
    done = models(tmp_path / "d", "--local", *site, "pull", f"{TINY}:Q2_K", ok=False)
    assert done.returncode == 1 and "has no Q2_K model (it has F32;" in done.stderr


def test_a_gated_repository_asks_for_a_token(tmp_path: Path, hub: tuple[Hub, dict[str, Any]],
                                             site: list[str]) -> None:
    h, info = hub
    said = refused(tmp_path / "d", *site, "-hf", GATED, env={"HF_TOKEN": ""})
    assert "gated" in said and "--hf-token" in said and "HF_TOKEN" in said, said
    done = models(tmp_path / "d", "--local", *site, "pull", GATED, env={"HF_TOKEN": ""},
                  ok=False)
    assert done.returncode == 1 and "Pass --hf-token TOKEN or set HF_TOKEN" in done.stderr
    models(tmp_path / "d", "--local", *site, "--hf-token", TOKEN, "pull", GATED)
    assert sha(tmp_path / "d" / "models" / "gated-moe-F32.gguf") == sha(info["moe"])
    (tmp_path / "d" / "models" / "gated-moe-F32.gguf").unlink()
    h.clear()
    models(tmp_path / "d", "--local", *site, "pull", GATED, env={"HF_TOKEN": TOKEN})
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in h.requests if "/api/" in r["path"])


def test_a_cut_connection_is_resumed(tmp_path: Path, hub: tuple[Hub, dict[str, Any]],
                                     site: list[str]) -> None:
    h, info = hub
    h.fault(SLOW, SLOW_FILE, drop_at=0.5, times=1)
    done = models(tmp_path / "d", "--local", *site, "pull", SLOW)
    assert sha(tmp_path / "d" / "models" / SLOW_FILE) == sha(info["slow"])
    ranges = [r["range"] for r in fetched(h)]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1] != "bytes=0-", ranges
    assert "trying again" in done.stdout and f"fetched {SLOW_FILE}" in done.stdout, done.stdout


def test_ctrl_c_keeps_the_part_and_the_next_start_resumes(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, info = hub
    size = info["slow"].stat().st_size
    h.fault(SLOW, SLOW_FILE, rate=max(1, size // 20))          # about 20 s for the file
    data = tmp_path / "data"
    part = data / "models" / f"{SLOW_FILE}.part"
    run = Launched(data, *site, "-hf", SLOW)
    deadline = time.monotonic() + 30
    while not (part.is_file() and part.stat().st_size > size // 10):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr
        time.sleep(0.1)
    run.proc.send_signal(signal.SIGINT)
    assert run.ended(30) == 130, run.stderr
    kept = part.stat().st_size
    assert 0 < kept < size
    assert f"interrupted: kept {SLOW_FILE}.part" in run.stderr, run.stderr
    assert "the same command resumes" in run.stderr, run.stderr

    h.clear()
    run = Launched(data, *site, "-hf", SLOW)
    srv = run.serving()
    try:
        assert srv.info()["state"] == "ready", run.stderr
    finally:
        srv.stop()
    assert sha(data / "models" / SLOW_FILE) == sha(info["slow"])
    (resumed,) = fetched(h)
    assert resumed["range"] and int(resumed["range"][6:].split("-")[0]) >= kept, resumed


def test_a_set_the_disk_cannot_hold_is_refused_before_it_starts(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, _ = hub
    said = refused(tmp_path / "d", *site, "-hf", HUGE)
    assert "Not enough disk" in said and f"{HUGE_NAME} was not fetched" in said, said
    assert fetched(h) == [] and not list((tmp_path / "d" / "models").iterdir())


# -- bmoe-server models ----------------------------------------------------------------

def test_models_verbs_on_the_data_folder(tmp_path: Path, hub: tuple[Hub, dict[str, Any]],
                                         site: list[str]) -> None:
    h, info = hub
    data = tmp_path / "data"
    listed = models(data, *site, "--port", "9", "list").stdout    # nothing answers on 9
    assert "from the data folder" in listed and "none" in listed, listed
    done = models(data, *site, "--port", "9", "pull", f"{TINY}:F32")
    assert "tiny-moe-F32.gguf (F32, as asked)" in done.stdout, done.stdout
    assert "its image projector mmproj-tiny-F16.gguf" in done.stdout, done.stdout
    assert sha(data / "models" / "tiny-moe-F32.gguf") == sha(info["moe"])
    assert (data / "models" / "mmproj-tiny-F16.gguf").is_file()
    listed = models(data, *site, "--port", "9", "list").stdout
    assert "tiny-moe-F32.gguf" in listed and "streams its experts" in listed, listed
    assert "mmproj-tiny-F16.gguf" in listed and "projector" in listed, listed
    again = models(data, *site, "--port", "9", "pull", TINY).stdout
    assert "already in" in again, again
    seen = models(data, *site, "--port", "9", "inspect", HUGE).stdout
    assert "Not enough disk" in seen and "verdict: no_disk" in seen, seen
    h.clear()
    seen = models(data, *site, "--port", "9", "inspect", SPLIT).stdout
    assert "verdict:" in seen and "in 3 files" in seen, seen
    assert fetched(h) == [] and header_reads(h), h.requests          # headers only
    gone = models(data, *site, "--port", "9", "rm", "tiny-moe-F32.gguf").stdout
    assert "removed tiny-moe-F32.gguf" in gone and "MB freed" in gone, gone
    assert not (data / "models" / "tiny-moe-F32.gguf").exists()
    missing = models(data, *site, "--port", "9", "rm", "nothing.gguf", ok=False)
    assert missing.returncode == 1 and "has no model 'nothing.gguf'" in missing.stderr


def test_models_verbs_through_a_running_server(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, info = hub
    srv = models_server(tmp_path / "server-data", h)
    port = srv.url.rsplit(":", 1)[1]
    elsewhere = tmp_path / "cli-data"          # the CLI's own data folder stays untouched
    try:
        listed = models(elsewhere, *site, "--port", port, "list").stdout
        assert f"from the server at {srv.url}/" in listed, listed
        done = models(elsewhere, *site, "--port", port, "pull", SPLIT, "--no-mmproj")
        assert "in 3 files" in done.stdout, done.stdout
        served = srv.request("GET", "/api/models")[2]
        row = next(r for r in served["catalog"] if r.get("repo") == SPLIT)
        assert row["status"] == "on_disk", row                # the server's UI sees it
        models_dir = Path(served["models_dir"])
        assert all((models_dir / n).is_file() for n in SHARDS)
        assert not (elsewhere / "models").exists() or not list((elsewhere / "models").iterdir())
        listed = models(elsewhere, *site, "--port", port, "list").stdout
        assert SHARDS[0] in listed and "3 shards" in listed, listed
        seen = models(elsewhere, *site, "--port", port, "inspect", TINY).stdout
        assert "verdict:" in seen, seen
        gone = models(elsewhere, *site, "--port", port, "rm", SHARDS[0]).stdout
        assert f"removed {SHARDS[0]}" in gone, gone
        assert not any((models_dir / n).exists() for n in SHARDS)
        local = models(elsewhere, *site, "--port", port, "--local", "list").stdout
        assert "from the data folder" in local, local
    finally:
        srv.stop()
