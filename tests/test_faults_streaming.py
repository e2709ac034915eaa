"""Faults in the model file while the expert streamer reads it (issue 35).

A real bmoe-server streams the experts of a tiny MoE (a 2 MiB cache for 3 MiB of experts,
so nearly every token reads) while its file misbehaves:

* read errors (EIO) and reads that hang, from a FUSE file system (`tests/_faultfs.py`:
  this kernel has no device-mapper, so no dm `error`/`delay` target; a FUSE read that
  answers -EIO or never answers reaches the reader's preadv and Linux AIO as a failing or
  hung disk does), with one reader lane (reads on a thread of their own) and with two
  (O_DIRECT through Linux AIO);
* the file truncated under the server, and replaced by another one (renamed over it), on
  the ordinary disk.

Each time: the turn ends with the spec's error (`500`, code `failed`; inside a stream that
had answered `200`, one `data: {"error": ...}` chunk) whose message names the file; what
was streamed before it is the start of the model's own answer (the same greedy turn with
the file whole); the process stays up and answers `/api/info` (during a hung read too);
and `POST /api/session/load` once the file is whole gives the model's answer again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bmoe.engine.experts.layout import read_layout
from bmoe.modelmaker import make_model

from conftest import ServerProcess, start_server

MOE = dict(n_layer=4, n_embd=128, n_expert=8, n_expert_used=4, n_ff_exp=64,
           residual_scale=0.3)
TIMEOUT_S = 3.0                       # BMOE_READ_TIMEOUT_S for the hang cases
PROMPT = "Hello there! What is the weather like in Paris and in London today?"
FAULTFS = Path(__file__).with_name("_faultfs.py")


def _fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian: fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy does not load ({e}; pip install mfusepy, apt-get install fuse3)"
    return None


class FaultFS:
    """tests/_faultfs.py mounted over a folder holding the model; `set()` changes the rule."""

    def __init__(self, root: Path, model: Path) -> None:
        self.back, self.mount, self.control = root / "back", root / "mnt", root / "rule.json"
        self.back.mkdir()
        self.mount.mkdir()
        shutil.copy(model, self.back / model.name)
        self.path = self.mount / model.name
        lay = read_layout(model)
        self.lo = min(t.offset for t in lay.experts)
        self.hi = max(t.offset + t.nbytes for t in lay.experts)
        self.set("ok")
        self.proc = subprocess.Popen([sys.executable, str(FAULTFS), str(self.back),
                                      str(self.mount), str(self.control)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the FUSE file system did not mount")
            time.sleep(0.05)

    def set(self, mode: str) -> None:
        if mode != "hang":
            self.forget_cache()
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mode": mode, "lo": self.lo, "hi": self.hi}))
        os.replace(tmp, self.control)

    def forget_cache(self) -> None:
        """Drop the file's pages from the page cache, so the next reads reach FUSE."""
        if os.path.ismount(self.mount):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.set("ok")
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], check=False)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("faults") / "moe.gguf", **MOE)


def serve(tmp: Path, model: Path, io_threads: int = 2, *flags: str) -> ServerProcess:
    srv = start_server(tmp / "data", "-m", str(model), "-c", "1024", "--moe-stream",
                       "--cache-mb", "2", "--io-threads", str(io_threads), *flags,
                       env={"BMOE_READ_TIMEOUT_S": str(TIMEOUT_S)})
    assert srv.info()["state"] == "ready", srv.info()
    return srv


