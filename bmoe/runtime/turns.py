"""The turn line: one generation at a time, in arrival order.

A request takes a place (`TurnLine.reserve`, refused with 503 `busy` when 16 are
already waiting), then waits for the turn (`Place.wait`). trio's `Lock` is fair, so
places are served first come, first served. A waiter that is cancelled (its client
went away) leaves the line and disturbs nobody. While waiting, a streaming response
is sent keep-alive comments by the caller's `on_wait` callback.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio

from ..http.errors import HTTPError
from ..http.limits import TURN_WAITING

WAIT_COMMENT_INTERVAL_S = 5.0  # seconds between "waiting for a turn" comments


class Place:
    """One request's place in the line: waited for, then held until released."""

    def __init__(self, line: "TurnLine") -> None:
        self._line = line
        self._holding = False
        self._released = False
        self._counted = True  # counted among the line's waiters

    async def wait(self, on_wait: Callable[[], Awaitable[None]] | None = None) -> None:
        try:
            await self._line.take_turn(on_wait)
            self._holding = True
        finally:
            self._uncount()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._line.leave()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._holding:
            self._line.give_back()
        else:
            self._uncount()

    async def __aenter__(self) -> "Place":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


async def _keep_alive(on_wait: Callable[[], Awaitable[None]]) -> None:
    while True:
        await on_wait()
        await trio.sleep(WAIT_COMMENT_INTERVAL_S)


class TurnLine:
    def __init__(self, waiting_max: int = TURN_WAITING) -> None:
        self._lock = trio.Lock()
        self._waiting = 0
        self.waiting_max = waiting_max

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def waiting(self) -> int:
        return self._waiting

    def reserve(self) -> Place:
        """Take a place in line now, or refuse with 503 busy."""
        if self._lock.locked() and self._waiting >= self.waiting_max:
            raise HTTPError(503, "busy",
                            f"The server is busy: one answer is running and {self._waiting} "
                            "are waiting. Try again shortly.",
                            headers=[("Retry-After", "5")])
        self._waiting += 1
        return Place(self)

    async def take_turn(self, on_wait: Callable[[], Awaitable[None]] | None) -> None:
        """Wait for the turn (fair: first come, first served); `on_wait` is called every
        few seconds while another holds it."""
        if on_wait is None or not self._lock.locked():
            await self._lock.acquire()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_alive, on_wait)
            await self._lock.acquire()
            nursery.cancel_scope.cancel()

    def give_back(self) -> None:
        self._lock.release()

    def leave(self) -> None:
        """A place stops waiting (it got the turn, or gave up)."""
        self._waiting -= 1
