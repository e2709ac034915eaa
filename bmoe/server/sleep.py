"""``--sleep-idle-seconds N``: the model is unloaded after N seconds with nothing using it,
and the next request that needs it loads it again (llama-server's sleep).

Idle means no request to a route that runs the model under way (`Runtime.active`),
no turn running or waiting, for N seconds since the last one ended. Asleep, the model's
memory is free; `/health` answers ok, `/props` answers as before with ``is_sleeping``
true, `/models` lists the model, `/metrics` reads what the model had when it slept, and
none of them wakes it. A request to a route registered ``model=True`` (chat, Messages,
Responses, `/completion`, `/tokenize`, the token counts, ...) or any caller of
`require_session` (the agent, decide) wakes it: the load starts and the request waits for
it, as a request that arrives during any load does.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from ..http.routes import RouteTable
from ..http.types import Handler, Request
from ..runtime.state import Runtime
from . import llama_compat

POLL_S = 1.0   # how often a model that was busy at its deadline is looked at again


def seconds(args: Any) -> float:
    """The idle time `--sleep-idle-seconds` asks for; 0 when it is off (absent, -1, 0)."""
    raw = getattr(args, "llama_sleep_idle_seconds", None)
    try:
        value = float(raw) if raw is not None else 0.0
    except ValueError:
        return 0.0
    return value if value > 0 else 0.0


async def run(state: Runtime, idle_s: float,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Put the model to sleep whenever it has been idle `idle_s` seconds."""
    task_status.started()
    while True:
        left = idle_s - (time.monotonic() - state.last_active)
        if left > 0:
            await trio.sleep(left)
            continue
        if state.idle():
            await state.fall_asleep(lambda: llama_compat.sleep_views(state))
        await trio.sleep(min(POLL_S, idle_s))


def with_sleep(table: RouteTable, state: Runtime) -> RouteTable:
    """The same routes; each one registered ``model=True`` counts as activity and, if the
    model sleeps, waits for it to load again before it runs."""
    return table.wrapped(lambda r: _waking(r.handler, state) if r.model else r.handler)


def _waking(handler: Handler, state: Runtime) -> Handler:
    async def wake_then(request: Request) -> Any:
        with state.active():
            if state.wake():
                await state.require_session()     # waits for the load; 503 if it failed
            return await handler(request)
    return wake_then
