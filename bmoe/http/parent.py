"""``--parent-pid``: stop the server when the process that started it ends."""

from __future__ import annotations

import logging
import os

import trio

from . import limits

log = logging.getLogger("bmoe.http")


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a running process (a zombie counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                      # it exists, under another user
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False              # no /proc here (macOS): trust kill()
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"


async def watch_parent(pid: int, cancel_scope: trio.CancelScope) -> None:
    """Poll every ``PARENT_POLL_S``; cancel ``cancel_scope`` once ``pid`` is gone.

    When ``pid`` is our own parent, being re-parented also counts as its end, so a
    reused pid cannot keep the server alive."""
    was_parent = os.getppid() == pid
    # Polling: no event tells a process that another one (not its child) has ended.
    while process_alive(pid) and not (was_parent and os.getppid() != pid):  # noqa: ASYNC110
        await trio.sleep(limits.PARENT_POLL_S)
    log.warning("parent process %d has ended: stopping", pid)
    cancel_scope.cancel()
