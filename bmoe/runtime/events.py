"""The live event bus behind `GET /api/events` (and `/api/ws`).

Publishing never waits: each subscriber has a bounded queue, and one that falls
too far behind is dropped (its stream ends; the client reconnects). So a slow reader
never blocks the engine, a turn, or another stream.
"""

from __future__ import annotations

import sys
from typing import Any

import trio

SUBSCRIBER_QUEUE = 512  # events a stream may lag behind before it is dropped


class Subscription:
    def __init__(self, bus: "EventBus", local: bool) -> None:
        self._bus = bus
        self.local = local
        self.send, self.receive = trio.open_memory_channel[tuple[str, Any]](SUBSCRIBER_QUEUE)
        self.dropped = False

    def close(self) -> None:
        self._bus._subs.discard(self)
        self.send.close()


class EventBus:
    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def subscribe(self, *, local: bool = True) -> Subscription:
        sub = Subscription(self, local)
        self._subs.add(sub)
        return sub

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, name: str, data: Any, *, local_only: bool = False) -> None:
        """Hand one event to every subscriber (`local_only`: to loopback ones only, as
        the events of an agent conversation that reaches this computer's files)."""
        for sub in list(self._subs):
            if local_only and not sub.local:
                continue
            try:
                sub.send.send_nowait((name, data))
            except trio.WouldBlock:
                sub.dropped = True
                sub.close()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._subs.discard(sub)

    def log(self, level: str, message: str) -> None:
        """One diagnostic: on stderr after `bmoe: ` and as a `log` event."""
        print(f"bmoe: {message}", file=sys.stderr, flush=True)
        self.publish("log", {"level": level, "message": message})
