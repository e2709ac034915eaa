"""What llama.cpp allocates for a context, in its own words: read from its log.

llama.cpp reports the buffers it makes while `llama_init_from_model` runs, one log line
each (`llama_kv_cache: CPU KV buffer size = 96.00 MiB`, `sched_reserve: CPU compute
buffer size = 24.01 MiB`). Its public C API has no call that returns these figures (the
memory breakdown is C++ only, in `llama-ext.h`), so the streamer listens to the log for
the duration of the context's creation: `LogTap.start()` puts a callback in front of
whatever callback is set (every message still goes on to it), `stop()` puts the old one
back and returns what it heard.

The compute buffer matters because llama.cpp sizes it for a whole ubatch at creation but
commits its pages only when a graph first uses them: at load it holds nothing, and the
first prompt batch takes all of it. The KV buffer is cleared at creation, so it is held
from the load on.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

MIB = 1 << 20
_LINE = re.compile(rb"(\S+) +(compute|KV) buffer size = +([0-9.]+) MiB")


@dataclass(frozen=True)
class ContextAllocs:
    compute: int | None = None      # the CPU compute buffer, bytes (None: not reported)
    kv: int | None = None           # the CPU KV buffer, bytes


def parse(lines: list[bytes]) -> ContextAllocs:
    """The CPU buffers in llama.cpp's log lines (figures are rounded to 0.01 MiB: up)."""
    found: dict[bytes, int] = {}
    for line in lines:
        m = _LINE.search(line)
        if m and m.group(1).startswith(b"CPU"):
            n = int(float(m.group(3)) * MIB) + MIB // 100
            found[m.group(2)] = found.get(m.group(2), 0) + n
    return ContextAllocs(found.get(b"compute"), found.get(b"KV"))


class LogTap:
    """Hears llama.cpp's log lines between `start` and `stop`, passing each one on."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._prev: Any = None
        self._prev_data: Any = None
        self._fn: Any = None

    def start(self) -> None:
        cb, data = lc.llama_log_callback(), ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(cb), ctypes.byref(data))
        self._prev, self._prev_data = cb, data

        @lc.llama_log_callback
        def _hear(level: int, text: bytes, user: ctypes.c_void_p) -> None:
            if text and (b"buffer size" in text):
                self.lines.append(bytes(text))
            prev = self._prev
            if prev:
                prev(level, text, self._prev_data)

        self._fn = _hear
        lc.llama_log_set(_hear, ctypes.c_void_p(0))

    def stop(self) -> ContextAllocs:
        if self._fn is not None:
            lc.llama_log_set(self._prev, self._prev_data)
            self._fn = None
        return parse(self.lines)
