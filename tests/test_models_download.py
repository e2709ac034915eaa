"""Downloads end to end, with real curl against the local hub: a split set downloads, is
listed complete, loads and answers; a cut resumes from the part; a stall and a host that
will not resume are retried; a wrong digest deletes the part; 507 on a small disk;
cancel keeps the part and a second start resumes it; delete partial; delete in use."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _hub import Hub
from _models_support import (SLOW, SPLIT, TINY, Events, download_events, models_server,
                             stock_hub, wait_download)
from conftest import ServerProcess


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("hub")
    h = Hub(folder)
    info = stock_hub(h, folder)
    yield h, info
    h.close()


@pytest.fixture
def srv(tmp_path: Path, hub: tuple[Hub, dict[str, Any]]) -> Iterator[tuple[ServerProcess, Events]]:
    h, _ = hub
    h.clear()
    s = models_server(tmp_path / "data", h, stall_s=2)
    ev = Events(s)
    yield s, ev
    ev.close()
    s.stop()


def add(s: ServerProcess, repo: str, name: str) -> str:
    status, _, body = s.request("POST", "/api/hf/add", {"repo": repo, "name": name})
    assert status == 201, body
    return str(body["id"])


def start(s: ServerProcess, eid: str) -> dict[str, Any]:
    status, _, body = s.request("POST", "/api/models/download", {"id": eid})
    assert status == 202, body
    return body


def row(s: ServerProcess, eid: str) -> dict[str, Any]:
    return next(c for c in s.request("GET", "/api/models")[2]["catalog"] if c["id"] == eid)


def models_dir(s: ServerProcess) -> Path:
    return Path(s.request("GET", "/api/models")[2]["models_dir"])


def test_split_set_downloads_lists_complete_loads_and_answers(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    eid = add(s, SPLIT, "F32/tiny-dense-F32-00001-of-00003.gguf")
    assert row(s, eid)["status"] == "available" and len(row(s, eid)["files"]) == 3
    start(s, eid)
    done = wait_download(ev, eid)
    assert done["state"] == "done", done
    assert done["received"] == done["total"] == sum(p.stat().st_size for p in hub[1]["shards"])
    files = [e["file"] for e in download_events(ev, eid)]
    assert files.index("tiny-dense-F32-00001-of-00003.gguf") < files.index(
        "tiny-dense-F32-00003-of-00003.gguf")
    r = row(s, eid)
    assert (r["status"], r["received"], r["partial"]) == ("on_disk", r["bytes"], False)
    local = [m for m in s.request("GET", "/api/models")[2]["local"]
             if m["name"] == "tiny-dense-F32-00001-of-00003.gguf"]
    assert local and local[0]["complete"] and local[0]["shards"] == 3
    assert not list(models_dir(s).glob("*.part"))
    status, _, body = s.request("POST", "/api/session/load", {"model": local[0]["path"]})
    assert status == 202, body
    assert s.wait_state("ready", "error")["state"] == "ready", s.info()
    status, _, body = s.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    assert status == 200 and body["choices"][0]["message"]["content"], body
    # a loaded model is not deleted
    status, _, body = s.request("DELETE", "/api/models/local/tiny-dense-F32-00001-of-00003.gguf")
    assert (status, body["code"]) == (409, "in_use"), body


def test_a_cut_at_40_percent_resumes_from_the_part(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    h, info = hub
    size = info["moe"].stat().st_size
    h.fault(TINY, "tiny-moe-F32.gguf", drop_at=0.4, times=1, rate=size // 3)
    eid = add(s, TINY, "tiny-moe-F32.gguf")
    start(s, eid)
    done = wait_download(ev, eid)
    assert done["state"] == "done", done
    sent = h.sent[f"{TINY}/tiny-moe-F32.gguf"]
    assert sent - size < 0.65 * size, (sent, size)
    retried = [e for e in download_events(ev, eid) if e["state"] == "running" and e["error"]]
    assert retried and "trying again" in retried[0]["error"], download_events(ev, eid)
    ranges = [r["range"] for r in h.requests if r["path"].startswith("/cdn/") and r["range"]]
    assert ranges and ranges[-1] != "bytes=0-", ranges
    assert (models_dir(s) / "tiny-moe-F32.gguf").read_bytes() == info["moe"].read_bytes()
    print(f"\nSENT {sent} bytes for a file of {size} (re-sent {sent - size})")
    for e in download_events(ev, eid):
        print("EVENT", json.dumps(e))


def test_a_stall_times_out_and_is_retried(srv: tuple[ServerProcess, Events],
                                          hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    h, info = hub
    h.fault(TINY, "tiny-moe-F32.gguf", stall_at=0.3, stall_s=8, times=1)
    eid = add(s, TINY, "tiny-moe-F32.gguf")
    start(s, eid)
    done = wait_download(ev, eid)
    assert done["state"] == "done", done
    errors = [e["error"] for e in download_events(ev, eid) if e["error"]]
    assert any("stalled" in e for e in errors), errors


def test_a_host_that_will_not_resume_is_fetched_again_from_the_start(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    h, info = hub
    h.fault(TINY, "tiny-moe-F32.gguf", drop_at=0.5, times=1, no_ranges=True)
    eid = add(s, TINY, "tiny-moe-F32.gguf")
    start(s, eid)
    done = wait_download(ev, eid)
    assert done["state"] == "done", done
    assert any("first byte" in e["error"] for e in download_events(ev, eid) if e["error"])
    assert (models_dir(s) / "tiny-moe-F32.gguf").read_bytes() == info["moe"].read_bytes()


def test_wrong_bytes_fail_the_digest_and_delete_the_part(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    h, _ = hub
    h.fault(TINY, "tiny-moe-F32.gguf", wrong=True)
    eid = add(s, TINY, "tiny-moe-F32.gguf")
    assert row(s, eid)["files"][0]["sha256"]
    start(s, eid)
    done = wait_download(ev, eid)
    assert done["state"] == "error" and "SHA-256" in done["error"], done
    assert not (models_dir(s) / "tiny-moe-F32.gguf.part").exists()
    assert not (models_dir(s) / "tiny-moe-F32.gguf").exists()
    assert row(s, eid)["partial"] is False


def test_cancel_keeps_the_part_then_resume_then_delete_partial(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, ev = srv
    h, info = hub
    size = info["slow"].stat().st_size
    h.fault(SLOW, "slow-moe-F32.gguf", rate=size // 8)         # about 8 s for the file
    eid = add(s, SLOW, "slow-moe-F32.gguf")
    start(s, eid)
    ev.wait("download", lambda d: d["id"] == eid and d["received"] > size // 10)
    assert s.request("POST", "/api/models/download", {"id": eid})[0] == 202   # one job only
    status, _, body = s.request("DELETE", f"/api/models/download/{eid}")
    assert status == 200 and body["cancelled"], body
    cancelled = wait_download(ev, eid, ("cancelled",))
    part = models_dir(s) / "slow-moe-F32.gguf.part"
    assert part.exists() and 0 < part.stat().st_size < size
    r = row(s, eid)
    assert (r["status"], r["partial"]) == ("available", True) and r["received"] > 0, r
    assert cancelled["received"] == r["received"]
    # resume: the hub is asked for the rest only
    kept = part.stat().st_size
    h.fault(SLOW, "slow-moe-F32.gguf", rate=size * 4)
    h.requests.clear()
    start(s, eid)
    assert wait_download(ev, eid, ("done", "error"))["state"] == "done"
    cdn = [r for r in h.requests if r["path"].startswith("/cdn/") and r["method"] == "GET"]
    assert cdn[0]["range"] == f"bytes={kept}-", cdn
    assert (models_dir(s) / "slow-moe-F32.gguf").read_bytes() == info["slow"].read_bytes()
    # delete partial: nothing partial left; then make one and delete it
    assert s.request("DELETE", f"/api/models/partial/{eid}")[2] == {"ok": True, "freed": 0}
    (models_dir(s) / "slow-moe-F32.gguf").rename(part)
    assert row(s, eid)["partial"] is True
    status, _, body = s.request("DELETE", f"/api/models/partial/{eid}")
    assert status == 200 and body == {"ok": True, "freed": size}
    assert not part.exists() and row(s, eid)["received"] == 0
    assert s.request("DELETE", "/api/models/partial/nope")[0] == 404


def test_507_before_a_byte_moves_when_the_disk_cannot_take_it(
        tmp_path: Path, hub: tuple[Hub, dict[str, Any]]) -> None:
    h, info = hub
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        s = models_server(tmp_path / "data", h, "--models-dir", str(small))
        try:
            eid = add(s, TINY, "tiny-moe-F32.gguf")
            h.requests.clear()
            status, _, body = s.request("POST", "/api/models/download", {"id": eid})
            assert (status, body["code"]) == (507, "no_space"), body
            assert "GB more, only" in body["error"] and "free" in body["error"]
            assert not any(r["path"].startswith("/cdn/") and r["method"] == "GET"
                           for r in h.requests)
            assert not list(small.iterdir())
        finally:
            s.stop()
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(small)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)


def test_a_download_survives_its_client_leaving(
        srv: tuple[ServerProcess, Events], hub: tuple[Hub, dict[str, Any]]) -> None:
    """The client that started it reads the 202 and closes; the job is the server's."""
    s, ev = srv
    h, info = hub
    size = info["slow"].stat().st_size
    h.fault(SLOW, "slow-moe-F32.gguf", rate=size // 2)
    eid = add(s, SLOW, "slow-moe-F32.gguf")
    port = int(s.url.rsplit(":", 1)[1])
    body = json.dumps({"id": eid}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /api/models/download HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (port, len(body), body))
        assert sock.recv(12) == b"HTTP/1.1 202"
    assert s.request("GET", "/api/models")[2]["catalog"][-1]["status"] == "downloading"
    assert wait_download(ev, eid)["state"] == "done"
    assert (models_dir(s) / "slow-moe-F32.gguf").stat().st_size == size
