"""Which projector goes with a model: by their headers, never by file names.

A projector (`general.type` `mmproj`, or the architecture `clip`) in the model's folder
is paired when one of its names matches one of the model's: `general.name`,
`general.basename` or a `general.base_model.N.name`, compared by their letters and
digits only, case aside ("Qwen3-VL-30B-A3B" and "qwen3 vl 30b a3b" match). A projector
whose names match none of the model's is never paired, however alone it is in the
folder. The folder's only projector goes with a model only when one of the two headers
has no name at all to check. Of several matching projectors (two quantizations of one)
the first by file name is taken. The `mmproj` parameter names one explicitly and skips
all of this.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .probe import ModelProbe, is_gguf_name, probe_file

_NOT_ALNUM = re.compile(r"[^0-9a-z]+")


def normal(name: str) -> str:
    return _NOT_ALNUM.sub("", name.lower())


@dataclass(frozen=True)
class Names:
    """The names a header gives, normalised; empty when it names nothing."""

    names: frozenset[str]

    @classmethod
    def of(cls, probe: ModelProbe) -> Names:
        raw = (probe.name, *probe.base_names)
        return cls(frozenset(n for n in (normal(r) for r in raw) if n))

    def matches(self, other: Names) -> bool:
        return bool(self.names & other.names)


def pair(model: Names, projectors: Sequence[tuple[str, Names]]) -> str:
    """The file of `projectors` (file, names) that goes with `model`; "" for none."""
    matching = sorted(f for f, names in projectors if model.matches(names))
    if matching:
        return matching[0]
    if len(projectors) == 1:
        only, names = projectors[0]
        if not model.names or not names.names:
            return only
    return ""


def projector_for(model_path: str | os.PathLike[str]) -> Path | None:
    """The projector in the model's folder that goes with it, by the rules above."""
    path = Path(model_path)
    probe = probe_file(path)
    if probe.role != "model":
        return None
    found: list[tuple[str, Names]] = []
    try:
        entries = sorted(os.scandir(path.parent), key=lambda e: e.name)
    except OSError:
        return None
    for entry in entries:
        if not is_gguf_name(entry.name) or entry.name == path.name:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
        except OSError:
            continue
        p = probe_file(entry.path)
        if p.role == "projector":
            found.append((entry.name, Names.of(p)))
    name = pair(Names.of(probe), found)
    return path.parent / name if name else None
