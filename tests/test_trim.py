"""Memory given back when the server goes quiet (bmoe/server/trim.py): glibc's
malloc_trim returns freed heap pages, and the server asks for it once per quiet spell, on
the engine thread, never while a turn runs."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import pytest
import trio

from bmoe.engine.experts import streamer_factory
from bmoe.runtime.config import ConfigStore
from bmoe.runtime.events import EventBus
from bmoe.runtime.state import Runtime, ServerOptions
from bmoe.server import trim

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def test_malloc_trim_gives_freed_heap_pages_back() -> None:
    fn = trim.malloc_trim()
    if fn is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 * 1024, 1024           # 64 MiB in blocks under glibc's mmap threshold
    blocks = [libc.malloc(size) for _ in range(n)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, size)       # the pages are committed
    keep = libc.malloc(size)            # above them all: the heap's top cannot shrink
    for b in blocks:
        libc.free(b)
    before = rss_bytes()
    assert fn() == 1                    # memory went back
    after = rss_bytes()
    libc.free(keep)
    assert before - after >= 48 * 2**20, (before, after)


def test_the_server_trims_once_per_quiet_spell_on_the_engine_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_trim() -> int:
        calls.append(threading.current_thread().name)
        return 1

    monkeypatch.setattr(trim, "malloc_trim", lambda: fake_trim)
    monkeypatch.setattr(trim, "QUIET_S", 0.3)
    monkeypatch.setattr(trim, "POLL_S", 0.05)

    async def main() -> None:
        rt = Runtime(ServerOptions(data_dir=tmp_path), ConfigStore(tmp_path, {}), EventBus(),
                     streamer_factory=streamer_factory)
        async with trio.open_nursery() as nursery:
            rt.attach(nursery)
            try:
                rt.last_active = time.monotonic()
                await nursery.start(trim.run, rt)
                await trio.sleep(0.15)
                assert calls == []                       # not quiet long enough yet
                await trio.sleep(0.6)
                assert len(calls) == 1                   # once, not once per poll
                assert rt.heap_trims == 1                # counted for /metrics?process=1
                engine_thread = calls[0]
                assert engine_thread != threading.current_thread().name
                with rt.generation(threading.Event()):   # a turn runs for a while
                    await trio.sleep(0.6)
                    assert len(calls) == 1               # never during it
                await trio.sleep(0.15)
                assert len(calls) == 1                   # its end starts a new spell
                await trio.sleep(0.5)
                assert calls == [engine_thread, engine_thread]
                assert rt.heap_trims == 2
                with rt.active():                        # a model route under way
                    rt.last_active = time.monotonic() - 10
                    await trio.sleep(0.3)
                    assert len(calls) == 2
            finally:
                with trio.CancelScope(shield=True):
                    await rt.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
