"""Reads expert slices from the model file into their buffers, over parallel lanes.

A read is (file offset, length, buffer, buffer offset). With O_DIRECT it is widened to
the page-aligned superset of the slice, which lands in place because every buffer keeps
its tensor's page phase (see memory.AnonBuffer); the extra bytes at either end are the
file's own bytes of the neighbouring slices, so writing them is harmless. Where the file
system refuses O_DIRECT (tmpfs, some FUSE), or a direct read fails with EINVAL, the
reader falls back to buffered reads of the exact slice and says so (`odirect` false).

Lanes are threads: `os.preadv` releases the GIL, so `io-threads` reads are in flight at
once. One layer's reads are spread over the lanes by bytes and the caller waits for all.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from .memory import AnonBuffer, discard_pages, move_pages, page_ceil, page_floor


@dataclass(frozen=True)
class Read:
    offset: int        # file offset of the slice
    length: int
    buffer: AnonBuffer
    at: int            # offset of the slice from buffer.data
    moves: tuple[tuple[int, int, int], ...] = ()   # (src, dst, length): pages to recycle


class ExpertReader:
    def __init__(self, path: str, lanes: int, direct: bool) -> None:
        self.path = path
        self.lanes = max(1, int(lanes))
        self.buffered_fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct_fd = -1
        self.use_direct = False
        self.fallback_reason = ""
        self.recycle = True
        self.moved_bytes = 0
        if direct:
            self._open_direct()
        else:
            self.fallback_reason = "o-direct is off"
        self._pool = (ThreadPoolExecutor(self.lanes, thread_name_prefix="bmoe-read")
                      if self.lanes > 1 else None)
        self.file_size = os.fstat(self.buffered_fd).st_size

    @property
    def odirect(self) -> bool:
        return self.use_direct

    def _open_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            self.fallback_reason = "O_DIRECT is not available on this platform"
            return
        try:
            self.direct_fd = os.open(self.path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
            self.use_direct = True
        except OSError as e:
            self.fallback_reason = f"the file system refused O_DIRECT ({e.strerror})"

    def _disable_direct(self, reason: str) -> None:
        # The descriptor stays open until close(): another lane may be reading with it.
        if self.use_direct:
            self.use_direct = False
            self.fallback_reason = reason

    def read_all(self, reads: list[Read]) -> tuple[int, float]:
        """Perform `reads` (spread over the lanes); returns (bytes read, seconds waited)."""
        if not reads:
            return 0, 0.0
        t0 = time.perf_counter()
        if self._pool is None or len(reads) == 1:
            n = self._run(reads)
        else:
            futures = [self._pool.submit(self._run, batch)
                       for batch in _spread(reads, self.lanes) if batch]
            wait(futures)      # every lane is done with the buffers before anything raises
            n = sum(f.result() for f in futures)
        return n, time.perf_counter() - t0

    def _run(self, reads: list[Read]) -> int:
        return sum(self._one(r) for r in reads)

    def _one(self, r: Read) -> int:
        self._recycle(r.moves)
        if self.use_direct:
            try:
                return self._direct(r)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._disable_direct(f"a direct read was refused ({e.strerror})")
        return self._buffered(r)

    def _direct(self, r: Read) -> int:
        # The buffer holds file byte x at x - r.offset + phase + at, and its phase equals
        # the tensor's in the file, so the page-aligned superset [lo, hi) of the slice is
        # page-aligned in the buffer too and ends within it.
        lo, hi = page_floor(r.offset), min(page_ceil(r.offset + r.length), self.file_size)
        start = r.buffer.phase + r.at - (r.offset - lo)
        view = r.buffer.view
        got = 0
        while lo + got < hi:
            n = os.preadv(self.direct_fd, [view[start + got:start + page_ceil(hi - lo)]],
                          lo + got)
            if n <= 0:
                break
            got += n
        if lo + got < r.offset + r.length:
            raise OSError(errno.EIO, f"short read at offset {lo + got} of {self.path}")
        return got

    def _buffered(self, r: Read) -> int:
        start = r.buffer.phase + r.at
        view = r.buffer.view
        got = 0
        while got < r.length:
            n = os.preadv(self.buffered_fd, [view[start + got:start + r.length]], r.offset + got)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at offset {r.offset + got} of {self.path}")
            got += n
        return got

    def _recycle(self, moves: tuple[tuple[int, int, int], ...]) -> None:
        """Hand a victim's committed pages to the slice about to be read (in the lane)."""
        for src, dst, n in moves:
            if self.recycle:
                try:
                    move_pages(src, dst, n)
                    self.moved_bytes += n
                    continue
                except OSError:
                    self.recycle = False      # freeing and faulting in still works
            discard_pages(src, n)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        if self.buffered_fd >= 0:
            os.close(self.buffered_fd)
            self.buffered_fd = -1


def _spread(reads: list[Read], lanes: int) -> list[list[Read]]:
    """Largest first onto the least-loaded lane."""
    batches: list[list[Read]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for r in sorted(reads, key=lambda r: -r.length):
        i = load.index(min(load))
        batches[i].append(r)
        load[i] += r.length
    return batches
