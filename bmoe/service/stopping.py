"""Clean stops: what SIGTERM and SIGINT do to a running server.

Theory of operation
-------------------
The first signal writes one line naming it, then cancels the running answer, and each
answer that was waiting behind it as soon as it starts: every stream then ends the way
a cancelled answer ends (its last chunk, its end-of-stream marker), not cut off. Once
the turn line is empty, or after ``STOP_GRACE_S``, the scope around the server is
cancelled: that closes every connection and event stream. The caller closes the
session (the expert cache with it) and joins the engine thread in its ``finally``, and
the process exits 0. Settings need no flush: every change was written when it was made.

A second signal ends the process at once, whatever it is waiting for (a load that
llama.cpp cannot interrupt, a client that does not read).
"""

from __future__ import annotations

import os
import signal
import sys

import trio

from ..runtime.state import Runtime

STOP_GRACE_S = 10.0     # the longest the running answers get to end before connections close
POLL_S = 0.05           # how often the drain looks at the turn line

SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def watch_signals(state: Runtime, scope: trio.CancelScope,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run beside the server: the first signal stops it cleanly, the second at once."""
    with trio.open_signal_receiver(*SIGNALS) as signals:
        task_status.started()
        async with trio.open_nursery() as nursery:
            stopping = False
            async for signum in signals:
                name = signal.Signals(signum).name
                if stopping:
                    _say(f"a second {name}: stopping at once")
                    os._exit(128 + signum)
                stopping = True
                _say(f"stopping on {name}: ending the running answer "
                     "(a second signal stops at once)")
                nursery.start_soon(_stop, state, scope)


async def _stop(state: Runtime, scope: trio.CancelScope) -> None:
    state.stopping = True          # new agent messages get 503 stopping from here on
    await _drain(state)
    scope.cancel()


async def _drain(state: Runtime) -> None:
    """Cancel the running answer and every one that starts, until the line is empty."""
    with trio.move_on_after(STOP_GRACE_S):
        while state.turns.busy or state.turns.waiting:
            state.cancel_current()
            await trio.sleep(POLL_S)


def _say(message: str) -> None:
    try:
        print(f"bmoe: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
