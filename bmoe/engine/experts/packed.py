"""A packed experts file: a model's MXFP4 experts kept on disk already in the layout
llama.cpp's repacked kernels run (``block_mxfp4x8``), so a streamed read lands ready.

Without it the read lanes permute every MXFP4 expert slice right after it lands
(`repack.py`, ``pack_mxfp4_8`` in `bmoe/native/readlanes.c`): on the gpt-oss-120b slice
that was about 60 % of the lanes' CPU, on the same two cores the prompt computes on. The
packed file holds the same bytes already permuted, so the lanes only read.

The file (``<model>.bmoe-packed``, beside the model) keeps every expert tensor's bytes at
the *same offsets* as the model file, so the streamer's reads, their page alignment and
its buffers stay as they are; only the descriptor differs. Everything else in the model
is a hole (a sparse file: the experts' bytes are all it takes on disk). MXFP4 expert
tensors whose rows come in whole groups of 8 are permuted; any other expert tensor is
copied as it is. After the experts, at the next 4 KiB, a JSON trailer says what it was
made from (the model's size and modification time, every expert tensor's offset, size
and whether it is packed), then its length and a magic.

It is used only where it matches: the model file is the one it was made from, the expert
tensors are the same, the packed ones are exactly those the streamer repacks on this CPU
(its layout check against llama.cpp's ``CPU_REPACK`` passed), and the streamer would
repack them at all. Otherwise the streamer reads the model and permutes as before, and
its load info says why the packed file was passed over.

Written by ``bmoe-server models pack-experts MODEL`` to a temp file beside it, then
renamed: a kill leaves no half-made packed file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...atomicfile import fsync_dir
from ...models.listing import PACKED_SUFFIX
from .layout import Layout, LayoutError, read_layout
from .reader import native_lanes
from .repack import BLOCK_ELEMS, GGML_TYPE_MXFP4, GROUP_ROWS, row_bytes

SUFFIX = PACKED_SUFFIX
MAGIC = b"BMOEPKD1"
VERSION = 1
FORMAT = "mxfp4x8"          # llama.cpp's block_mxfp4x8, as pack_mxfp4 writes it
ALIGN = 4096
_CHUNK = 64 << 20           # bytes copied at a time (whole expert slices)


class PackError(ValueError):
    """The packed file cannot be made (the message is for a person)."""


def packed_path(model: str | os.PathLike[str]) -> Path:
    p = Path(model)
    return p.with_name(p.name + SUFFIX)


def packable(layout: Layout) -> list[str]:
    """The expert tensors the file permutes: MXFP4 rows in whole groups of 8."""
    return [t.name for t in layout.experts
            if t.ggml_type == GGML_TYPE_MXFP4 and t.ne0 % BLOCK_ELEMS == 0
            and t.ne1 % GROUP_ROWS == 0]


def _tensors(layout: Layout, packed: Collection[str]) -> list[list[Any]]:
    return [[t.name, t.offset, t.nbytes, t.name in packed] for t in layout.experts]


def _trailer_at(layout: Layout) -> int:
    end = max((t.offset + t.nbytes for t in layout.experts), default=0)
    return -(-max(end, layout.file_size) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Packed:
    path: Path
    file_id: tuple[int, int, int]     # (inode, size, mtime_ns) of the packed file


def find(layout: Layout, packed: Collection[str]) -> tuple[Packed | None, str]:
    """The model's packed file if it matches `layout` with exactly `packed` permuted,
    else None; and a note for the load info (why it was passed over)."""
    path = packed_path(layout.path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None, "none"
    except OSError as e:
        return None, f"{path.name} cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        meta = _read_trailer(fd, st.st_size)
        model = os.stat(layout.path)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        return None, f"{path.name} is not a packed experts file this server reads ({why})"
    finally:
        os.close(fd)
    if meta.get("version") != VERSION or meta.get("format") != FORMAT:
        return None, f"{path.name} is another version of the format; make it again"
    src = meta.get("source") or {}
    if src.get("size") != model.st_size or src.get("mtime_ns") != model.st_mtime_ns:
        return None, (f"{path.name} was made from another version of the model file; "
                      "make it again (bmoe-server models pack-experts)")
    if meta.get("tensors") != _tensors(layout, packed):
        return None, (f"{path.name} packs other expert tensors than this CPU's kernels "
                      "run repacked; make it again here")
    if st.st_size < _trailer_at(layout):
        return None, f"{path.name} is cut short"
    return Packed(path, (st.st_ino, st.st_size, st.st_mtime_ns)), "on"


def _read_trailer(fd: int, size: int) -> dict[str, Any]:
    if size < 16:
        raise ValueError("too short")
    tail = os.pread(fd, 16, size - 16)
    n, magic = struct.unpack("<Q8s", tail)
    if magic != MAGIC or n > min(size - 16, 64 << 20):
        raise ValueError("no trailer")
    meta = json.loads(os.pread(fd, n, size - 16 - n))
    if not isinstance(meta, dict):
        raise ValueError("trailer is not an object")
    return meta


def write(model: str | os.PathLike[str],
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Make the model's packed experts file beside it; returns its path. `progress(done,
    total)` is called with expert bytes as they are written."""
    native = native_lanes()
    if native is None:
        raise PackError("the read lanes' C extension (bmoe.native.readlanes) is not built "
                        "here; reinstall bmoe")
    try:
        layout = read_layout(model)
    except (LayoutError, OSError) as e:
        raise PackError(str(e) if isinstance(e, LayoutError)
                        else f"{model} cannot be read ({e.strerror})") from None
    packed = set(packable(layout))
    if not packed:
        raise PackError(f"{layout.path.name} has no MXFP4 expert tensors to pack (only "
                        "MXFP4 experts, gpt-oss's, are kept repacked on disk)")
    out = packed_path(layout.path)
    total = layout.expert_bytes
    free = shutil.disk_usage(out.parent).free
    if free < total + (256 << 20):
        raise PackError(f"{out.parent} has {free / 2**30:.1f} GiB free; the packed experts "
                        f"take {total / 2**30:.1f} GiB. Free some room and run it again.")
    model_st = os.stat(layout.path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    src = os.open(layout.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    dst = -1
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                      | getattr(os, "O_CLOEXEC", 0), 0o644)
        at = _trailer_at(layout)
        os.ftruncate(dst, at)                       # holes where the model is dense
        done = 0
        for t in layout.experts:
            rows = row_bytes(t.ne0) if t.name in packed else 0
            per = max(1, _CHUNK // t.slice_bytes) * t.slice_bytes
            buf = np.empty(min(per, t.nbytes), dtype=np.uint8)
            off = 0
            while off < t.nbytes:
                n = min(per, t.nbytes - off)
                view = buf.data[:n]
                got = os.preadv(src, [view], t.offset + off)
                if got != n:
                    raise PackError(f"{layout.path.name} ended early, at byte "
                                    f"{t.offset + off + got}: is it whole?")
                if rows:
                    native.pack_mxfp4(view, rows)
                _write_all(dst, view, t.offset + off)
                if hasattr(os, "posix_fadvise"):   # a pass over the model, not kept
                    os.posix_fadvise(src, t.offset + off, n, os.POSIX_FADV_DONTNEED)
                off += n
                done += n
                if progress is not None:
                    progress(done, total)
        meta = {"format": FORMAT, "version": VERSION,
                "source": {"name": layout.path.name, "size": model_st.st_size,
                           "mtime_ns": model_st.st_mtime_ns},
                "tensors": _tensors(layout, packed)}
        body = json.dumps(meta, separators=(",", ":")).encode()
        _write_all(dst, memoryview(body + struct.pack("<Q8s", len(body), MAGIC)), at)
        os.fsync(dst)
        os.close(dst)
        dst = -1
        if os.stat(layout.path).st_mtime_ns != model_st.st_mtime_ns:
            raise PackError(f"{layout.path.name} was written to while it was packed; "
                            "run it again once the file is whole")
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        if dst >= 0:
            os.close(dst)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(src)
    return out


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)

