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

    def __init__(self, data: Path, *args: str, env: dict[str, str] | None = None,
                 session: bool = False) -> None:
        self.log = data.parent / f"{data.name}-stderr-{time.monotonic_ns()}.txt"
        cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
               "--no-auto", "--threads", "1", "-c", "256", *args]
        with open(self.log, "w") as err:                # the child keeps its own copy
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                  **(env or {})), start_new_session=session)
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


@pytest.mark.parametrize("to", ["child", "group"])
def test_ctrl_c_keeps_the_part_and_the_next_start_resumes(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str], to: str) -> None:
    """SIGINT to the server alone, and to its process group as a terminal's Ctrl-C sends
    it (curl gets it too)."""
    h, info = hub
    size = info["slow"].stat().st_size
    h.fault(SLOW, SLOW_FILE, rate=max(1, size // 20))          # about 20 s for the file
    data = tmp_path / "data"
    part = data / "models" / f"{SLOW_FILE}.part"
    run = Launched(data, *site, "-hf", SLOW, session=to == "group")
    deadline = time.monotonic() + 30
    while not (part.is_file() and part.stat().st_size > size // 10):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr
        time.sleep(0.1)
    if to == "group":
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
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


def test_a_download_that_fails_its_digest_says_so(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, _ = hub
    h.fault(SPLIT, f"F32/{SHARDS[1]}", wrong=True)
    done = models(tmp_path / "d", "--local", *site, "pull", SPLIT, ok=False)
    assert done.returncode == 1, done.stderr
    assert f"{SHARDS[1]}: its SHA-256 does not match" in done.stderr, done.stderr
    assert "What came is kept" not in done.stderr, done.stderr    # the part was deleted
    assert (tmp_path / "d" / "models" / SHARDS[0]).is_file()      # the good shard stays


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


def test_ctrl_c_on_a_pull_through_a_server_cancels_its_download_and_keeps_the_part(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]], site: list[str]) -> None:
    h, info = hub
    size = info["slow"].stat().st_size
    h.fault(SLOW, SLOW_FILE, rate=max(1, size // 20))
    srv = models_server(tmp_path / "server-data", h)
    port = srv.url.rsplit(":", 1)[1]
    try:
        folder = Path(srv.request("GET", "/api/models")[2]["models_dir"])
        part = folder / f"{SLOW_FILE}.part"
        cmd = [sys.executable, "-m", "bmoe.server", "models", "--data-dir",
               str(tmp_path / "cli"), *site, "--port", port, "pull", SLOW]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (part.is_file() and part.stat().st_size > size // 10):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, (out, err)
        assert f"interrupted: kept {SLOW_FILE}.part" in err, err
        row = next(r for r in srv.request("GET", "/api/models")[2]["catalog"]
                   if r.get("repo") == SLOW)
        assert row["status"] == "available" and row["partial"], row   # cancelled, part kept
        kept = part.stat().st_size
        time.sleep(1)
        assert part.stat().st_size == kept                            # nothing writes it
        h.clear()
        models(tmp_path / "cli", *site, "--port", port, "pull", SLOW)
        assert sha(folder / SLOW_FILE) == sha(info["slow"])
        (resumed,) = fetched(h)
        assert int(resumed["range"][6:].split("-")[0]) >= kept, resumed
    finally:
        srv.stop()


# -- the choice and the progress, without the network -----------------------------------

def _row(name: str, role: str = "model", complete: bool = True) -> dict[str, Any]:
    return {"name": name, "role": role, "complete": complete, "files": [{"path": name}]}


def test_the_choice_of_a_quantization() -> None:
    from bmoe.models.choose import choose, projector
    from bmoe.models.errors import ModelsError
    rows = [_row("m-Q8_0.gguf"), _row("m-Q4_0.gguf"), _row("m-Q4_K_M.gguf", complete=False),
            _row("sub/m-IQ4_XS-00001-of-00002.gguf"), _row("mmproj-m-Q8_0.gguf", "projector"),
            _row("mmproj-m-F16.gguf", "projector")]
    assert choose("o/r", rows).name == "m-Q4_0.gguf"        # Q4_K_M is not whole
    assert "the first of the preference order" in choose("o/r", rows).why
    assert choose("o/r", rows, "q8_0").name == "m-Q8_0.gguf"
    assert choose("o/r", rows, "IQ4_XS").name == "sub/m-IQ4_XS-00001-of-00002.gguf"
    with pytest.raises(ModelsError) as missing:
        choose("o/r", rows, "Q2_K")
    assert missing.value.message == "o/r has no Q2_K model (it has Q8_0, Q4_0, IQ4_XS)."
    assert choose("o/r", rows, file="m-Q8_0.gguf").name == "m-Q8_0.gguf"
    with pytest.raises(ModelsError):
        choose("o/r", rows, file="m-Q4_K_M.gguf")               # a set with shards missing
    assert choose("o/r", [_row("odd.gguf"), _row("x-Q3_K_XL.gguf")]).name == "odd.gguf"
    paired = projector(rows, rows[0])
    assert paired is not None and paired["name"] == "mmproj-m-F16.gguf"
    assert projector(rows[:2], rows[0]) is None


def test_plain_progress_lines_per_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    from bmoe.server import progress
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    view = progress.open_view(out, [("a-00001-of-00002.gguf", 4_000_000),
                                    ("a-00002-of-00002.gguf", 2_000_000)])
    for t, got in ((1, 1_000_000), (1.5, 2_000_000), (3.5, 3_000_000), (4, 4_500_000),
                   (7, 6_000_000)):
        clock[0] = t
        view.update(got)
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "a-00001-of-00002.gguf: 1.0 MB of 4.0 MB (25%), 1.0 MB/s, 3 s left"
    assert "a-00001-of-00002.gguf: 4.0 MB, whole" in lines
    assert lines[-1] == "a-00002-of-00002.gguf: 2.0 MB, whole"
    assert len(lines) == 5, lines                 # at most one line per shard each 2 s
    assert progress.shard_bytes([("a", 4), ("b", 2)], 5) == [4, 1]
