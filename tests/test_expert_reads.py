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


@pytest.mark.parametrize("mode", ["aio", "aio-first", "lanes", "first", "pipe"])
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
    def refuse(self: Any, fd: int, reads: list[tuple[int, int, int]],
               before: Any = None) -> list[int]:
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


def test_each_slices_pages_move_once_when_aio_refuses_some(
        model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AIO prepared (moved the pages of) the first read only, then refused them all: the
    retries move the rest, and none twice."""
    def refuse_after_one(self: Any, fd: int, reads: list[tuple[int, int, int]],
                         before: Any = None) -> list[int]:
        assert before is not None
        before(0)
        return [-errno.EAGAIN] * len(reads)

    moved: list[tuple[int, int, int]] = []
    real_recycle = ExpertReader._recycle

    def spy(self: ExpertReader, moves: tuple[tuple[int, int, int], ...]) -> None:
        moved.extend(moves)
        real_recycle(self, moves)

    monkeypatch.setattr(reader_mod.Aio, "pread_all", refuse_after_one)
    monkeypatch.setattr(ExpertReader, "_recycle", spy)
    got, _ = read_slices(model_file, "aio", fresh=True)
    assert got == expected(model_file)
    assert len(moved) == 8 and len(set(moved)) == 8     # every slice's pages, each once


def test_aio_waits_for_submitted_reads_when_preparing_one_fails(model_file: Path) -> None:
    aio = reader_mod.Aio.open(8)
    if aio is None:
        pytest.skip("no Linux AIO here")
    fd = os.open(model_file, os.O_RDONLY | os.O_DIRECT)
    buf = AnonBuffer(0, 8 * PAGE)
    prepared: list[int] = []

    def before(i: int) -> None:
        if i == 3:
            raise RuntimeError("no pages")
        prepared.append(i)

    try:
        with pytest.raises(RuntimeError, match="no pages"):
            aio.pread_all(fd, [(buf.base + i * PAGE, PAGE, i * PAGE) for i in range(6)], before)
        assert prepared == [0, 1, 2]
        data = model_file.read_bytes()
        assert bytes(buf.view[:3 * PAGE]) == data[:3 * PAGE]    # the submitted reads landed
        results = aio.pread_all(fd, [(buf.base + i * PAGE, PAGE, i * PAGE) for i in range(6)],
                                prepared.append)
        assert results == [PAGE] * 6 and prepared == [0, 1, 2, 0, 1, 2, 3, 4, 5]
        assert bytes(buf.view[:6 * PAGE]) == data[:6 * PAGE]
    finally:
        aio.close()
        os.close(fd)
        buf.close()
