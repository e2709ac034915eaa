"""A FUSE file system that passes a folder through and fails or hangs reads on command.

Run as its own process (a FUSE server must not be the process reading from it):

    python tests/_faultfs.py BACKING MOUNTPOINT CONTROL

CONTROL is a JSON file read at every read: ``{"mode": "ok" | "eio" | "hang", "lo": int,
"hi": int}``. A read that overlaps the byte range [lo, hi) of any file fails with EIO
(``eio``) or blocks until the mode changes (``hang``: then it is answered as the new mode
says). Outside the range, and with ``ok``, reads are the backing file's bytes.

Why FUSE: this container's kernel has no device-mapper (`dmsetup` finds no
``/dev/mapper/control``), so the ``error`` / ``flakey`` / ``delay`` targets the issue names
are not available; ``/dev/fuse`` is, and a FUSE read that returns ``-EIO`` reaches the
reader's ``preadv`` (and Linux AIO) as the same EIO a failing disk gives, and a FUSE read
that does not answer blocks the reading thread in the kernel the way a hung device does.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any

import mfusepy as fuse


class FaultFS(fuse.Operations):
    def __init__(self, root: str, control: str) -> None:
        self.root = root
        self.control = control

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _rule(self) -> dict[str, Any]:
        try:
            with open(self.control) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"mode": "ok"}

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._path(path))
        except OSError as e:
            raise fuse.FuseOSError(e.errno) from None
        return {k: getattr(st, k) for k in ("st_mode", "st_size", "st_nlink", "st_uid",
                                             "st_gid", "st_atime", "st_mtime", "st_ctime",
                                             "st_ino")}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise fuse.FuseOSError(errno.EROFS)
        return os.open(self._path(path), os.O_RDONLY)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        while True:
            rule = self._rule()
            mode = rule.get("mode", "ok")
            hit = offset < int(rule.get("hi", 1 << 62)) and offset + size > int(rule.get("lo", 0))
            if mode == "ok" or not hit:
                return os.pread(fh, size, offset)
            if mode == "eio":
                raise fuse.FuseOSError(errno.EIO)
            time.sleep(0.05)           # "hang": until the test changes the mode

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                             "f_favail", "f_ffree", "f_files", "f_flag",
                                             "f_frsize", "f_namemax")}


def main() -> None:
    root, mount, control = sys.argv[1:4]
    fuse.FUSE(FaultFS(root, control), mount, foreground=True, nothreads=False, ro=True)


if __name__ == "__main__":
    main()
