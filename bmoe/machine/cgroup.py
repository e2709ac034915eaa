"""The memory cgroup: the one reader of this process's limit, and capped child groups.

Theory of operation
-------------------
A memory cgroup caps what a process may hold, page cache included, and the kernel
OOM-kills the process that goes over. Two things here read that limit — the expert
cache's budget (`engine/experts/budget.py`) and the planner's memory probe
(`planner/probes.py`, through `bmoe.machine`) — and both go through `cgroup_memory()`, so they cannot disagree.

Where the groups are comes from `/proc/self/mountinfo` (the `cgroup` mount carrying the
`memory` controller for v1, the `cgroup2` mount for v2: on a hybrid host both exist and
the v1 memory controller is the one that limits) and `/proc/self/cgroup` (this
process's path in each hierarchy). Every level from this process's group up to the
mount's root may carry a limit (hierarchical accounting): the tightest level is the
one that says how much more this process may take. At each level

    headroom = limit - (usage - file pages)

because reclaim can take the page cache back but not anonymous memory. v1 files:
`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat` (`total_*_file`); v2:
`memory.max`, `memory.current`, `memory.stat` (`file`).

`MemoryCap` makes a child group with a hard limit for another process (the benchmarks
and the tests run the engine inside one) and reads what the kernel recorded: the peak
(`memory.max_usage_in_bytes` / `memory.peak`) and the OOM kills (`memory.oom_control`
/ `memory.events`).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_LIMIT = 1 << 60          # v1 writes "no limit" as a number near 2^63
_V1_FILE = ("total_inactive_file", "total_active_file")
_V2_FILE = ("file",)


@dataclass(frozen=True)
class Mount:
    version: int            # 1 or 2
    path: Path              # where the hierarchy is mounted
    root: str               # the hierarchy's path that is mounted there ("/" usually)


@dataclass(frozen=True)
class CgroupMemory:
    """What the tightest memory cgroup on this process's path allows."""

    version: int
    group: Path             # this process's own group (a directory)
    limit: int              # the tightest limit on the path to the root, bytes
    headroom: int           # what that level still lets this process take, bytes
    held: int               # what that level holds that reclaim cannot take back


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _file_bytes(stat_text: str, keys: tuple[str, ...]) -> int:
    total = 0
    for line in stat_text.splitlines():
        k, _, v = line.partition(" ")
        if k in keys and v.strip().isdigit():
            total += int(v)
    return total


def mounts(mountinfo: str | None = None) -> list[Mount]:
    """The memory hierarchies mounted here: v1's memory controller, then v2."""
    text = _read(Path("/proc/self/mountinfo")) if mountinfo is None else mountinfo
    found: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "memory" in options:
            found.append(Mount(1, Path(fields[4]), fields[3]))
        elif fstype == "cgroup2":
            found.append(Mount(2, Path(fields[4]), fields[3]))
    found.sort(key=lambda m: m.version)
    return found


def own_group(mount: Mount, proc_cgroup: str | None = None) -> Path | None:
    """This process's group directory in `mount`'s hierarchy (None if it has none)."""
    text = _read(Path("/proc/self/cgroup")) if proc_cgroup is None else proc_cgroup
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if mount.version == 1 and "memory" not in controllers.split(","):
            continue
        if mount.version == 2 and not (hier == "0" and controllers == ""):
            continue
        if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
            path = path[len(mount.root):]
        group = mount.path / path.lstrip("/")
        return group if group.is_dir() else None
    return None


def _level(version: int, g: Path) -> tuple[int, int] | None:
    """(limit, held) of one group, None where it sets no limit."""
    keys: tuple[str, ...]
    if version == 1:
        raw, used = _read(g / "memory.limit_in_bytes").strip(), _read(
            g / "memory.usage_in_bytes").strip()
        keys = _V1_FILE
    else:
        raw, used = _read(g / "memory.max").strip(), _read(g / "memory.current").strip()
        keys = _V2_FILE
    if not raw.isdigit() or not used.isdigit() or int(raw) >= NO_LIMIT:
        return None
    file = _file_bytes(_read(g / "memory.stat"), keys)
    return int(raw), max(0, int(used) - file)


def read_group(version: int, group: Path, top: Path) -> CgroupMemory | None:
    """The tightest level from `group` up to `top` (the mount point), None if none limits."""
    best: CgroupMemory | None = None
    g = group
    while True:
        level = _level(version, g)
        if level is not None:
            limit, held = level
            if best is None or limit - held < best.headroom:
                best = CgroupMemory(version, group, limit, limit - held, held)
        if g == top or g == g.parent or top not in g.parents:
            return best
        g = g.parent


def cgroup_memory(mountinfo: str | None = None,
                  proc_cgroup: str | None = None) -> CgroupMemory | None:
    """The memory cgroup that limits this process (v1 or v2), None without a limit."""
    for mount in mounts(mountinfo):
        group = own_group(mount, proc_cgroup)
        if group is None:
            continue
        found = read_group(mount.version, group, mount.path)
        if found is not None or mount.version == 1:
            return found        # a v1 memory controller is the one that limits
    return None


# -- a child group with a hard limit (benchmarks and tests) ----------------------------


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here (not root, or no memory controller)."""


class MemoryCap:
    """A new memory cgroup with a hard limit that a child process is started in.

    v1: a child of this process's memory group. v2: a child of this process's group
    when that group delegates the memory controller, else of the hierarchy's root
    (v2 forbids a group with processes from having children with controllers).
    """

    def __init__(self, name: str, limit_bytes: int) -> None:
        found = mounts()
        if not found:
            raise CgroupUnavailable("no memory cgroup is mounted here (neither a v1 memory "
                                    "controller nor cgroup2 in /proc/self/mountinfo)")
        mount = found[0]
        self.version = mount.version
        parent = own_group(mount)
        if parent is None:
            raise CgroupUnavailable(f"this process has no group in {mount.path}")
        if self.version == 2:
            parent = _v2_parent(mount, parent)
        self.path = parent / name
        self.limit = int(limit_bytes)
        try:
            self.path.mkdir(exist_ok=True)
            if self.version == 1:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            else:
                (self.path / "memory.max").write_text(str(self.limit))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        except OSError as e:
            raise CgroupUnavailable(f"cannot make the memory cgroup {self.path}: {e} "
                                    "(it needs root)") from e

    def enter(self) -> None:
        """Move the calling process into the group (a `preexec_fn` for subprocess)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def reset_peak(self) -> None:
        """Start the peak afresh (v1 resets on write; v2 from kernel 6.12)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            (self.path / name).write_text("0")
        except OSError:
            pass

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        self.reset_peak()
        return subprocess.Popen(cmd, preexec_fn=self.enter, **kw)

    def run(self, cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
        self.reset_peak()
        return subprocess.run(cmd, preexec_fn=self.enter, capture_output=True, text=True,
                              timeout=timeout, **kw)

    def peak(self) -> int:
        """The most the group held since it was made (or since `reset_peak`), bytes."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int((self.path / name).read_text())

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for going over its limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _v2_parent(mount: Mount, own: Path) -> Path:
    """A v2 group whose children may have the memory controller."""
    for g in (own, mount.path):
        if "memory" in _read(g / "cgroup.subtree_control").split():
            return g
    try:
        (mount.path / "cgroup.subtree_control").write_text("+memory")
    except OSError as e:
        raise CgroupUnavailable(f"the cgroup2 root {mount.path} does not delegate the memory "
                                f"controller and cannot be made to: {e}") from e
    return mount.path
