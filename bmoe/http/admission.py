"""Admission: what a connection may hold while it is not yet, or no longer, being served.

Theory of operation
-------------------

A connection lives in two phases, over and over (keep-alive):

* **reading** (no worker): it waits for a request and reads its head, under the head
  deadline (from the head's first byte). Every accepted connection has its own cheap task for this, one of at most
  READERS (``Readers``).
* **served** (a worker): once its head is whole and the access checks and the route
  have passed, the request waits for one of WORKERS workers (``Workers``), which reads
  the body, runs the handler and sends the answer. Then the connection is reading again.

So only requests whose head arrived whole compete for workers, and a connection idle
between two requests holds none.

``Workers``: WORKERS tokens and a queue of at most ACCEPT_QUEUE requests. The queue is
served by **ticket**, the order in which requests began to arrive (a new connection's
ticket is taken at accept, a kept-alive one's at the first byte of its next request),
not the order their heads completed. While the queue is full, a new connection is closed
at once, and so is a connection whose next request comes whole.

``Readers``: a connection that is reading holds a ``Seat``. On it, the connection is

* *idle* — no byte of its next request yet. An idle seat can be taken back: a new
  connection that finds every seat taken closes the oldest idle connection of its own
  peer, else the oldest idle one; when no seat is idle, the newcomer is closed at once.
  A connection that lingers after a refusal (draining what its client still sends)
  counts as idle too.
* *arriving* — it must wait for more bytes of a request it has begun (a head, or the
  body of a refused request it drains). That needs one of its peer's PEER_ARRIVING
  places; when its peer has none left, the connection is closed at once.

A request that arrives whole in the bytes at hand never needs a place: a client that
sends its head in one piece is served however many tricklers share its address. A peer
is its address; IPv6 addresses count per /64, the block one host is usually given.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import trio

from . import limits


def peer_key(ip: str) -> str:
    """The peer a connection's address belongs to: the IPv4 address (also when mapped
    into IPv6), or the /64 an IPv6 address lies in."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


# --- workers -----------------------------------------------------------------------

@dataclass
class _Waiter:
    ticket: int
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False


class Workers:
    """``size`` worker tokens; at most ``queue`` requests wait for one, lowest ticket first."""

    def __init__(self, size: int, queue: int) -> None:
        self._free = size
        self._queue_limit = queue
        self._waiting: dict[int, _Waiter] = {}
        self._tickets = itertools.count()

    def ticket(self) -> int:
        """The next request's place in the arrival order."""
        return next(self._tickets)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def full(self) -> bool:
        """No room for one more request to wait."""
        return not self._free and len(self._waiting) >= self._queue_limit

    @asynccontextmanager
    async def hold(self, ticket: int) -> AsyncIterator[None]:
        """One worker for the body of the block, waiting in the queue if none is free."""
        await self._acquire(ticket)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, ticket: int) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            await trio.lowlevel.checkpoint()
            return
        waiter = _Waiter(ticket)
        self._waiting[ticket] = waiter
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self._release()             # handed a worker as it was cancelled: pass it on
            else:
                del self._waiting[ticket]
            raise

    def _release(self) -> None:
        if not self._waiting:
            self._free += 1
            return
        waiter = self._waiting.pop(min(self._waiting))
        waiter.granted = True
        waiter.event.set()


# --- readers -----------------------------------------------------------------------

class Seat:
    """A reading connection's place among the readers (see the module docstring)."""

    def __init__(self, readers: Readers, key: str) -> None:
        self.readers = readers
        self.key = key
        self.arriving = False             # holds one of its peer's places
        self.scope: trio.CancelScope | None = None   # cancelled to take an idle seat back
        self.gone = False

    def take_place(self) -> bool:
        """A place to wait for the rest of a request; False when the peer has none left."""
        if not self.arriving:
            if self.readers.arriving[self.key] >= self.readers.per_peer:
                return False
            self.readers.arriving[self.key] += 1
            self.arriving = True
        return True

    def drop_place(self) -> None:
        if self.arriving:
            self.arriving = False
            self.readers.arriving[self.key] -= 1
            if not self.readers.arriving[self.key]:
                del self.readers.arriving[self.key]

    @contextmanager
    def idle(self, scope: trio.CancelScope) -> Iterator[None]:
        """While inside, this seat may be taken back by cancelling ``scope``."""
        self.drop_place()
        self.scope = scope
        if not self.gone:
            self.readers.idle[self] = None
        try:
            yield
        finally:
            self.readers.idle.pop(self, None)
            self.scope = None

    def leave(self) -> None:
        """The connection closes, or takes a worker: the seat is free again."""
        self.drop_place()
        self.readers.idle.pop(self, None)
        if not self.gone:
            self.gone = True
            self.readers.seated -= 1


class Readers:
    """At most ``size`` reading connections; per peer, at most ``per_peer`` arriving."""

    def __init__(self, size: int, per_peer: int) -> None:
        self.size = size
        self.per_peer = per_peer
        self.seated = 0
        self.arriving: Counter[str] = Counter()
        self.idle: dict[Seat, None] = {}  # in the order they became idle: oldest first

    def seat(self, ip: str) -> Seat | None:
        """A seat for a connection from ``ip``, taking an idle one back if all are
        taken; None when none can be had (close the connection at once)."""
        key = peer_key(ip)
        if self.seated >= self.size and not self._take_back(key):
            return None
        self.seated += 1
        return Seat(self, key)

    def _take_back(self, key: str) -> bool:
        victim = next((s for s in self.idle if s.key == key), None) or next(iter(self.idle), None)
        if victim is None:
            return False
        assert victim.scope is not None
        victim.scope.cancel()
        victim.leave()
        return True


@dataclass
class Admission:
    """The workers and the readers of one server."""

    workers: Workers
    readers: Readers

    @classmethod
    def from_limits(cls) -> Admission:
        return cls(Workers(limits.WORKERS, limits.ACCEPT_QUEUE),
                   Readers(limits.READERS, limits.PEER_ARRIVING))
