"""Reads expert slices from the model file into their buffers, over parallel lanes.

A read is (file offset, length, buffer, buffer offset). With O_DIRECT it is widened to
the page-aligned superset of the slice, which lands in place because every buffer keeps
its tensor's page phase (see memory.AnonBuffer); the extra bytes at either end are the
file's own bytes of the neighbouring slices, so writing them is harmless. Where the file
system refuses O_DIRECT (tmpfs, some FUSE), or a direct read fails with EINVAL, the
reader falls back to buffered reads of the exact slice and says so (`odirect` false).

With `io-threads` above 1 and direct reads, one layer's reads go through Linux AIO
(`aio.py`): the caller moves every slice's pages into place, submits every read at once
(up to `AIO_DEPTH` in flight) and waits for all, so no other thread of ours changes or
flushes the page tables while the reads run (aio.py gives the figures). Without AIO
the lanes are threads (`os.preadv` releases the GIL): one layer's reads are spread over
them by bytes, each lane moving its slices' pages before it reads them.

With read-ahead (`prefetch`) the lanes take their work from a `LaneQueue` instead: a
priority queue of single reads grouped into `ReadGroup`s the caller can wait on. Reads for
a layer's real routing go in at priority 0 and jump the queue; a speculative read waits
behind them, and a group that turns out to be needed is *promoted* (its reads not yet
started are queued again at priority 0) and waited on, never issued twice. Where the
extension `bmoe.native.readlanes` is built, the queue's lanes are pthreads in C
(`NativeLaneQueue`): they move pages and read without the GIL, so they neither wait for
the engine thread's Python nor make it wait for theirs (`BMOE_LANES=python` keeps the
Python threads, which are also used with the huge-page supply, a Python object).

A failing file: every read that fails (EIO, a file cut short) is a `ReadError` whose
message is for a person and names the file. No read is waited on for ever: the caller
waits at most `read_timeout()` seconds (`BMOE_READ_TIMEOUT_S`, default 60) for a read
handed to another thread (with one lane too, the read runs on a thread of its own, so a
hung device never holds the engine thread). A read that times out leaves the reader
*broken*: every later read fails at once with the same message until the model is
loaded again, and `close` hands the descriptors, the AIO context and the buffers the
stuck read may still write into to a thread that frees them once the read returns.
"""

from __future__ import annotations

import errno
import functools
import heapq
import importlib
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from .aio import Aio
from .memory import AnonBuffer, PageSupply, discard_pages, move_pages, page_ceil, page_floor

FRESH = -1     # a move's source: fresh pages from the reader's PageSupply
# reads in flight at once through AIO: every read of one layer's misses (top-k x 3 expert
# tensors) on the real shapes; measured on the benchmark MoE, a layer's ~5 reads all in
# flight ran at 1,408 MiB/s where 4 at a time ran at 1,197 (one run, disk 1,835-2,307)
AIO_DEPTH = 32
READ_TIMEOUT_ENV = "BMOE_READ_TIMEOUT_S"
LANES_ENV = "BMOE_LANES"       # "python": the queue's lanes on Python threads
DEFAULT_READ_TIMEOUT_S = 60.0


def read_timeout() -> float:
    """Seconds a caller waits for a read before it gives up (`BMOE_READ_TIMEOUT_S`)."""
    try:
        value = float(os.environ.get(READ_TIMEOUT_ENV, "") or DEFAULT_READ_TIMEOUT_S)
    except ValueError:
        return DEFAULT_READ_TIMEOUT_S
    return value if value > 0 else DEFAULT_READ_TIMEOUT_S


