"""The expert reader's ways of reading (AIO, lanes, pieces) land the same bytes."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bmoe.engine.experts import reader as reader_mod
from bmoe.engine.experts.memory import PAGE, AnonBuffer, PageSupply
from bmoe.engine.experts.reader import FRESH, ExpertReader, Read

TENSOR_AT, SLICE, N_SLICES = 3 * PAGE + 160, 70_000, 24    # unaligned, as a GGUF's are


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "slices.bin"
    data = np.random.default_rng(3).integers(0, 256, TENSOR_AT + SLICE * N_SLICES + 5000,
                                             dtype=np.uint8)
    path.write_bytes(data.tobytes())
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    return path


def read_slices(path: Path, mode: str, chunk: int = 0, fresh: bool = False
                ) -> tuple[bytes, ExpertReader]:
    reader = ExpertReader(str(path), 4, True, chunk=chunk)
    reader.mode = mode
    buf = AnonBuffer(TENSOR_AT, SLICE * N_SLICES)
    if fresh:
        reader.supply = PageSupply()
    try:
        picks = [1, 2, 3, 7, 11, 12, 20, 23]
        reads = []
        for e in picks:
            moves: tuple[tuple[int, int, int], ...] = ()
            dst, n = buf.interior(e * SLICE, (e + 1) * SLICE)
            if fresh and n:
                moves = ((FRESH, dst, n),)
            reads.append(Read(TENSOR_AT + e * SLICE, SLICE, buf, e * SLICE, moves))
        got, _ = reader.read_all(reads)
        assert got >= SLICE * len(picks)
        out = b"".join(bytes(buf.view[buf.phase + e * SLICE:buf.phase + (e + 1) * SLICE])
                       for e in picks)
        return out, reader
    finally:
        reader.close()
        buf.close()


def expected(path: Path) -> bytes:
    data = path.read_bytes()
    return b"".join(data[TENSOR_AT + e * SLICE:TENSOR_AT + (e + 1) * SLICE]
                    for e in [1, 2, 3, 7, 11, 12, 20, 23])


@pytest.mark.parametrize("mode", ["aio", "lanes", "first", "pipe"])
@pytest.mark.parametrize("fresh", [False, True], ids=["faulted", "fresh-pages"])
def test_every_mode_reads_the_slices(model_file: Path, mode: str, fresh: bool) -> None:
    got, reader = read_slices(model_file, mode, fresh=fresh)
    assert got == expected(model_file)
    assert reader.odirect


def test_aio_is_used_for_several_lanes(model_file: Path) -> None:
    reader = ExpertReader(str(model_file), 4, True)
    try:
        if reader.aio is None:
            pytest.skip("no Linux AIO here")
        assert ExpertReader(str(model_file), 1, True).aio is None
    finally:
        reader.close()


def test_pieces_read_the_same_bytes(model_file: Path) -> None:
    got, _ = read_slices(model_file, "aio", chunk=3 * PAGE, fresh=True)
    assert got == expected(model_file)


def test_a_read_aio_refuses_is_read_again_and_falls_back(
        model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any, fd: int, reads: list[tuple[int, int, int]]) -> list[int]:
        return [-errno.EINVAL] * len(reads)

    real_preadv = os.preadv

    def refuse_direct(fd: int, buffers: Any, offset: int) -> int:
        if fd == direct_fd[0]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    direct_fd = [-1]
    real_init = ExpertReader.__init__

    def init(self: ExpertReader, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        direct_fd[0] = self.direct_fd

    monkeypatch.setattr(reader_mod.Aio, "pread_all", refuse)
    monkeypatch.setattr(reader_mod.os, "preadv", refuse_direct)
    monkeypatch.setattr(ExpertReader, "__init__", init)
    got, reader = read_slices(model_file, "aio")
    assert got == expected(model_file)
    assert not reader.odirect and "refused" in reader.fallback_reason


def _present(addr: int, length: int) -> int:
    """Pages of [addr, addr + length) in memory now (mincore): no access, no fault."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (length // PAGE))()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec)


def test_reserve_commits_pages_that_give_hands_on() -> None:
    """`PageSupply.reserve` commits plain pages a chunk at a time and keeps them, while
    the room it is told of holds a chunk and up to its limit; `give` then hands them to
    a slice, which has every page present without having touched one (its read takes
    no page fault). A set `stop` ends it before the first chunk."""
    import threading
    chunk = 1 << 20
    sup = PageSupply(enabled=False, park_limit=4 * PAGE, reserve_limit=8 * chunk)
    room = 3 * chunk
    try:
        done, why = sup.reserve(lambda: room - sup.reserve_left, threading.Event(), chunk)
        assert (done, why) == (3 * chunk, "the cache holds its budget")
        assert sup.reserve_left == sup.reserved_bytes == 3 * chunk
        assert len(sup.reserved) == 3 and sup.parked_bytes == 0     # a chunk at a time
        buf = AnonBuffer(0, 2 * chunk)
        try:
            assert _present(buf.base, 2 * chunk) == 0
            assert sup.give(buf.base, 2 * chunk)
            assert _present(buf.base, 2 * chunk) == 2 * chunk // PAGE
            assert sup.reserve_left == chunk and sup.reserve_given_bytes == 2 * chunk
            assert sup.reused_bytes == 0            # that counts a victim's pages only
        finally:
            buf.close()
        room = 100 * chunk                      # the limit ends it now: 8 chunks in all
        sup.reserve_limit += PAGE                       # and a tail shorter than a chunk
        done, why = sup.reserve(lambda: room - sup.reserve_left, threading.Event(), chunk)
        assert (done, why) == (5 * chunk + PAGE, "reached its limit")
        assert sup.reserved_bytes == 8 * chunk + PAGE
        assert sup.reserve_left == 6 * chunk + PAGE
        stop = threading.Event()
        stop.set()
        assert sup.reserve(lambda: room, stop, chunk) == (0, "stopped")
    finally:
        sup.close()
    assert sup.reserve_left == 0 and not sup.reserved


def test_a_supply_closed_under_a_running_reserve_stops_it() -> None:
    """`close` while `reserve` commits from another thread: the reserve ends ("closed")
    at its next chunk without mapping anything again, and nothing stays kept."""
    import threading
    sup = PageSupply(enabled=False, reserve_limit=512 << 20)
    out: list[tuple[int, str]] = []
    t = threading.Thread(target=lambda: out.append(
        sup.reserve(lambda: 1 << 40, threading.Event(), chunk=1 << 20)))
    t.start()
    while sup.reserved_bytes < 4 << 20 and t.is_alive():
        threading.Event().wait(0.001)
    sup.close()
    t.join(30)
    assert not t.is_alive() and out and out[0][1] == "closed", out
    assert sup.reserve_left == 0 and not sup.reserved and sup._park is None
