"""Files the agent keeps: written whole, to a temporary file that is fsynced and
renamed over the old one, so a crash (or `kill -9`) at any moment leaves the old
file or the new one, never half of either. Callers on trio run these through
`trio.to_thread.run_sync` (see `AgentService`), never on the trio thread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import atomicfile


def encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, indent=1).encode("utf-8", "surrogatepass")


def write_json(path: Path, value: Any, *, mode: int = 0o644) -> None:
    """Write `value` to `path` atomically (temp file in the same folder, fsync, rename)."""
    write_bytes(path, encode(value), mode=mode)


def write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically."""
    atomicfile.write_bytes(path, data, mode=mode)


def read_json(path: Path, default: Any) -> Any:
    """The file's JSON, or `default` when it is missing or does not parse."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8", "surrogatepass"))
    except (OSError, ValueError):
        return default


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    atomicfile.fsync_dir(path.parent)


def clean_temporaries(folder: Path) -> None:
    """Temporary files a killed writer left behind (never a conversation itself)."""
    if not folder.is_dir():
        return
    for p in folder.glob(".*.tmp"):
        try:
            p.unlink()
        except OSError:
            pass
