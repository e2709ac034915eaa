"""Virtual memory the streamer owns: expert buffers, and the model file's mapping.

*Expert buffers* are private anonymous mappings (`MAP_PRIVATE | MAP_ANONYMOUS`: a shared
anonymous mapping is shmem, and `MADV_DONTNEED` would not give its pages back). They are
committed lazily, page by page, as slices are read into them, and an evicted slice's
pages go back to the kernel with `MADV_DONTNEED`. A buffer starts at the same offset
within a page as its tensor does in the file, so an O_DIRECT read of the page-aligned
superset of a slice lands straight in place, with no bounce buffer and no copy.

*The file mapping* is llama.cpp's `mmap` of the model. We find it in `/proc/self/maps`
(the mapping of the file's inode that appeared during the load), and then (a) drop the
expert pages from it (`MADV_DONTNEED` on the mapping, `POSIX_FADV_DONTNEED` on the page
cache): llama.cpp's load populated them and they are never read again; (b) with
`dense-weights anon`, replace the dense pages in place by anonymous copies (`MAP_FIXED`),
so the weights every token uses are process memory that page-cache pressure cannot evict,
at the very addresses llama.cpp's tensors point to.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
_MAP_NORESERVE = 0x4000
_MAP_FIXED = 0x10
_PROT_READ, _PROT_WRITE = 1, 2
_COPY_CHUNK = 64 << 20  # dense bytes copied into anonymous memory at a time

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def page_floor(x: int) -> int:
    return x - x % PAGE


def page_ceil(x: int) -> int:
    return -(-x // PAGE) * PAGE


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class AnonBuffer:
    """A private anonymous mapping holding one expert tensor at its file page phase."""

    def __init__(self, file_offset: int, nbytes: int) -> None:
        self.phase = file_offset % PAGE
        self.size = page_ceil(self.phase + nbytes)
        self._map = mmap.mmap(-1, self.size,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(self.array.ctypes.data)
        self.data = self.base + self.phase      # what the tensor's ->data points at

    def interior(self, start: int, end: int) -> tuple[int, int]:
        """(address, length) of the whole pages inside [start, end) (offsets from `data`).

        A slice's first and last page are shared with its neighbours (slices need not be
        page-aligned); those edge pages stay committed once touched, the interior is what
        eviction gives back or hands on.
        """
        lo, hi = page_ceil(self.phase + start), page_floor(self.phase + end)
        return self.base + lo, max(0, hi - lo)

    def release(self, start: int, end: int) -> int:
        """Give back the interior pages of [start, end) to the kernel; bytes freed."""
        addr, n = self.interior(start, end)
        if n:
            self._map.madvise(mmap.MADV_DONTNEED, addr - self.base, n)
        return n

    def release_at(self, addr: int, length: int) -> None:
        self._map.madvise(mmap.MADV_DONTNEED, addr - self.base, length)

    def close(self) -> None:
        self.view.release()
        del self.array
        self._map.close()


@dataclass(frozen=True)
class FileMapping:
    """llama.cpp's mapping of the model file: file offset `o` lives at `base + o`."""

    base: int
    ranges: tuple[tuple[int, int], ...]   # mapped file ranges [start, end)

    def covers(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.ranges)


def _maps_of(path: Path) -> set[tuple[int, int, int]]:
    """(start, end, file offset) of every current mapping of `path`'s inode."""
    st = os.stat(path)
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[4]) != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if os.makedev(major, minor) != st.st_dev:
                continue
            a, b = (int(x, 16) for x in parts[0].split("-"))
            out.add((a, b, int(parts[2], 16)))
    return out


