"""How many bytes the expert cache may hold (`cache-mb`, `auto`, floor, ceiling).

`auto` sizes the cache once, at load, from the memory this process may still take:
the smaller of the system's MemAvailable and the headroom under the memory cgroup's
limit (limit minus what the group holds that reclaim cannot take back), minus
`cache-floor-mb`; then at least one token cycle and at most every expert's bytes, and
at most `cache-ceil-mb` when that is set.

Below one token cycle (the bytes one token's routed experts span over all layers) a
global LRU evicts each expert before the next token asks for it again: it hits 0 % and
costs more than no cache. Such a budget is refused unless `force-cache` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LoadError
from ..telemetry import mem_available_mib

MIB = 1 << 20
AUTO = "auto"


@dataclass(frozen=True)
class Budget:
    bytes: int          # 0: no cache
    mode: str           # "off" | "fixed" | "auto" | "all"
    available: int      # what auto saw (bytes), 0 when not auto


def cgroup_headroom() -> int | None:
    """Bytes the memory cgroup still lets this process take (None without a limit)."""
    for line in _read("/proc/self/cgroup").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return _v1_headroom(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
        if hier == "0" and controllers == "":
            v2 = _v2_headroom(Path("/sys/fs/cgroup") / path.lstrip("/"))
            if v2 is not None:
                return v2
    return None


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in _read(path).splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def _v1_headroom(group: Path) -> int | None:
    # The tightest limit from this group up to the root (hierarchical accounting).
    best: int | None = None
    g = group
    while True:
        limit = _read(g / "memory.limit_in_bytes").strip()
        usage = _read(g / "memory.usage_in_bytes").strip()
        if limit.isdigit() and usage.isdigit() and int(limit) < (1 << 60):
            st = _stat(g / "memory.stat")
            file = st.get("total_inactive_file", 0) + st.get("total_active_file", 0)
            room = int(limit) - max(0, int(usage) - file)
            best = room if best is None else min(best, room)
        if g == g.parent or g == Path("/sys/fs/cgroup/memory"):
            return best
        g = g.parent


def _v2_headroom(group: Path) -> int | None:
    limit = _read(group / "memory.max").strip()
    current = _read(group / "memory.current").strip()
    if not limit.isdigit() or not current.isdigit():
        return None
    file = _stat(group / "memory.stat").get("file", 0)
    return int(limit) - max(0, int(current) - file)


def resolve(values: dict[str, Any], *, token_cycle: int, all_bytes: int,
            extra_held: int = 0) -> Budget:
    """The cache budget from the settings; raises LoadError for one below a token cycle.

    `extra_held` is memory the cgroup counts as reclaimable but the engine needs (dense
    weights left on the file mapping).
    """
    if values.get("load-all"):
        return Budget(all_bytes, "all", 0)
    raw = values.get("cache-mb", 0)
    force = bool(values.get("force-cache", False))
    if raw == AUTO:
        floor = int(values.get("cache-floor-mb", 1536) or 0) * MIB
        ceil = int(values.get("cache-ceil-mb", 0) or 0) * MIB
        avail = int(mem_available_mib() * MIB)
        room = cgroup_headroom()
        if room is not None:
            avail = min(avail, room - extra_held)
        size = min(max(avail - floor, token_cycle), all_bytes)
        if ceil > 0:
            size = min(size, ceil)
        if size < token_cycle and not force:
            raise LoadError(_too_small("{cache-ceil-mb}", ceil, token_cycle))
        return Budget(size, "auto", avail)
    mib = int(raw or 0)
    if mib <= 0:
        return Budget(0, "off", 0)
    size = min(mib * MIB, all_bytes)
    if size < token_cycle and not force:
        raise LoadError(_too_small("{cache-mb}", mib * MIB, token_cycle))
    return Budget(size, "fixed", 0)


def _too_small(key: str, size: int, cycle: int) -> str:
    return (f"{key} is {size / MIB:.0f} MiB, below one token cycle of this model "
            f"({cycle / MIB:.1f} MiB: the experts one token reads over all layers). A cache "
            "that small evicts every expert before it is used again: it hits 0 % and is "
            "slower than none. Raise it, set {cache-mb} to 0 (no cache) or auto, or set "
            "{force-cache} to measure it anyway.")
