"""What the model folders hold: the ``local`` list of ``GET /api/models``.

Each folder is read one level deep: its own files, then those of every folder directly
inside it. A link to a folder is not followed (so a scan cannot loop or leave the
folder through a name inside it); a link to a file is listed, as the link. A split set
(``X-00001-of-00003.gguf`` ...) is one row, named by its first shard, ``complete`` only
when every shard is there. A file reachable from two listed places is one row, from
the first place that listed it (same device and inode).

Headers are probed once per file version (path, size, mtime) and kept in ``ProbeCache``.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pairing import Names, pair
from .probe import ModelProbe, is_gguf_name, probe_files, shard_name, split_parts

# A model's packed experts file beside it (``MODEL.gguf.bmoe-packed``, written by
# ``bmoe-server models pack-experts``): not a model of its own; deleted with the model.
PACKED_SUFFIX = ".bmoe-packed"


def companions(files: list[Path]) -> list[Path]:
    """The files kept beside a model's own that go with it (its packed experts file)."""
    out = []
    for f in files:
        c = f.with_name(f.name + PACKED_SUFFIX)
        if c.is_file() and not c.is_symlink():
            out.append(c)
    return out


class ProbeCache:
    """Probes by file version; thread-safe (the listing runs in a worker thread)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: dict[tuple[Any, ...], ModelProbe] = {}

    def get(self, paths: list[Path]) -> ModelProbe:
        key = tuple(_version(p) for p in paths)
        with self._lock:
            hit = self._probes.get(key)
        if hit is not None:
            return hit
        probe = probe_files(paths)
        with self._lock:
            if len(self._probes) >= self.LIMIT:
                self._probes.clear()
            self._probes[key] = probe
        return probe


def _version(p: Path) -> tuple[Any, ...]:
    try:
        st = p.stat()
    except OSError:
        return (str(p), None)
    return (str(p), st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class Found:
    """One gguf file as the scan met it."""

    path: Path
    dir: Path
    folder: str
    name: str
    identity: tuple[int, int]
    size: int


@dataclass
class LocalModel:
    name: str
    dir: Path
    folder: str
    files: list[Path]
    shards: int
    complete: bool
    bytes: int
    probe: ModelProbe = field(default_factory=ModelProbe)
    projector: str = ""

    @property
    def key(self) -> str:
        """The name ``DELETE /api/models/local/`` takes: ``folder/name`` or ``name``."""
        return f"{self.folder}/{self.name}" if self.folder else self.name

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "path": str(self.files[0]), "dir": str(self.dir),
               "folder": self.folder, "bytes": self.bytes, "shards": self.shards,
               "files": [str(f) for f in self.files], "arch": self.probe.arch,
               "role": self.probe.role, "streamable": self.probe.streamable,
               "complete": self.complete}
        if self.probe.role == "model":
            out["projector"] = self.projector
        if not self.probe.readable:
            out["error"] = f"Not readable: {self.probe.reason}."
        return out


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _gguf_in(base: Path, folder: str, path: Path) -> list[Found]:
    found = []
    for e in _entries(path):
        if not is_gguf_name(e.name):
            continue
        try:
            st = os.stat(e.path)            # through a link to a file: the file's identity
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append(Found(Path(e.path), base, folder, e.name, (st.st_dev, st.st_ino),
                               st.st_size))
    return found


def scan_dir(base: Path) -> list[Found]:
    """The gguf files of ``base`` and of every real folder directly inside it."""
    found = _gguf_in(base, "", base)
    for e in _entries(base):
        try:
            if e.is_dir(follow_symlinks=False):
                found += _gguf_in(base, e.name, Path(e.path))
        except OSError:
            continue
    return found


def group(found: list[Found]) -> list[LocalModel]:
    """Files into models: a split set once, by its first shard."""
    sets: dict[tuple[str, str, str, int], dict[int, Found]] = {}
    models: list[LocalModel] = []
    order: list[tuple[str, Any]] = []
    for f in found:
        parts = split_parts(f.name)
        if parts is None or parts[2] == 1:
            order.append(("one", f))
            continue
        stem, no, count = parts
        key = (str(f.dir), f.folder, stem, count)
        if key not in sets:
            sets[key] = {}
            order.append(("set", key))
        sets[key][no] = f
    for kind, item in order:
        if kind == "one":
            f = item
            models.append(LocalModel(f.name, f.dir, f.folder, [f.path], 1, True, f.size))
            continue
        shards = sets[item]
        count = item[3]
        present = [shards[n] for n in sorted(shards)]
        first = present[0]
        models.append(LocalModel(shard_name(item[2], 1, count), first.dir, first.folder,
                                 [s.path for s in present], count, len(present) == count,
                                 sum(s.size for s in present)))
    return models


def scan(dirs: list[Path], probes: ProbeCache) -> list[LocalModel]:
    """Every model of ``dirs``, in order, each file once; probed."""
    seen: set[tuple[int, int]] = set()
    out: list[LocalModel] = []
    for d in dirs:
        fresh = []
        for f in scan_dir(d):
            if f.identity in seen:
                continue
            seen.add(f.identity)
            fresh.append(f)
        out += group(fresh)
    for m in out:
        m.probe = probes.get(m.files) if m.complete else probes.get(m.files[:1])
    _pair_projectors(out)
    return out


def _pair_projectors(models: list[LocalModel]) -> None:
    """Each model's projector in its folder, by their headers (`pairing`)."""
    folders: dict[tuple[str, str], list[tuple[str, Names]]] = {}
    for m in models:
        if m.probe.role == "projector":
            folders.setdefault((str(m.dir), m.folder), []).append((m.name, Names.of(m.probe)))
    for m in models:
        if m.probe.role == "model":
            m.projector = pair(Names.of(m.probe), folders.get((str(m.dir), m.folder), []))