class MappingProbe:
    """Snapshots the file's mappings before llama.cpp loads it, to find the new one after."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.before = _maps_of(path)

    def find(self) -> FileMapping:
        new = sorted(_maps_of(self.path) - self.before)
        bases = {a - off for a, _, off in new}
        if len(bases) != 1:
            raise RuntimeError(f"cannot find llama.cpp's mapping of {self.path.name} "
                               f"({len(new)} new mappings)")
        ranges = tuple((off, off + (b - a)) for a, b, off in new)
        return FileMapping(base=bases.pop(), ranges=ranges)


def page_runs(spans: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Merge byte spans (offset, nbytes) into runs of whole pages, clipped to [0, limit)."""
    runs: list[list[int]] = []
    for off, n in sorted(spans):
        a, b = page_floor(off), min(page_ceil(off + n), page_ceil(limit))
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs if b > a]


def pin_anonymous(mapping: FileMapping, runs: list[tuple[int, int]], fd: int) -> int:
    """Replace the file mapping's pages over `runs` by anonymous copies; bytes copied.

    The copies are read with pread (not from the mapping, whose pages may be gone) and the
    pages made read-only again, as llama.cpp mapped them.
    """
    copied = 0
    for a, b in runs:
        for lo in range(a, b, _COPY_CHUNK):
            hi = min(b, lo + _COPY_CHUNK)
            if not mapping.covers(lo, hi):
                continue
            data = os.pread(fd, hi - lo, lo)
            addr = mapping.base + lo
            got = _libc.mmap(addr, hi - lo, _PROT_READ | _PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
            if got != addr:
                raise _oserror("mmap(MAP_FIXED) over the model mapping")
            ctypes.memmove(addr, data, len(data))
            if _libc.mprotect(addr, hi - lo, _PROT_READ) != 0:
                raise _oserror("mprotect")
            copied += hi - lo
    return copied


def drop_mapped(mapping: FileMapping, runs: list[tuple[int, int]]) -> None:
    """Unmap the pages of the file mapping over `runs` from our page tables (they stay valid)."""
    for a, b in runs:
        for ra, rb in mapping.ranges:
            lo, hi = max(a, ra), min(b, rb)
            if hi > lo and _libc.madvise(mapping.base + lo, hi - lo, mmap.MADV_DONTNEED) != 0:
                raise _oserror("madvise(MADV_DONTNEED) on the model mapping")


def resident_fraction(mapping: FileMapping, runs: list[tuple[int, int]]) -> float:
    """Share of the pages over `runs` that are in memory now (mincore)."""
    total = resident = 0
    for a, b in runs:
        for ra, rb in mapping.ranges:
            lo, hi = max(a, ra), min(b, rb)
            if hi <= lo:
                continue
            n = (hi - lo) // PAGE
            vec = np.zeros(n, dtype=np.uint8)
            if _libc.mincore(mapping.base + lo, hi - lo, vec.ctypes.data) != 0:
                raise _oserror("mincore")
            total += n
            resident += int(np.count_nonzero(vec & 1))
    return resident / total if total else 1.0


def move_pages(src: int, dst: int, length: int) -> None:
    """Hand the committed pages at `src` to `dst` (page tables only: no copy, no zeroing).

    `src` stays mapped and empty (MREMAP_DONTUNMAP), as after MADV_DONTNEED; whatever was
    at `dst` is replaced. A page fault on this kind of virtual machine costs about 2 us
    (600 us per MiB zero-filled), so a cache that recycles its victims' pages reads a
    missed expert almost twice as fast as one that frees them and faults in new ones.
    """
    got = _libc.mremap(src, length, length,
                       _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
    if got != dst:
        raise _oserror("mremap")


def discard_pages(addr: int, length: int) -> None:
    """MADV_DONTNEED on a page-aligned range of an anonymous mapping of ours."""
    if _libc.madvise(addr, length, mmap.MADV_DONTNEED) != 0:
        raise _oserror("madvise(MADV_DONTNEED)")


HUGE = 2 << 20                      # a transparent huge page on x86-64 and arm64 (4 KiB base)
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15
_SUPPLY_REGION = 64 << 20          # fresh pages are carved from regions of this size
_RESERVE_CHUNK = 32 << 20          # `reserve` commits pages this many bytes at a time
_MADV_POPULATE_WRITE = 23          # Linux 5.14: fault pages in writable, in the kernel
_JUDGE_BYTES = 128 << 20           # the supply judges its huge pages after giving this much
_PROBE_BYTES = 16 << 20            # plain pages faulted in once to time them
_MIB = 1 << 20


def plain_fault_rate(nbytes: int = _PROBE_BYTES) -> float:
    """Bytes per second at which plain (4 KiB, not huge) anonymous pages fault in here:
    a scratch mapping advised MADV_NOHUGEPAGE, touched once per page, then unmapped
    (best of two; 0.0 where it cannot be measured)."""
    best = 0.0
    for _ in range(2):
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            a = np.frombuffer(m, dtype=np.uint8)
            _libc.madvise(int(a.ctypes.data), nbytes, _MADV_NOHUGEPAGE)
            t0 = time.perf_counter()
            a[::PAGE] = 0
            dt = time.perf_counter() - t0
            del a
        finally:
            m.close()
        best = max(best, nbytes / dt if dt > 0 else 0.0)
    return best


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str | None = None) -> str:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), or ""."""
    try:
        with open(path or THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


THP_DIR = "/sys/kernel/mm/transparent_hugepage"
FOLIO_HINT_KIB = 64


def anon_folio_sizes(base: str | None = None) -> list[int]:
    """The sizes (KiB) between 4 KiB and 2 MiB of the large folios the kernel may give
    memory nobody advised (multi-size transparent huge pages, Linux 6.8 on): those whose
    `hugepages-<size>kB/enabled` is `always`, or `inherit` with the top mode `always`.
    Empty where there are none, or the kernel has no such setting."""
    root = base or THP_DIR
    top = thp_mode(os.path.join(root, "enabled"))
    sizes = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if not (name.startswith("hugepages-") and name.endswith("kB")):
            continue
        try:
            kib = int(name[len("hugepages-"):-len("kB")])
        except ValueError:
            continue
        if not 4 < kib < 2048:
            continue
        mode = thp_mode(os.path.join(root, name, "enabled"))
        if mode == "always" or (mode == "inherit" and top == "always"):
            sizes.append(kib)
    return sorted(sizes)


def folio_note(base: str | None = None) -> str:
    """What the expert reads land in, for a person: the large folios a slice's fresh pages
    come in, or how to turn them on (a read into physically contiguous runs needs fewer
    of the disk's segments: see docs/expert-cache.md, "Host tuning")."""
    sizes = anon_folio_sizes(base)
    if sizes:
        return f"fresh pages come in folios of up to {max(sizes)} KiB"
    root = base or THP_DIR
    if not os.path.isdir(os.path.join(root, f"hugepages-{FOLIO_HINT_KIB}kB")):
        return "fresh pages are 4 KiB pages (this kernel has no smaller huge pages)"
    return ("fresh pages are 4 KiB pages; expert reads into 64 KiB folios ran up to 20 % "
            "faster on a virtual disk (to allow them, as root: echo always > "
            f"{root}/hugepages-{FOLIO_HINT_KIB}kB/enabled)")


class PageSupply:
    """Fresh pages for expert slices, physically contiguous where the kernel allows.

    An O_DIRECT read lands in the pages the caller gives it; the kernel hands the device
    one scatter-gather segment per physically contiguous run. Pages faulted in one by one
    (as a read into untouched memory does) are scattered: a 1 MiB read then carries ~256
    segments. On a virtual disk that pays per segment the difference is the disk's speed:
    measured on a Firecracker VM, 1 MiB O_DIRECT reads into scattered pages ran at
    620-680 MiB/s, into huge-page-backed ones (1 segment) at 1,440 MiB/s, interleaved.

    So a slice read into pages it never had first receives pages carved from a region
    advised `MADV_HUGEPAGE` (2 MiB pages, each zeroed in one go), moved into place by
    `move_pages`; they stay 4 KiB-mapped there (the huge page is split) but keep their
    physical run, and recycling moves whole slices' pages on to later misses. At most
    the rest of one huge page is committed here beyond what was handed out. Thread-safe:
    the reader's lanes take pages as they read. Off where the kernel has no transparent
    huge pages (`never`): then faulting in is as good.

    It also turns itself off where huge pages are dear (unless `once`: see there): a
    kernel that must compact memory to find free 2 MiB blocks (`defrag` `madvise` after
    hours of page-cache churn) faults
    them in slower than plain pages, and then every fresh slice waits for that. Measured
    on this kind of VM after 40 GB of files were written: huge pages faulted and zeroed at
    454 MiB/s against 2,117 MiB/s for plain pages, and the 12-layer gpt-oss-120b slice
    decoded its first tokens (the cache filling) at 1.19 s/token with the supply against
    0.34 without. So the supply times its own faults, and once it has given
    `_JUDGE_BYTES`, stays on only while it commits at least as fast as plain pages fault
    in (timed once, on a scratch mapping, when it is made); `note` says which.

    Pages a victim had beyond what a miss takes (units differ in size by layer: a
    Q4_K_M model's down projections are Q6_K in some layers) come back through `take`
    and are kept, up to `park_limit` bytes, in a mapping of their own; `give` hands them
    out before any fresh page. Without that a full cache on such a model kept faulting
    in fresh huge pages at every token (600 MiB over 150 tokens of the Qwen3-30B-A3B
    slice, 1.46x slower than plain pages); with it the fresh pages stop once the cache is
    full. Pages kept this way are the victim's own: their physical runs stay.
    """

    def __init__(self, region: int = _SUPPLY_REGION, enabled: bool = True,
                 park_limit: int = 0, reserve_limit: int = 0) -> None:
        self.region = max(HUGE, region // HUGE * HUGE)
        self.enabled = enabled and thp_mode() in ("always", "madvise")
        self.given_bytes = 0
        self.note = ("on" if self.enabled else "off: the kernel has no transparent huge pages"
                     if enabled else "off")
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._start = self._pos = self._end = 0
        self._fault_s = 0.0                 # time spent faulting in the supply's pages
        self._judged = False
        # every page given stays where it went for good (expert slots commit each slot
        # once): a slow fault is paid once per slot, bounded by the cache, and every read
        # after lands in contiguous pages, so the supply does not judge itself
        self.once = False
        self.plain_rate = plain_fault_rate() if self.enabled else 0.0
        # pages handed back (`take`) and kept, up to `park_limit` bytes, for later slices
        self.park_limit = max(0, park_limit) // PAGE * PAGE
        self.parked: list[tuple[int, int]] = []
        self.parked_bytes = self.reused_bytes = 0
        self._park: mmap.mmap | None = None
        self._park_base = 0
        self._park_free: list[tuple[int, int]] = []     # free (start, length), by start
        # plain pages committed ahead of the cache's first fill (`reserve`): in the parking
        # mapping, kept apart from a victim's parked pages, given after them
        self.reserve_limit = max(0, reserve_limit) // PAGE * PAGE
        self.reserved: list[tuple[int, int]] = []
        self.reserved_bytes = 0         # committed by `reserve` in all
        self.reserve_left = 0           # of them, not given yet
        self.reserve_given_bytes = 0
        self._closed = False

    def give(self, dst: int, length: int) -> bool:
        """Move `length` bytes of fresh committed pages to page-aligned `dst` (replacing
        whatever was mapped there): pages handed back (`take`) first, then new ones; False
        when not all could be given (the caller's read then faults the rest in)."""
        if length <= 0:
            return False
        with self._lock:
            for pool in (self.parked, self.reserved):   # a victim's pages, then committed
                while pool and length > 0:
                    src, n = pool.pop()
                    k = min(n, length)
                    try:
                        move_pages(src, dst, k)
                    except OSError:
                        pool.append((src, n))
                        break
                    if n > k:
                        pool.append((src + k, n - k))
                    self._unpark(src, k)
                    if pool is self.parked:
                        self.parked_bytes -= k
                        self.reused_bytes += k
                    else:
                        self.reserve_left -= k
                        self.reserve_given_bytes += k
                    dst += k
                    length -= k
            if length <= 0:
                return True
            if not self.enabled:
                return False
            try:
                if self._map is None or self._pos + length > self._end:
                    self._new_region(length)
                assert self._array is not None
                lo = self._pos - self._start
                t0 = time.perf_counter()
                self._array[lo:lo + length:PAGE] = 0       # fault in: huge pages, zeroed
                self._fault_s += time.perf_counter() - t0
                move_pages(self._pos, dst, length)
                # the moved range is its own mapping and took the region's advice along:
                # drop it, so khugepaged never collapses (copies) a slice we read into
                _libc.madvise(dst, length, _MADV_NOHUGEPAGE)
            except OSError:
                self.enabled = False                        # never again: fault in instead
                self._drop()
                return False
            self._pos += length
            self.given_bytes += length
            if not self._judged and not self.once and self.given_bytes >= _JUDGE_BYTES:
                self._judge()
            return True

    def take(self, src: int, length: int) -> None:
        """Keep the committed pages at `src` (a victim's that no miss took) for a later
        `give`, up to `park_limit` bytes; beyond that, or where they cannot be moved,
        they are freed. Their physical runs stay as they are: pages that came from huge
        pages keep reading as such."""
        with self._lock:
            at = self._park_at(length) if self.parked_bytes + length <= self.park_limit else 0
            if at:
                try:
                    move_pages(src, at, length)
                except OSError:
                    self._unpark(at, length)
                    at = 0
            if not at:
                discard_pages(src, length)
                return
            self.parked.append((at, length))
            self.parked_bytes += length

    def _park_at(self, length: int) -> int:
        """A free address range of `length` bytes in the parking mapping (made on first
        use, address space only), or 0."""
        if self._park is None:
            if self._closed:
                return 0
            size = 2 * self.park_limit + self.reserve_limit + 64 * PAGE
            try:
                self._park = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                       | _MAP_NORESERVE)
            except OSError:
                self.park_limit = 0
                return 0
            a = np.frombuffer(self._park, dtype=np.uint8)
            self._park_base = int(a.ctypes.data)
            del a
            _libc.madvise(self._park_base, size, _MADV_NOHUGEPAGE)
            self._park_free = [(self._park_base, size)]
        for i, (start, n) in enumerate(self._park_free):
            if n >= length:
                if n == length:
                    del self._park_free[i]
                else:
                    self._park_free[i] = (start + length, n - length)
                return start
        return 0

    def reserve(self, room: Callable[[], int], stop: threading.Event,
                chunk: int = _RESERVE_CHUNK) -> tuple[int, str]:
        """Commit plain pages, `chunk` bytes at a time, and keep them for `give` (after a
        victim's parked pages), while `room()` (the cache's budget less what it holds and
        what is kept here) has room, up to `reserve_limit` bytes over the supply's life,
        until `stop` is set. Returns the bytes committed and why it ended.

        A cache that turns over starts empty, and until it is full every miss has no
        victim's pages to take: the read faults fresh zero-filled pages in, in the read
        lanes. On this kind of virtual machine a first touch costs 0.4-0.8 ms per MiB
        alone and about 3 ms per MiB in the lanes during a prompt (its host backs each
        page anew), so a server's first long prompt spent more CPU in its lanes' page
        faults than anywhere but the compute. Committed here, while the server is idle
        after its load, the first fill's misses take these pages by `move_pages` instead.
        The pages are committed by the kernel (`MADV_POPULATE_WRITE`): nothing in user
        space touches the mapping, so `close` can unmap it under a running reserve."""
        done = 0
        while not stop.is_set():
            with self._lock:
                if self._closed:
                    return done, "closed"
                left = self.reserve_limit - self.reserved_bytes
                free = room()
                n = min(chunk, left, free) // PAGE * PAGE
                if n <= 0:
                    return done, ("reached its limit" if left <= free
                                  else "the cache holds its budget")
                at = self._park_at(n)
            if not at:
                return done, "the parking mapping is full"
            if _libc.madvise(at, n, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                with self._lock:
                    if self._closed:            # unmapped under the kernel's commit
                        return done, "closed"
                    self._unpark(at, n)
                return done, ("this kernel cannot commit pages ahead (MADV_POPULATE_WRITE "
                              "needs Linux 5.14)" if err == errno.EINVAL
                              else f"committing pages failed ({os.strerror(err)})")
            with self._lock:
                if self._closed:                # closed while the kernel committed
                    return done, "closed"
                self.reserved.append((at, n))
                self.reserve_left += n
                self.reserved_bytes += n
            done += n
        return done, "stopped"

    def _unpark(self, start: int, length: int) -> None:
        """Return [start, start + length) of the parking mapping to its free ranges."""
        free = self._park_free
        i = bisect.bisect(free, (start, length))
        free.insert(i, (start, length))
        if i + 1 < len(free) and start + length == free[i + 1][0]:
            free[i] = (start, length + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def _judge(self) -> None:
        """Keep on only while huge pages commit at least as fast as plain pages fault in."""
        self._judged = True
        rate = self.given_bytes / max(self._fault_s, 1e-9)
        if self.plain_rate and rate < self.plain_rate:
            self.enabled = False
            self._drop()
            self.note = (f"off: huge pages faulted in at {rate / _MIB:.0f} MiB/s here, "
                         f"plain pages at {self.plain_rate / _MIB:.0f} MiB/s")
        else:
            self.note = (f"on: huge pages fault in at {rate / _MIB:.0f} MiB/s, plain pages "
                         f"at {self.plain_rate / _MIB:.0f} MiB/s")

    def commit(self, buf: AnonBuffer, length: int | None = None) -> bool:
        """Commit the first `length` bytes of `buf` (all of it by default): fresh pages
        given from here when it can, then every page touched, so all are present either
        way. True when they came from here."""
        n = buf.size if length is None else length
        given = self.give(buf.base, n)
        buf.array[:n:PAGE] = 0
        return given

    def _new_region(self, length: int) -> None:
        self._drop()
        size = max(self.region, -(-length // HUGE) * HUGE)
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        array = np.frombuffer(m, dtype=np.uint8)
        base = int(array.ctypes.data)
        skip = -base % HUGE                                  # start on a huge page boundary
        if _libc.madvise(base + skip, size, _MADV_HUGEPAGE) != 0:
            del array
            m.close()
            raise _oserror("madvise(MADV_HUGEPAGE)")
        self._map, self._array = m, array
        self._start = base
        self._pos, self._end = base + skip, base + skip + size

    def _drop(self) -> None:
        # What is left of a region is the unused tail: pages moved out are mapped elsewhere.
        if self._map is not None:
            self._array = None
            self._map.close()
            self._map = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
            self.enabled = False
            self.parked.clear()
            self.reserved.clear()
            self.parked_bytes = self.reserve_left = 0
            if self._park is not None:
                self._park.close()
                self._park = None


def physical_runs(addr: int, length: int) -> int | None:
    """Physically contiguous runs of this process's present pages at [addr, addr + length)
    (/proc/self/pagemap); None where the kernel hides frame numbers (without
    CAP_SYS_ADMIN) or a page is not present."""
    n = length // PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8 * n, addr // PAGE * 8)
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, dtype=np.uint64)
    pfns = entries & np.uint64((1 << 55) - 1)
    if len(entries) != n or not (entries >> np.uint64(63)).all() or not pfns.any():
        return None
    return 1 + int(np.count_nonzero(np.diff(pfns.astype(np.int64)) != 1))


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530
