"""Machine facts: the memory this process may hold, read once, by one reader.

Theory of operation
-------------------
The ground floor under the engine, the planner and models/: it imports nothing of bmoe.
Three figures say how much memory a model may take here:

* ``memory_total()`` — the machine's memory (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``);
* ``mem_available()`` — ``MemAvailable`` in ``/proc/meminfo``;
* the memory cgroup's limit and the headroom under it (``cgroup.cgroup_memory()``: v1
  or v2, the tightest level from this process's group up to the mount's root).

``MemoryFacts.budget`` is the arithmetic every reader shares: the smaller of
MemAvailable and the cgroup's headroom, plus what the loaded model holds (it would be
unloaded first), never more than the machine has. The expert cache's budget
(``engine/experts/budget.py``), the planner's memory probe (``planner/probes.py``) and
the inspect verdict (``models/verdict.py``) all read these, so they cannot disagree.
A figure that cannot be read is 0 (or None for a cgroup limit), never a guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .cgroup import cgroup_memory

MIB = 1 << 20


def mem_available() -> int:
    """MemAvailable, bytes (0 when /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_total() -> int:
    """The machine's memory, bytes (0 when the system will not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def cgroup_limits() -> tuple[int | None, int | None]:
    """(limit, headroom) of this process's memory cgroup, (None, None) without one."""
    cg = cgroup_memory()
    return (cg.limit, cg.headroom) if cg is not None else (None, None)


@dataclass
class MemoryFacts:
    total: int
    available: int                 # MemAvailable
    cgroup_limit: int | None       # the tightest memory cgroup limit, None without one
    cgroup_headroom: int | None    # what that cgroup still lets this process take
    loaded_held: int               # what the loaded model holds (given, 0 without one)

    @property
    def budget(self) -> int:
        """What this process may hold for a model loaded now (the loaded one unloaded)."""
        room = self.available
        if self.cgroup_headroom is not None:
            room = min(room, self.cgroup_headroom) if room else self.cgroup_headroom
        room = max(0, room) + self.loaded_held
        return min(room, self.total) if self.total else room

    @property
    def cgroup_bound(self) -> bool:
        return self.cgroup_headroom is not None and (
            not self.available or self.cgroup_headroom < self.available)


def probe_memory(loaded_held: int = 0) -> MemoryFacts:
    """The three figures, read now; `loaded_held`: what the loaded model holds."""
    limit, headroom = cgroup_limits()
    return MemoryFacts(memory_total(), mem_available(), limit, headroom, loaded_held)
