"""Load the model without reading its experts: llama.cpp's mapping, not populated.

llama.cpp 0c1e57098 maps the model file with `MAP_POPULATE` and then
`posix_madvise(POSIX_MADV_WILLNEED)` over all of it (`llama_mmap`, src/llama-mmap.cpp):
the load reads the whole file once, file size / disk rate, though the streamer drops the
expert pages right after. The public API has no switch for it: `lazy_mode` only covers
tensors an architecture marks lazy (none for the MoE architectures here), and the
`DIRECT_IO` / no-mmap load modes read every tensor into an allocated buffer. A sparse
"view" of the file whose expert ranges are holes was measured too: `MAP_POPULATE` still
fills every hole page with zeros through the page cache, 15 s for 2 GiB here.

So, for the duration of `llama_model_load_from_file` only, the streamer points
libllama's own import slots (its GOT entries) for `mmap` and `posix_madvise` at two small
shims: `mmap` of *this model file* is done without `MAP_POPULATE`, and `WILLNEED` advice
over that mapping is skipped; every other call passes through unchanged. The slots are
found from libllama's ELF relocation tables (`R_X86_64_JUMP_SLOT` / `GLOB_DAT`, or the
AArch64 equivalents) and the library's load address (glibc's `link_map.l_addr`, the
first field of a `dlopen` handle), and are restored in `attach`. Where any of that is
not as expected (another libc, a statically linked build, a read-only slot we cannot
make writable), nothing is patched and the load reads the file as before: `load_info`
says which.

The dense weights are then read by the streamer (`dense-weights anon`, a `pread` of
the dense bytes) or on first use (`mmap`): the load costs dense bytes / disk rate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import struct
import threading
from pathlib import Path

import llama_cpp

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_POSIX_MADV_WILLNEED = 3
_SLOT_TYPES = {6, 7, 1025, 1026}   # x86-64 GLOB_DAT/JUMP_SLOT, AArch64 GLOB_DAT/JUMP_SLOT
_SHT_RELA = 4

_real = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")   # errno left alone
_real.mmap.restype = ctypes.c_void_p
_real.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_real.posix_madvise.restype = ctypes.c_int
_real.posix_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_real.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

_MMAP_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_int, ctypes.c_int, ctypes.c_long)
_MADV_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

_lock = threading.Lock()
_files: set[tuple[int, int]] = set()          # (st_dev, st_ino) loading without populate
_maps: list[tuple[int, int]] = []             # (addr, length) of their mappings
_saved: dict[int, int] = {}                   # slot address -> original pointer
_users = 0


def _mmap_shim(addr: int | None, length: int, prot: int, flags: int, fd: int, off: int
               ) -> int | None:
    if fd >= 0 and flags & _MAP_POPULATE:
        try:
            st = os.fstat(fd)
            ours = (st.st_dev, st.st_ino) in _files
        except OSError:
            ours = False
        if ours:
            got = _real.mmap(addr, length, prot, flags & ~_MAP_POPULATE, fd, off)
            if got not in (None, ctypes.c_void_p(-1).value):
                _maps.append((int(got), int(length)))
            return got
    return _real.mmap(addr, length, prot, flags, fd, off)


def _madvise_shim(addr: int | None, length: int, advice: int) -> int:
    if advice == _POSIX_MADV_WILLNEED and addr is not None:
        if any(a <= addr and addr + length <= a + n for a, n in _maps):
            return 0
    return _real.posix_madvise(addr, length, advice)


_mmap_cb = _MMAP_T(_mmap_shim)
_madv_cb = _MADV_T(_madvise_shim)
_SHIMS = {b"mmap": ctypes.cast(_mmap_cb, ctypes.c_void_p).value,
          b"mmap64": ctypes.cast(_mmap_cb, ctypes.c_void_p).value,
          b"posix_madvise": ctypes.cast(_madv_cb, ctypes.c_void_p).value}


def _libllama() -> Path:
    return Path(os.path.dirname(llama_cpp.__file__)) / "lib" / "libllama.so"


def import_slots(lib: Path, names: set[bytes]) -> dict[bytes, list[int]]:
    """Offsets (from the load address) of `lib`'s import slots for the symbols `names`."""
    data = lib.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    out: dict[bytes, list[int]] = {}
    for _name, sh_type, _f, _a, off, size, link, _i, _al, entsize in sections:
        if sh_type != _SHT_RELA or not entsize:
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for r in range(off, off + size, entsize):
            r_offset, r_info, _add = struct.unpack_from("<QQq", data, r)
            sym, rtype = r_info >> 32, r_info & 0xFFFFFFFF
            if rtype not in _SLOT_TYPES or not sym:
                continue
            st_name, = struct.unpack_from("<I", data, symtab[4] + sym * symtab[9])
            start = strtab[4] + st_name
            name = data[start:data.index(b"\0", start)]
            if name in names:
                out.setdefault(name, []).append(r_offset)
    return out


def _load_address(lib: Path) -> int:
    handle = ctypes.CDLL(str(lib))._handle          # glibc: a struct link_map *
    l_addr = ctypes.c_size_t.from_address(handle).value
    l_name = ctypes.c_char_p.from_address(handle + 8).value or b""
    if os.path.realpath(os.fsdecode(l_name)) != os.path.realpath(lib):
        raise OSError("the dlopen handle is not a glibc link_map")
    return l_addr


def _writable(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            a, b = (int(x, 16) for x in span.split("-"))
            if a <= addr < b:
                return perms[1] == "w"
    return False


def _patch() -> None:
    lib = _libllama()
    base = _load_address(lib)
    slots = import_slots(lib, set(_SHIMS))
    if not slots.get(b"mmap") and not slots.get(b"mmap64"):
        raise OSError("libllama imports no mmap through its GOT")
    page = mmap.PAGESIZE
    for name, offsets in slots.items():
        for off in offsets:
            addr = base + off
            if not _writable(addr):
                if _real.mprotect(addr - addr % page, page, 3) != 0:    # RELRO: read-write
                    raise OSError("the GOT slot is read-only")
            cell = ctypes.c_void_p.from_address(addr)
            _saved[addr] = cell.value or 0
            cell.value = _SHIMS[name]


def _unpatch() -> None:
    for addr, value in _saved.items():
        ctypes.c_void_p.from_address(addr).value = value
    _saved.clear()
    _maps.clear()


def begin(path: Path) -> str:
    """Load `path` without populating its mapping (until `end`); '' or why not."""
    global _users
    st = os.stat(path)
    with _lock:
        try:
            if _users == 0:
                _patch()
        except (OSError, ValueError, IndexError, struct.error) as e:
            _unpatch()
            return f"the load reads the whole file ({e})"
        _users += 1
        _files.add((st.st_dev, st.st_ino))
    return ""


def end(path: Path) -> None:
    global _users
    with _lock:
        if _users == 0:
            return
        try:
            st = os.stat(path)
            _files.discard((st.st_dev, st.st_ino))
        except OSError:
            pass
        _users -= 1
        if _users == 0:
            _unpatch()
            _files.clear()
