"""Memory given back when the server goes quiet.

A burst of requests leaves freed memory in the C allocator's heaps (glibc keeps it for
the next allocation, in one heap per thread that allocated): a server that answered
eight clients at once holds on to several MiB it no longer uses, until the process ends.
A local server people leave running should not keep that. So once nothing has used the
model for `QUIET_S` seconds (no turn running or waiting, no model route under way), the
server asks glibc's `malloc_trim(0)` to return its heaps' free pages to the system, once
per quiet spell (`/metrics?process=1` counts them: `bmoe:process_heap_trims_total`). It
runs on the engine thread, which is idle then, so it neither blocks the event loop nor
starts a thread; it takes a few milliseconds.

Only free pages go back: memory in use, by Python or by llama.cpp, is untouched, so a
real leak still shows as growth (the soak, `bench/soak.py`, samples RSS quiet). On a C
library without `malloc_trim` (musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Callable

import trio

from ..runtime.bridge import wait_future
from ..runtime.state import Runtime

QUIET_S = 5.0    # this long with nothing using the model before the heaps are trimmed
POLL_S = 1.0


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` as a callable (it returns 1 when memory went back), or
    None when this C library has no such function."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


def quiet(state: Runtime) -> bool:
    """Nothing uses the model: no turn running or waiting, no model route under way
    (with or without a model loaded)."""
    return not state.generating and state.active_requests == 0 and state.turns.waiting == 0


async def run(state: Runtime, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
              ) -> None:
    """Trim the heaps once per quiet spell of `QUIET_S` seconds."""
    trim = malloc_trim()
    task_status.started()
    if trim is None:
        return
    trimmed_for: float | None = None     # the `last_active` whose quiet spell was trimmed
    while True:
        await trio.sleep(POLL_S)
        since = state.last_active
        if since == trimmed_for or time.monotonic() - since < QUIET_S or not quiet(state):
            continue
        await wait_future(state.engine.submit(trim))
        trimmed_for = since
        state.heap_trims += 1
