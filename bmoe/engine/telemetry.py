"""Per-token figures that the process itself can measure.

Memory and fault counters come from the kernel (`/proc`, `getrusage`); the expert
figures come from the streamer when one runs. A figure nothing measures reports the
contract's "unmeasured" value (-1 for `cache_hit_pct` and `dense_resident_frac`,
0 for times and bytes), never an invented one.
"""

from __future__ import annotations

import glob
import os
import resource
import time
from typing import Any

from ..machine import mem_available

_PAGE = os.sysconf("SC_PAGE_SIZE")
_SAMPLE_S = 0.25          # memory figures are re-read at most this often
_TEMP_SAMPLE_S = 1.5      # CPU temperature sampling period (the contract's)


class ProcessProbe:
    def __init__(self) -> None:
        self._mem_at = 0.0
        self._rss_mib = 0.0
        self._avail_mib = 0.0
        self._temp_at = 0.0
        self._temp: float | None = None
        self._zones = glob.glob("/sys/class/thermal/thermal_zone*/temp")
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self._cpu = ru.ru_utime + ru.ru_stime
        self._majflt = ru.ru_majflt

    def _memory(self) -> None:
        now = time.monotonic()
        if now - self._mem_at < _SAMPLE_S:
            return
        self._mem_at = now
        self._rss_mib = rss_mib()
        self._avail_mib = mem_available_mib()

    def _temperature(self) -> float | None:
        now = time.monotonic()
        if self._zones and now - self._temp_at >= _TEMP_SAMPLE_S:
            self._temp_at = now
            vals = []
            for z in self._zones:
                try:
                    with open(z) as f:
                        vals.append(int(f.read().strip()) / 1000.0)
                except (OSError, ValueError):
                    pass
            self._temp = sum(vals) / len(vals) if vals else None
        return self._temp

    def sample(self) -> dict[str, Any]:
        """Counters since the previous sample (cpu_ms, majflt) and current levels."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu = ru.ru_utime + ru.ru_stime
        out: dict[str, Any] = {
            "cpu_ms": (cpu - self._cpu) * 1000.0,
            "majflt": ru.ru_majflt - self._majflt,
        }
        self._cpu = cpu
        self._majflt = ru.ru_majflt
        self._memory()
        out["rss_mib"] = round(self._rss_mib, 1)
        out["mem_available_mib"] = round(self._avail_mib, 1)
        temp = self._temperature()
        if temp is not None:
            out["cpu_temp_c"] = round(temp, 1)
        return out


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def mem_available_mib() -> float:
    """MemAvailable in MiB, by the one reader (`bmoe.machine`); 0 when unread."""
    return mem_available() / (1 << 20)


def token_record(step: int, steps: int, wall_ms: float, streamer: dict[str, Any],
                 probe: dict[str, Any]) -> dict[str, Any]:
    """The `token` event's fields from the engine's and the process's figures."""
    io_ms = float(streamer.get("io_ms", 0.0))
    stall_ms = float(streamer.get("stall_ms", 0.0))
    mgmt_ms = float(streamer.get("mgmt_ms", 0.0))
    overlap = bool(streamer.get("overlap", False))
    flash = stall_ms if overlap else io_ms
    rec: dict[str, Any] = {
        "step": step, "steps": steps, "wall_ms": round(wall_ms, 3),
        "io_ms": round(io_ms, 3),
        "compute_ms": round(max(0.0, wall_ms - flash - mgmt_ms), 3),
        "mgmt_ms": round(mgmt_ms, 3), "stall_ms": round(stall_ms, 3),
        "flash_wait_ms": round(flash, 3),
        "read_mib": round(float(streamer.get("read_mib", 0.0)), 4),
        "cache_hit_pct": streamer.get("cache_hit_pct", -1),
        "cache_budget_mib": streamer.get("cache_budget_mib", 0),
        "dense_resident_frac": streamer.get("dense_resident_frac", -1),
        "mtp_batch": 0,
    }
    rec.update(probe)
    return rec
