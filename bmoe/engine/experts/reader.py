"""Reads expert slices from the model file into their buffers, over parallel lanes.

A read is (file offset, length, buffer, buffer offset). With O_DIRECT it is widened to
the page-aligned superset of the slice, which lands in place because every buffer keeps
its tensor's page phase (see memory.AnonBuffer); the extra bytes at either end are the
file's own bytes of the neighbouring slices, so writing them is harmless. Where the file
system refuses O_DIRECT (tmpfs, some FUSE), or a direct read fails with EINVAL, the
reader falls back to buffered reads of the exact slice and says so (`odirect` false).

Lanes are threads: `os.preadv` releases the GIL, so `io-threads` reads are in flight at
once. One layer's reads are spread over the lanes by bytes and the caller waits for all.

With read-ahead (`prefetch`) the lanes take their work from a `LaneQueue` instead: a
priority queue of single reads grouped into `ReadGroup`s the caller can wait on. Reads for
a layer's real routing go in at priority 0 and jump the queue; a speculative read waits
behind them, and a group that turns out to be needed is *promoted* (its reads not yet
started are queued again at priority 0) and waited on, never issued twice.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from .memory import AnonBuffer, PageSupply, discard_pages, move_pages, page_ceil, page_floor

FRESH = -1     # a move's source: fresh pages from the reader's PageSupply


@dataclass(frozen=True)
class Read:
    offset: int        # file offset of the slice
    length: int
    buffer: AnonBuffer
    at: int            # offset of the slice from buffer.data
    # (src, dst, length): pages to recycle into the slice before reading, src FRESH for
    # fresh pages from the reader's supply (physically contiguous: see PageSupply)
    moves: tuple[tuple[int, int, int], ...] = ()


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
        self._counters = threading.Lock()   # the lanes update recycle / moved_bytes
        if direct:
            self._open_direct()
        else:
            self.fallback_reason = "o-direct is off"
        self._pool = (ThreadPoolExecutor(self.lanes, thread_name_prefix="bmoe-read")
                      if self.lanes > 1 else None)
        self.file_size = os.fstat(self.buffered_fd).st_size
        self.queue: LaneQueue | None = None
        self.supply: PageSupply | None = None

    def start_queue(self) -> LaneQueue:
        """Switch to queued lanes (read-ahead): `lanes` threads on one priority queue."""
        if self.queue is None:
            self.queue = LaneQueue(self, self.lanes)
        return self.queue

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
        """Hand a victim's committed pages (or fresh ones) to the slice about to be read
        (in the lane)."""
        for src, dst, n in moves:
            if src == FRESH:
                if self.supply is not None:
                    self.supply.give(dst, n)
                continue
            if self.recycle:
                try:
                    move_pages(src, dst, n)
                    with self._counters:
                        self.moved_bytes += n
                    continue
                except OSError:
                    with self._counters:
                        self.recycle = False  # freeing and faulting in still works
            discard_pages(src, n)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.supply is not None:
            self.supply.close()
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


class ReadGroup:
    """Reads a caller waits on together (one layer's misses, or one expert read ahead)."""

    __slots__ = ("left", "done", "nbytes", "error", "items", "prio")

    def __init__(self, prio: int) -> None:
        self.left = 0
        self.done = threading.Event()
        self.nbytes = 0
        self.error: BaseException | None = None
        self.items: list[_Item] = []
        self.prio = prio


class _Item:
    __slots__ = ("read", "group", "taken")

    def __init__(self, read: Read, group: ReadGroup) -> None:
        self.read, self.group, self.taken = read, group, False


class LaneQueue:
    """`lanes` reader threads serving one priority queue of reads (0 = needed now)."""

    def __init__(self, reader: ExpertReader, lanes: int) -> None:
        self._reader = reader
        self._heap: list[tuple[int, int, _Item]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.busy_s = 0.0          # summed lane time spent reading (can exceed wall time)
        self._threads = [threading.Thread(target=self._lane, name=f"bmoe-lane-{i}", daemon=True)
                         for i in range(lanes)]
        for t in self._threads:
            t.start()

    def submit(self, reads: list[Read], prio: int) -> ReadGroup:
        g = ReadGroup(prio)
        g.items = [_Item(r, g) for r in reads]
        g.left = len(g.items)
        if not g.items:
            g.done.set()
            return g
        with self._cv:
            for it in sorted(g.items, key=lambda it: -it.read.length):
                heapq.heappush(self._heap, (prio, next(self._seq), it))
            self._cv.notify_all()
        return g

    def promote(self, g: ReadGroup) -> None:
        """Queue the group's reads not yet started again, at priority 0."""
        if g.prio == 0 or g.done.is_set():
            return
        with self._cv:
            g.prio = 0
            for it in g.items:
                if not it.taken:
                    heapq.heappush(self._heap, (0, next(self._seq), it))
            self._cv.notify_all()

    def _lane(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                _, _, it = heapq.heappop(self._heap)
                if it.taken:
                    continue
                it.taken = True
            t0 = time.perf_counter()
            n, err = 0, None
            try:
                n = self._reader._one(it.read)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                err = e
            g = it.group
            with self._cv:
                self.busy_s += time.perf_counter() - t0
                g.nbytes += n
                if err is not None and g.error is None:
                    g.error = err
                g.left -= 1
                if g.left == 0:
                    g.done.set()

    def close(self) -> None:
        """Stop the lanes after the reads in progress; the queued ones are dropped (their
        groups fail), so a long queue (a background fill) does not hold the close up."""
        with self._cv:
            self._closed = True
            dropped = [it for _, _, it in self._heap if not it.taken]
            self._heap.clear()
            for it in dropped:
                it.taken = True
                g = it.group
                if g.error is None:
                    g.error = OSError("the reader closed before this read ran")
                g.left -= 1
                if g.left == 0:
                    g.done.set()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
