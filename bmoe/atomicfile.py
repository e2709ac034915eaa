"""Writing a file so that it is never half-written: a temp file beside it, fsync, rename,
then fsync of the folder. Every file the server keeps (settings, catalogs, conversations)
is written here; a kill at any moment leaves the old file or the new one, whole."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically (`mode`: the file's permissions; by default
    the temp file's own, readable by its owner only)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            # named by the file it was to replace, not by its temp file (a message says it)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    write_bytes(path, text.encode("utf-8"), mode=mode)


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