class ReadError(OSError):
    """A read of the model file failed; `message` says what, to a person, naming the file."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(err, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _reload_hint() -> str:
    return "Load the model again once the file is whole and readable."


def failed_read(path: str, e: OSError, offset: int) -> ReadError:
    if isinstance(e, ReadError):
        return e
    what = e.strerror or os.strerror(e.errno or errno.EIO)
    return ReadError(f"Reading the model file {path} failed at byte {offset}: {what}. The "
                     "disk or share holding it may be failing, or the file was changed "
                     f"while the model was loaded. {_reload_hint()}", e.errno or errno.EIO)


def short_read(path: str, offset: int, size: int) -> ReadError:
    return ReadError(f"The model file {path} ends early: a read at byte {offset} found no "
                     f"data (the file was {size} bytes when the model was loaded). It was "
                     f"truncated or replaced while the model was loaded. {_reload_hint()}")


def timed_out(path: str, seconds: float) -> ReadError:
    return ReadError(f"A read of the model file {path} did not finish in {seconds:g} s: the "
                     "disk or share holding it stopped answering. "
                     f"{_reload_hint()}", errno.ETIMEDOUT)


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
    def __init__(self, path: str, lanes: int, direct: bool, chunk: int = 0) -> None:
        self.path = path
        self.lanes = max(1, int(lanes))
        self.chunk = page_floor(max(0, int(chunk)))    # 0: every read whole
        self.buffered_fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct_fd = -1
        self._use_direct = False
        self._fallback_reason = ""
        self._recycle_on = True
        self.queue: LaneQueue | NativeLaneQueue | None = None
        # how several reads run: "aio" (the caller moves every slice's pages, then submits
        # every read at once: aio.py), "pipe" (the caller, each read handed to the
        # lanes as soon as its pages are in place), "lanes" (the lane, before its read),
        # "first" (the caller, all before any read is dispatched)
        self.mode = "aio"
        self._moved_bytes = 0
        self._counters = threading.Lock()   # the lanes update recycle / moved_bytes
        if direct:
            self._open_direct()
        else:
            self.fallback_reason = "o-direct is off"
        self._pool = (ThreadPoolExecutor(self.lanes, thread_name_prefix="bmoe-read")
                      if self.lanes > 1 else None)
        self.file_size = os.fstat(self.buffered_fd).st_size
        # several lanes and direct reads: one thread submits them all (aio.py says why)
        self.aio = (Aio.open(max(self.lanes, AIO_DEPTH)) if self.lanes > 1 and self.use_direct
                    else None)
        self.supply: PageSupply | None = None
        self.timeout_s = read_timeout()
        if self.aio is not None:
            self.aio.timeout = self.timeout_s
        self.broken: ReadError | None = None     # a read timed out: nothing reads any more
        self._solo: ThreadPoolExecutor | None = None   # one lane: the read's own thread

    def reopen(self, path: str) -> None:
        """Read every slice from `path` instead, at the same offsets (the model's packed
        experts file, packed.py): before the queue starts and before any read. Direct
        reads stay as they were chosen (the new file's refusal turns them off)."""
        if self.queue is not None:
            raise RuntimeError("the reader's file can change only before its lanes start")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        old = (self.buffered_fd, self.direct_fd)
        wanted_direct = self._use_direct
        self.path, self.buffered_fd, self.direct_fd = path, fd, -1
        self._use_direct = False
        if wanted_direct:
            self._open_direct()
        self.file_size = os.fstat(fd).st_size
        for old_fd in old:
            if old_fd >= 0:
                os.close(old_fd)

    def start_queue(self) -> LaneQueue | NativeLaneQueue:
        """Switch to queued lanes (read-ahead): `lanes` threads on one priority queue, in C
        where it is built (a huge-page supply's fresh pages are then given by the caller
        as it queues the reads, not by the lane)."""
        if self.queue is None:
            native = native_lanes()
            self.queue = (NativeLaneQueue(self, self.lanes, native) if native is not None
                          else LaneQueue(self, self.lanes))
        return self.queue

    @property
    def odirect(self) -> bool:
        return self.use_direct

    @property
    def use_direct(self) -> bool:
        self._sync_native()
        return self._use_direct

    @use_direct.setter
    def use_direct(self, on: bool) -> None:
        self._use_direct = on

    @property
    def fallback_reason(self) -> str:
        self._sync_native()
        return self._fallback_reason

    @fallback_reason.setter
    def fallback_reason(self, reason: str) -> None:
        self._fallback_reason = reason

    @property
    def recycle(self) -> bool:
        """Page moves on (off for good once one failed; then victims' pages are freed)."""
        q = self.queue
        if isinstance(q, NativeLaneQueue) and not q.lanes.recycle:
            self._recycle_on = False
        return self._recycle_on

    @recycle.setter
    def recycle(self, on: bool) -> None:
        self._recycle_on = bool(on)
        if isinstance(self.queue, NativeLaneQueue):
            self.queue.lanes.recycle = self._recycle_on

    @property
    def moved_bytes(self) -> int:
        q = self.queue
        return self._moved_bytes + (q.lanes.moved_bytes if isinstance(q, NativeLaneQueue) else 0)

    @moved_bytes.setter
    def moved_bytes(self, n: int) -> None:
        self._moved_bytes = n

    def _sync_native(self) -> None:
        """A direct read the C lanes saw refused turns direct reads off here too."""
        q = self.queue
        if isinstance(q, NativeLaneQueue) and self._use_direct and not q.lanes.use_direct:
            self._disable_direct("a direct read was refused "
                                 f"({os.strerror(q.lanes.refused_errno or errno.EINVAL)})")

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
        if self._use_direct:
            self._use_direct = False
            self._fallback_reason = reason

    def read_all(self, reads: list[Read]) -> tuple[int, float]:
        """Perform `reads` (spread over the lanes); returns (bytes read, seconds waited)."""
        if not reads:
            return 0, 0.0
        self.check()
        t0 = time.perf_counter()
        reads = self.split(reads)
        if self._pool is None or len(reads) == 1:
            if self._pool is None and self._solo is None:
                self._solo = ThreadPoolExecutor(1, thread_name_prefix="bmoe-read")
            pool = self._pool or self._solo
            assert pool is not None
            n = self._waited([pool.submit(self._run, reads)])
        elif self.aio is not None and self.use_direct and self.mode == "aio":
            n = self._submitted(reads)
        elif self.mode == "pipe":
            n = self._piped(reads)
        else:
            if self.mode == "first":
                for r in reads:
                    self._recycle(r.moves)
                reads = [Read(r.offset, r.length, r.buffer, r.at) for r in reads]
            futures = [self._pool.submit(self._run, batch)
                       for batch in _spread(reads, self.lanes) if batch]
            n = self._waited(futures)
        return n, time.perf_counter() - t0

    def check(self) -> None:
        """Raise the timeout that broke this reader, if one did."""
        if self.broken is not None:
            raise self.broken

    def give_up(self) -> ReadError:
        """A read did not finish in time: the reader is broken from now on."""
        if self.broken is None:
            self.broken = timed_out(self.path, self.timeout_s)
        return self.broken

    def _waited(self, futures: list) -> int:
        """Every lane is done with the buffers before anything raises, or the wait timed
        out (then the reader is broken, and close() frees what the stuck read holds)."""
        _, pending = wait(futures, timeout=self.timeout_s)
        if pending:
            raise self.give_up()
        return sum(f.result() for f in futures)

    def _submitted(self, reads: list[Read]) -> int:
        """Every page move here, then every read in flight at once through AIO; a read
        the kernel refused or cut short is done again the synchronous way (which falls
        back to buffered reads, or raises, as a lane would)."""
        assert self.aio is not None
        for r in reads:
            self._recycle(r.moves)
        plain = [Read(r.offset, r.length, r.buffer, r.at) for r in reads]
        extents = [self._extent(r) for r in plain]
        try:
            results = self.aio.pread_all(self.direct_fd, [(r.buffer.base + start, n, lo)
                                                         for r, (lo, start, n) in
                                                         zip(plain, extents, strict=True)])
        except TimeoutError:
            raise self.give_up() from None
        total, again = 0, []
        for r, (lo, _, _), got in zip(plain, extents, results, strict=True):
            if got > 0 and lo + got >= r.offset + r.length:
                total += got
            else:
                again.append(r)
        if again:                  # on the lanes, so a hung retry is waited on with a timeout
            assert self._pool is not None
            total += self._waited([self._pool.submit(self._one, r) for r in again])
        return total

    def _extent(self, r: Read) -> tuple[int, int, int]:
        """(file offset, buffer offset, length) of the direct read of `r`: the page-aligned
        superset of the slice, which the buffer's page phase lands in place."""
        lo, hi = page_floor(r.offset), min(page_ceil(r.offset + r.length), self.file_size)
        return lo, r.buffer.phase + r.at - (r.offset - lo), page_ceil(hi - lo)

    def _piped(self, reads: list[Read]) -> int:
        """The caller moves each slice's pages and hands the read to the lanes at once,
        so the lanes only read (no page-table work competing among them: a move takes
        the address space's lock and flushes other CPUs' TLBs) while the caller prepares
        the next slice; each lane takes the next read when it is free."""
        assert self._pool is not None
        futures = []
        try:
            for r in sorted(reads, key=lambda r: -r.length):
                self._recycle(r.moves)
                futures.append(self._pool.submit(self._one, Read(r.offset, r.length,
                                                                 r.buffer, r.at)))
        except BaseException:
            self._waited(futures)
            raise
        return self._waited(futures)

    def split(self, reads: list[Read]) -> list[Read]:
        """Each read cut into pieces of at most `chunk` bytes at page-aligned file offsets,
        its page moves cut with it, so one layer's few slices keep every lane busy."""
        if not self.chunk:
            return reads
        return [p for r in reads for p in _pieces(r, self.chunk)]

    def _run(self, reads: list[Read]) -> int:
        return sum(self._one(r) for r in reads)

    def _one(self, r: Read) -> int:
        self._recycle(r.moves)
        if self.use_direct:
            try:
                return self._direct(r)
            except ReadError:
                raise
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise failed_read(self.path, e, r.offset) from None
                self._disable_direct(f"a direct read was refused ({e.strerror})")
        try:
            return self._buffered(r)
        except ReadError:
            raise
        except OSError as e:
            raise failed_read(self.path, e, r.offset) from None

    def _direct(self, r: Read) -> int:
        # The buffer holds file byte x at x - r.offset + phase + at, and its phase equals
        # the tensor's in the file, so the page-aligned superset [lo, hi) of the slice is
        # page-aligned in the buffer too and ends within it.
        lo, start, length = self._extent(r)
        hi = min(lo + length, self.file_size)
        view = r.buffer.view
        got = 0
        while lo + got < hi:
            n = os.preadv(self.direct_fd, [view[start + got:start + length]], lo + got)
            if n <= 0:
                break
            got += n
        if lo + got < r.offset + r.length:
            raise short_read(self.path, lo + got, self.file_size)
        return got

    def _buffered(self, r: Read) -> int:
        start = r.buffer.phase + r.at
        view = r.buffer.view
        got = 0
        while got < r.length:
            n = os.preadv(self.buffered_fd, [view[start + got:start + r.length]], r.offset + got)
            if n <= 0:
                raise short_read(self.path, r.offset + got, self.file_size)
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
                        self._moved_bytes += n
                    continue
                except OSError:
                    with self._counters:
                        self._recycle_on = False  # freeing and faulting in still works
            discard_pages(src, n)

    def close(self, buffers: list[AnonBuffer] | tuple[AnonBuffer, ...] = ()) -> None:
        """Stop the lanes, close the descriptors, then close `buffers` (the ones the reads
        land in). A broken reader (a read that never returned) does all of it on a thread
        of its own once that read returns, so neither the caller waits for a hung device
        nor does a late read land in memory given to something else."""
        if self.broken is not None:
            threading.Thread(target=self._close_now, args=(tuple(buffers),),
                             name="bmoe-read-close", daemon=True).start()
            return
        self._close_now(tuple(buffers))

    def _close_now(self, buffers: tuple[AnonBuffer, ...]) -> None:
        if self.queue is not None:
            self.queue.close()
            if isinstance(self.queue, NativeLaneQueue):      # keep what the lanes saw
                self._sync_native()
                self._moved_bytes += self.queue.lanes.moved_bytes
                self._recycle_on = self._recycle_on and bool(self.queue.lanes.recycle)
            self.queue = None
        for pool in (self._pool, self._solo):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._solo = None
        if self.supply is not None:
            self.supply.close()
        if self.aio is not None:
            self.aio.close()       # waits for reads still in flight
            self.aio = None
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        if self.buffered_fd >= 0:
            os.close(self.buffered_fd)
            self.buffered_fd = -1
        for buf in buffers:
            buf.close()


def _pieces(r: Read, chunk: int) -> list[Read]:
    if r.length <= chunk:
        return [r]
    out = []
    base = r.buffer.data - r.offset + r.at       # buffer address of file offset 0
    start, end = r.offset, r.offset + r.length
    while start < end:
        stop = min(end, page_floor(start + chunk))
        if stop <= start:
            stop = min(end, start + chunk)
        lo, hi = base + start, base + stop           # this piece's bytes in the buffer
        moves = tuple((src if src == FRESH else src + a - dst, a, b - a)
                      for src, dst, n in r.moves
                      if (a := max(dst, page_floor(lo))) < (b := min(dst + n, page_ceil(hi))))
        out.append(Read(start, stop - start, r.buffer, r.at + start - r.offset, moves))
        start = stop
    return out


def _spread(reads: list[Read], lanes: int) -> list[list[Read]]:
    """Largest first onto the least-loaded lane."""
    batches: list[list[Read]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for r in sorted(reads, key=lambda r: -r.length):
        i = load.index(min(load))
        batches[i].append(r)
        load[i] += r.length
    return batches


class QueuedGroup(Protocol):
    """A group of queued reads as callers see it (`ReadGroup`, or the C lanes' `Group`)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def prio(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...

    def finished(self) -> bool: ...


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

    def finished(self) -> bool:
        """Every read of the group ran (or failed)."""
        return self.done.is_set()


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
        self._idle = 0             # lanes waiting for a read
        self.busy_s = 0.0          # summed lane time spent reading (can exceed wall time)
        self._threads = [threading.Thread(target=self._lane, name=f"bmoe-lane-{i}", daemon=True)
                         for i in range(lanes)]
        for t in self._threads:
            t.start()

    def submit(self, reads: list[Read], prio: int, wake: bool = True) -> ReadGroup:
        """Queue `reads` as one group at `prio`; with `wake` false no lane is woken (the
        caller queues more and calls `wake` once)."""
        g = ReadGroup(prio)
        g.items = [_Item(r, g) for r in self._reader.split(reads)]
        g.left = len(g.items)
        if not g.items:
            g.done.set()
            return g
        with self._cv:
            for it in sorted(g.items, key=lambda it: -it.read.length):
                heapq.heappush(self._heap, (prio, next(self._seq), it))
            if wake:
                self._wake(len(g.items) if prio == 0 else 1)
        return g

    def wake(self) -> None:
        """Wake one idle lane for what was queued without waking one."""
        with self._cv:
            if self._heap:
                self._wake(1)

    def _wake(self, n: int) -> None:
        """Wake up to `n` idle lanes (with the condition held). Reads needed now wake as
        many lanes as they have pieces: the caller waits for them next. Read-ahead
        wakes one, and a lane that takes a read wakes the next while more are queued,
        so the engine thread, which goes on computing, makes one wake-up per read group
        (each costs it tens of µs on a virtual machine) instead of one per idle lane."""
        if self._idle:
            self._cv.notify(min(n, self._idle))

    def wait(self, groups: list[Any], timeout: float) -> bool:
        """True when every group finished within `timeout` seconds (from now)."""
        deadline = time.monotonic() + timeout
        return all(g.done.wait(max(0.0, deadline - time.monotonic())) for g in groups)

    def promote(self, g: Any) -> None:
        """Queue the group's reads not yet started again, at priority 0."""
        if g.prio == 0 or g.done.is_set():
            return
        with self._cv:
            g.prio = 0
            left = [it for it in g.items if not it.taken]
            for it in left:
                heapq.heappush(self._heap, (0, next(self._seq), it))
            self._wake(len(left))

    def _lane(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._idle += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._idle -= 1
                if self._closed and not self._heap:
                    return
                _, _, it = heapq.heappop(self._heap)
                if self._heap:
                    self._wake(1)          # more queued: the next idle lane takes one
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


def native_lanes() -> ModuleType | None:
    """`bmoe.native.readlanes`, or None where it is not built or `BMOE_LANES=python`."""
    if os.environ.get(LANES_ENV, "").strip().lower() == "python":
        return None
    try:
        return importlib.import_module("bmoe.native.readlanes")
    except ImportError:
        return None


def _lane_error(native: ModuleType, path: str, size: int, kind: int, err: int,
                at: int) -> BaseException:
    """The exception for what a C lane recorded: the reader's own, as a Python lane's."""
    if kind == native.KIND_READ:
        return failed_read(path, OSError(err, os.strerror(err)), at)
    if kind == native.KIND_SHORT:
        return short_read(path, at, size)
    if kind == native.KIND_FREE:
        return OSError(err, f"madvise(MADV_DONTNEED): {os.strerror(err)}")
    return OSError("the reader closed before this read ran")


class NativeLaneQueue:
    """`LaneQueue` with its lanes in C (`bmoe/native/readlanes.c`): the same priority queue,
    groups, promotion, wake-ups and close, on pthreads that never take the GIL. A group
    is the extension's `Group` (`finished()`, `nbytes`, `prio`, `error`); its failures are
    the reader's own exceptions, made here from what the lane recorded."""

    def __init__(self, reader: ExpertReader, lanes: int, native: ModuleType) -> None:
        self._reader = reader
        self.native = native
        # the error maker holds no reference to this queue (the C object is not collected
        # in a cycle)
        self.lanes: Any = native.Lanes(reader.direct_fd if reader._use_direct else -1,
                                       reader.buffered_fd, reader.file_size, lanes,
                                       reader._recycle_on,
                                       functools.partial(_lane_error, native, reader.path,
                                                         reader.file_size))

    @property
    def busy_s(self) -> float:
        """Summed lane time spent reading (can exceed wall time)."""
        return float(self.lanes.busy_s)

    def submit(self, reads: list[Read], prio: int, wake: bool = True) -> Any:
        """Queue `reads` as one group at `prio` (see LaneQueue.submit). Fresh pages
        (`FRESH` moves) are given from the reader's supply here, before the reads are
        queued; the victims' pages are moved by the lane."""
        spec: list[int] = []
        supply = self._reader.supply
        for r in self._reader.split(reads):
            buf = r.buffer
            moves = [m for m in r.moves if m[0] != FRESH]
            if supply is not None:
                for m in r.moves:
                    if m[0] == FRESH:
                        supply.give(m[1], m[2])
            spec += (r.offset, r.length, buf.base + buf.phase + r.at, buf.base,
                     buf.base + buf.size, len(moves))
            for m in moves:
                spec += m
        return self.lanes.submit(spec, prio, wake)

    def wake(self) -> None:
        """Wake one idle lane for what was queued without waking one."""
        self.lanes.wake()

    def promote(self, g: Any) -> None:
        """Queue the group's reads not yet started again, at priority 0."""
        self.lanes.promote(g)

    def wait(self, groups: list[Any], timeout: float) -> bool:
        """True when every group finished within `timeout` seconds (from now)."""
        return bool(self.lanes.wait(groups, timeout))

    def close(self) -> None:
        """Stop the lanes after the reads in progress; queued reads fail their groups."""
        self.lanes.close()
