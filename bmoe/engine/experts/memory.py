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

import ctypes
import ctypes.util
import mmap
import os
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


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530
