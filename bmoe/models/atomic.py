"""Writing a file so that it is never half-written (see bmoe.atomicfile)."""

from __future__ import annotations

from pathlib import Path

from ..atomicfile import write_text


def write_atomically(path: Path, text: str) -> None:
    write_text(path, text)