def body(max_tokens: int = 40, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def answer(srv: ServerProcess, max_tokens: int = 40) -> str:
    status, _, out = srv.request("POST", "/v1/chat/completions", body(max_tokens))
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def stream_until_error(srv: ServerProcess, fault: Any, after: int = 3,
                       max_tokens: int = 300) -> tuple[str, openai.APIError | None]:
    """Stream a turn with the openai SDK; `fault()` after `after` content chunks. Returns
    the content received and the error the stream ended with."""
    text, seen = "", 0
    try:
        stream = client(srv).chat.completions.create(
            model="moe.gguf", messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                seen += 1
                if seen == after:
                    fault()
    except openai.APIError as e:
        return text, e
    return text, None


def assert_alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, "the server process ended"
    t0 = time.monotonic()
    info = srv.info()
    assert time.monotonic() - t0 < 2.0, "/api/info was slow to answer"
    assert info["state"] == "ready", info


def reload(srv: ServerProcess) -> None:
    status, _, out = srv.request("POST", "/api/session/load", {})
    assert status in (200, 202), out
    info = srv.wait_state("ready", "error")
    assert info["state"] == "ready", info


def assert_names_file(message: str, path: Path) -> None:
    assert str(path) in message, message
    assert "Errno" not in message and "Traceback" not in message, message


# -- read errors and hung reads (FUSE) ----------------------------------------------------


@pytest.fixture
def fused(tmp_path: Path, moe: Path) -> Iterator[FaultFS]:
    why = _fuse_missing()
    if why:
        pytest.skip(why)
    fs = FaultFS(tmp_path, moe)
    try:
        yield fs
    finally:
        fs.close()


@pytest.mark.parametrize(("io_threads", "flags"), [(1, ()), (2, ()), (2, ("--prefetch", "1"))],
                         ids=["one-lane", "aio", "queue"])
def test_read_errors_end_the_turn_with_the_files_name_and_a_reload_recovers(
        tmp_path: Path, fused: FaultFS, io_threads: int, flags: tuple[str, ...]) -> None:
    srv = serve(tmp_path, fused.path, io_threads, *flags)
    try:
        whole = answer(srv, 300)
        # streaming: the error arrives mid-answer, after the model's own first tokens
        text, err = stream_until_error(srv, lambda: fused.set("eio"))
        assert err is not None, "the stream ended without an error"
        assert_names_file(err.message, fused.path)
        assert "failed" in err.message and "Reading the model file" in err.message
        assert text and whole.startswith(text), (text, whole)
        assert_alive(srv)
        # not streaming: the spec's 500 with code failed
        status, _, out = srv.request("POST", "/v1/chat/completions", body())
        assert (status, out["code"]) == (500, "failed"), out
        assert_names_file(out["error"], fused.path)
        assert_alive(srv)
        fused.set("ok")
        reload(srv)
        assert answer(srv, 300) == whole
    finally:
        srv.stop()


# one lane; two (AIO: a layer's reads at once); two with read-ahead (the read queue: on
# AIO, its own thread submitting and reaping)
@pytest.mark.parametrize(("io_threads", "flags"), [(1, ()), (2, ()), (2, ("--prefetch", "1"))],
                         ids=["one-lane", "aio", "queue"])
def test_a_hung_read_times_out_with_the_files_name_and_a_reload_recovers(
        tmp_path: Path, fused: FaultFS, io_threads: int, flags: tuple[str, ...]) -> None:
    srv = serve(tmp_path, fused.path, io_threads, *flags)
    try:
        whole = answer(srv, 300)
        fused.forget_cache()
        t0 = time.monotonic()
        text, err = stream_until_error(srv, lambda: fused.set("hang"))
        took = time.monotonic() - t0
        assert err is not None, "the stream ended without an error"
        assert_names_file(err.message, fused.path)
        assert f"did not finish in {TIMEOUT_S:g} s" in err.message
        assert TIMEOUT_S <= took < TIMEOUT_S + 20, took
        assert whole.startswith(text), (text, whole)
        assert_alive(srv)
        # the engine thread is free: the next turn is refused at once (not after a timeout)
        # while the read is still stuck, and /api/info answers meanwhile
        result: dict[str, Any] = {}

        def turn() -> None:
            result["t0"] = time.monotonic()
            result["r"] = srv.request("POST", "/v1/chat/completions", body())
            result["s"] = time.monotonic() - result["t0"]

        th = threading.Thread(target=turn)
        th.start()
        assert_alive(srv)
        th.join(30)
        status, _, out = result["r"]
        assert (status, out["code"]) == (500, "failed"), out
        assert_names_file(out["error"], fused.path)
        assert result["s"] < TIMEOUT_S, result["s"]
        fused.set("ok")                 # the stuck read returns; the file is whole again
        reload(srv)
        assert answer(srv, 300) == whole
        assert_alive(srv)
    finally:
        srv.stop()


# -- the file truncated, or replaced, under the server (ordinary disk) -----------------------


def test_a_file_truncated_under_the_server_ends_the_turn_and_a_reload_recovers(
        tmp_path: Path, moe: Path) -> None:
    model = tmp_path / "moe.gguf"
    shutil.copy(moe, model)
    lay = read_layout(model)
    cut = min(t.offset for t in lay.experts) + 4096    # keeps the header and dense weights
    srv = serve(tmp_path, model)
    try:
        whole = answer(srv, 300)

        def truncate() -> None:
            os.truncate(model, cut)

        text, err = stream_until_error(srv, truncate)
        assert err is not None, "the stream ended without an error"
        assert_names_file(err.message, model)
        assert "ends early" in err.message or "changed size" in err.message, err.message
        assert whole.startswith(text), (text, whole)
        assert_alive(srv)
        # the next turn says so before it reads anything
        status, _, out = srv.request("POST", "/v1/chat/completions", body())
        assert (status, out["code"]) == (500, "failed"), out
        assert_names_file(out["error"], model)
        assert "changed size" in out["error"], out["error"]
        assert_alive(srv)
        # the whole file back (written aside and renamed into place), then a reload
        tmp = model.with_suffix(".part")
        shutil.copy(moe, tmp)
        os.replace(tmp, model)
        reload(srv)
        assert answer(srv, 300) == whole
    finally:
        srv.stop()


def test_a_file_replaced_under_the_server_is_refused_until_a_reload(
        tmp_path: Path, moe: Path) -> None:
    model = tmp_path / "moe.gguf"
    shutil.copy(moe, model)
    other = make_model(tmp_path / "other.gguf", seed=7, **MOE)
    srv = serve(tmp_path, model)
    try:
        whole = answer(srv)
        os.replace(other, model)          # renamed over it, as an update or a sync does
        status, _, out = srv.request("POST", "/v1/chat/completions", body())
        assert (status, out["code"]) == (500, "failed"), out
        assert_names_file(out["error"], model)
        assert "replaced by another file" in out["error"], out["error"]
        text, err = stream_until_error(srv, lambda: None)
        assert err is not None and text == "", (text, err)
        assert "replaced by another file" in err.message
        assert_alive(srv)
        reload(srv)                        # the new file loads and answers
        new = answer(srv)
        assert new and new != whole
        assert_alive(srv)
    finally:
        srv.stop()
