"""A pack's archive: listed with the system's ``tar``, refused when an entry could leave its
folder, unpacked into a staging folder and checked again there.

``list_entries`` runs ``tar -tf`` (the names, one a line) and ``tar -tvf`` (the same
entries in the same order, each line starting with its type, as ``ls -l`` does), so the
check needs nothing of either listing's columns but the first letter and the name's
end. ``check_entries`` refuses, naming the entry:

- an absolute path (``/x``), a drive (``C:x``), a backslash anywhere (which is also how
  ``tar`` shows a name it had to escape: a newline, a control character), a ``..``;
- a hard link, a device, a fifo or a socket: only files, folders and symbolic links;
- an entry under a symbolic link of the archive, whatever their order, and a name
  listed twice (a later entry would replace or write through the first).

``unpack`` extracts into the staging folder (``--no-same-owner``: a root server does not
hand the files to an archive's user) and ``check_tree`` walks what arrived: only
files, folders and links, no file with a second name, and every link, resolved, inside
the folder. Only a tree that passes is moved into place (``packs.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import trio

LIST_TIMEOUT_S = 60.0
UNPACK_TIMEOUT_S = 600.0
LISTING_LIMIT = 64 << 20
_DRIVE = re.compile(r"^[A-Za-z]:")
_KINDS = {"-": "file", "d": "folder", "l": "link"}
_REFUSED_KINDS = {"h": "a hard link", "c": "a character device", "b": "a block device",
                  "p": "a fifo", "s": "a socket"}


class UnsafeArchive(Exception):
    """The archive was refused (``message`` names the entry and why) or could not be read."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Entry:
    name: str          # as tar lists it
    kind: str          # file | folder | link, or the refused kind's letter
    parts: tuple[str, ...]

    @property
    def path(self) -> str:
        return "/".join(self.parts)


def tar_exe() -> str:
    exe = shutil.which("tar")
    if exe is None:
        raise UnsafeArchive("This server unpacks packs with the system's tar, and none was "
                            "found on PATH: install tar.")
    return exe


async def _tar(args: list[str], limit_s: float) -> str:
    with trio.move_on_after(limit_s) as scope:
        result = await trio.run_process([tar_exe(), *args], check=False, capture_stdout=True,
                                        capture_stderr=True, stdin=-3)
    if scope.cancelled_caught:
        raise UnsafeArchive(f"tar took longer than {limit_s:.0f} s on the pack's archive.")
    if result.returncode != 0:
        raise UnsafeArchive("tar could not read the pack's archive (it is damaged or not a "
                            "tar archive).")
    if len(result.stdout) > LISTING_LIMIT:
        raise UnsafeArchive("The pack's archive lists more entries than a pack holds.")
    return result.stdout.decode("utf-8", "surrogateescape")


def _lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line != ""]


async def list_entries(archive: Path) -> list[Entry]:
    """The archive's entries as tar lists them (UnsafeArchive when it cannot)."""
    names = _lines(await _tar(["-tf", str(archive)], LIST_TIMEOUT_S))
    verbose = _lines(await _tar(["-tvf", str(archive)], LIST_TIMEOUT_S))
    if len(names) != len(verbose) or not names:
        raise UnsafeArchive("tar's listing of the pack's archive could not be read: its two "
                            "listings disagree.")
    entries = []
    for name, line in zip(names, verbose, strict=True):
        letter = line[:1]
        kind = _KINDS.get(letter, letter)
        entries.append(Entry(name, kind, tuple(p for p in name.split("/") if p not in ("", "."))))
    return entries


def check_entries(entries: list[Entry]) -> None:
    """Refuse the archive (UnsafeArchive naming the entry) when one entry could leave the
    folder it is unpacked into; see the module's docstring."""
    links: set[tuple[str, ...]] = set()
    seen: set[tuple[str, ...]] = set()
    for e in entries:
        shown = e.name if e.name.isprintable() else repr(e.name)
        if "\\" in e.name:
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} has a "
                                "backslash in its name.")
        if e.name.startswith("/"):
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} is an "
                                "absolute path.")
        if _DRIVE.match(e.name):
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} names a "
                                "drive.")
        if ".." in e.parts:
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} climbs "
                                "out of its folder with '..'.")
        if e.kind in _REFUSED_KINDS or e.kind not in _KINDS.values():
            what = _REFUSED_KINDS.get(e.kind, "neither a file, a folder nor a link")
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} is {what}.")
        if not e.parts:
            if e.kind == "folder":
                continue              # "./": the folder itself
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} has no name.")
        if e.parts in seen and e.kind != "folder":
            raise UnsafeArchive(f"The pack's archive was refused: the entry {shown} is listed "
                                "twice.")
        seen.add(e.parts)
        if e.kind == "link":
            links.add(e.parts)
    for e in entries:
        for n in range(1, len(e.parts)):
            if e.parts[:n] in links:
                raise UnsafeArchive(f"The pack's archive was refused: the entry {e.name} lies "
                                    f"under the link {'/'.join(e.parts[:n])}.")
    for link in links:
        if any(e.parts == link and e.kind != "link" for e in entries):
            raise UnsafeArchive(f"The pack's archive was refused: {'/'.join(link)} is both a "
                                "link and something else.")


async def unpack(archive: Path, staging: Path) -> None:
    """Extract ``archive`` into the empty folder ``staging``."""
    await _tar(["-xf", str(archive), "-C", str(staging), "--no-same-owner"], UNPACK_TIMEOUT_S)


def check_tree(folder: Path) -> None:
    """UnsafeArchive unless everything under ``folder`` is a file, a folder or a link that
    resolves inside it, with no file that has a second name."""
    root = os.path.realpath(folder)
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                real = os.path.realpath(path)
                if real != root and not real.startswith(root + os.sep):
                    raise UnsafeArchive(f"The pack was refused: the link {rel} points outside "
                                        "its folder.")
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    raise UnsafeArchive(f"The pack was refused: the file {rel} has another "
                                        "name (a hard link).")
            elif not stat.S_ISDIR(st.st_mode):
                raise UnsafeArchive(f"The pack was refused: {rel} is neither a file, a folder "
                                    "nor a link.")
