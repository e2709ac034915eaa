"""Paths a tool names, resolved inside the workspace.

Every `..` and symbolic link is resolved before the check, so a link that points out of
the workspace is outside it, and a dangling link (anywhere along the path) is refused:
what it would create is somewhere the person did not look.
"""

from __future__ import annotations

import os
from pathlib import Path


class ToolError(Exception):
    """A tool call that cannot be done; `message` is a sentence the model reads."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OutsideWorkspace(ToolError):
    pass


def resolve(root: Path, name: object) -> Path:
    """`name` (relative to `root`, or absolute inside it) as a real path inside `root`."""
    if not isinstance(name, str) or not name.strip():
        raise ToolError("`path` must be a non-empty string.")
    if "\x00" in name:
        raise ToolError("`path` must not contain a NUL character.")
    real_root = Path(os.path.realpath(root))
    lexical = Path(name) if os.path.isabs(name) else real_root / name
    for p in (lexical, *lexical.parents):
        if os.path.islink(p) and not os.path.exists(p):
            raise OutsideWorkspace(f"{name} goes through a link whose target does not exist; "
                                   "such links are not followed.")
    real = Path(os.path.realpath(lexical))
    if real != real_root and real_root not in real.parents:
        raise OutsideWorkspace(f"{name} is outside the workspace; only files inside it can "
                               "be used.")
    return real


def shown(root: Path, path: Path) -> str:
    """`path` as the model should see it: relative to the workspace."""
    try:
        rel = path.relative_to(os.path.realpath(root))
    except ValueError:
        return str(path)
    return str(rel) or "."
