"""Where the trio side meets the engine thread.

`wait_future` awaits a `concurrent.futures.Future` without holding a trio worker
thread. `TokenPipe` carries items (token events) from the engine thread to one trio
task: the engine appends to a bounded deque and wakes the trio side with a
non-blocking `run_sync_soon`; a full pipe makes the engine wait, so a slow reader
slows only its own turn. When the reader goes away the pipe swallows further items
and the turn's cancel flag stops the engine at its next token.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import trio

PIPE_CAPACITY = 4096  # items the engine may run ahead of a turn's reader


async def wait_future(fut: Future[Any]) -> Any:
    """Await `fut`. Cancelling the caller does not stop the work: callers shield
    this once they have asked the engine to stop."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def _wake(_f: Future[Any]) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    fut.add_done_callback(_wake)
    await done.wait()
    return fut.result()


async def let_go(fut: Future[Any]) -> None:
    """After asking the engine to stop: wait, shielded, until it has let go of the job
    (never leave the engine thread holding work for a caller that is gone). The job's
    own outcome is dropped: the caller's exception is the one that matters."""
    with trio.CancelScope(shield=True):
        try:
            await wait_future(fut)
        except Exception:  # noqa: BLE001
            pass


class TokenPipe:
    def __init__(self, cancel: threading.Event, capacity: int = PIPE_CAPACITY) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._cond = threading.Condition()
        self._items: deque[Any] = deque()
        self._capacity = capacity
        self._writer_closed = False
        self._reader_gone = False
        self._wake_pending = False
        self._wake = trio.Event()
        self.cancel = cancel

    # -- engine thread ------------------------------------------------------

    def put(self, item: Any) -> None:
        with self._cond:
            while len(self._items) >= self._capacity and not self._reader_gone:
                self._cond.wait(0.05)
            if self._reader_gone:
                return
            self._items.append(item)
            self._schedule_wake()

    def close_writer(self) -> None:
        with self._cond:
            self._writer_closed = True
            self._schedule_wake()

    def _schedule_wake(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._token.run_sync_soon(self._set_wake)
        except trio.RunFinishedError:
            pass

    # -- trio side ------------------------------------------------------------

    def _set_wake(self) -> None:
        self._wake.set()

    async def get_batch(self) -> list[Any] | None:
        """The items so far (waiting for one); None once the writer closed and all were read."""
        while True:
            with self._cond:
                if self._items:
                    batch = list(self._items)
                    self._items.clear()
                    self._cond.notify_all()
                    return batch
                if self._writer_closed:
                    return None
                self._wake_pending = False
                self._wake = trio.Event()
                wake = self._wake
            await wake.wait()

    def close_reader(self) -> None:
        with self._cond:
            self._reader_gone = True
            self._items.clear()
            self._cond.notify_all()
        self.cancel.set()
