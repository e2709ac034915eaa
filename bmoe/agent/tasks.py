"""Tasks (`docs/agent.md`, "Tasks"): saved prompts run on a schedule or on demand.

Theory of operation
-------------------
A task is a prompt, a workspace, an access mode, a route and a schedule (a cron line,
read by `croniter`, or an interval in seconds, or none: run on demand only), kept in
`<data>/agent/tasks.json` (`store.write_json`: temp file, fsync, rename, off the trio
thread). Each task keeps `next_run`, the wall-clock time it is due. One scheduler task
in the agent's nursery wakes at the soonest `next_run` (at most every `TICK_MAX_S`,
and at once when a task is added or changed), starts every task that is due, and sets
its `next_run` after the present. A run that was due while the server was down is
therefore started once at start, not once per missed time.

A run is a new conversation (the task's workspace, mode and route) with the prompt as
its first message; the task's `last_run` names it and says `running`, then `done` or
`error` when that conversation's run ends. A task whose last run still runs is not
started again: a scheduled time is skipped, `POST .../run` is `409 busy`. `task` events
(to loopback streams only) follow each change. The wall clock is a parameter, so a
test drives the scheduler with trio's mock clock.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Protocol

import trio
from croniter import croniter  # type: ignore[import-untyped]

from ..http.errors import HTTPError
from . import conversation as cv
from . import store
from .loop import Run

log = logging.getLogger("bmoe.agent")

TICK_MAX_S = 60.0               # the scheduler looks again at least this often
EVERY_MIN_S = 60                # the shortest interval a task may ask for
TASKS_MAX = 500                 # tasks one server keeps
PROMPT_MAX_CHARS = 100_000      # a task's prompt


class ScheduleError(ValueError):
    """A schedule that cannot run; the message is for people."""


# -- schedules (no I/O) -------------------------------------------------------------------

def check_schedule(raw: Any) -> dict[str, Any] | None:
    """`{"cron": "..."}`, `{"every_s": N}` or None (on demand only)."""
    if raw is None:
        return None
    if isinstance(raw, dict) and set(raw) == {"cron"} and isinstance(raw["cron"], str):
        expr = " ".join(raw["cron"].split())
        if len(expr.split()) != 5 or not croniter.is_valid(expr):
            raise ScheduleError("`schedule.cron` must be a cron line of five fields, "
                                "e.g. \"0 9 * * 1-5\".")
        return {"cron": expr}
    if isinstance(raw, dict) and set(raw) == {"every_s"}:
        n = raw["every_s"]
        if isinstance(n, int) and not isinstance(n, bool) and EVERY_MIN_S <= n <= 366 * 86400:
            return {"every_s": n}
        raise ScheduleError(f"`schedule.every_s` must be a whole number of seconds from "
                            f"{EVERY_MIN_S} to a year.")
    raise ScheduleError("`schedule` must be {\"cron\": \"...\"}, {\"every_s\": N} or null.")


def next_after(schedule: dict[str, Any] | None, t: float) -> float | None:
    """The first time the schedule is due strictly after `t` (local time for cron)."""
    if schedule is None:
        return None
    if "every_s" in schedule:
        return t + schedule["every_s"]
    start = dt.datetime.fromtimestamp(t).astimezone()
    return float(croniter(schedule["cron"], start).get_next(float))


# -- the tasks -------------------------------------------------------------------------------

class TaskHost(Protocol):
    """What the tasks need from the agent service (AgentService is one), typed here so
    this module does not import the service that imports it."""

    @property
    def state(self) -> Any: ...
    @property
    def workspaces(self) -> Mapping[str, dict[str, Any]]: ...
    @property
    def runs(self) -> Mapping[str, Run]: ...

    def running(self, cid: str) -> bool: ...
    async def create(self, title: str, mode: str, workspace: str | None,
                     route: str) -> cv.Conv: ...
    async def post_message(self, conv: cv.Conv, text: str) -> cv.Item: ...


class Tasks:
    def __init__(self, svc: TaskHost, path: Path,
                 wall: Callable[[], float] = time.time) -> None:
        self.svc, self.path, self.wall = svc, path, wall
        self.tasks: dict[str, dict[str, Any]] = {}
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    def load(self) -> None:
        raw = store.read_json(self.path, {})
        for t in (raw.get("tasks") if isinstance(raw, dict) else None) or []:
            if isinstance(t, dict) and isinstance(t.get("id"), str):
                if (t.get("last_run") or {}).get("state") == "running":
                    t["last_run"]["state"] = "error"        # the server stopped under it
                self.tasks[t["id"]] = t

    async def save(self) -> None:
        value = {"tasks": list(self.tasks.values())}
        await trio.to_thread.run_sync(store.write_json, self.path, value)

    def publish(self, task: dict[str, Any], **extra: Any) -> None:
        self.svc.state.bus.publish("task", dict(task, **extra), local_only=True)

    def changed(self) -> None:
        self._changed.set()

    # -- create, change ----------------------------------------------------------------

    def new(self, fields: dict[str, Any]) -> dict[str, Any]:
        if len(self.tasks) >= TASKS_MAX:
            raise HTTPError(400, "invalid_request", f"A server keeps at most {TASKS_MAX} tasks.")
        task = {"id": cv.new_id("t_"), "title": "Task", "prompt": "", "workspace": None,
                "mode": "ask", "route": "local", "schedule": None, "enabled": True,
                "created": cv.now(), "next_run": None, "last_run": None}
        return self.apply(task, fields)

    def apply(self, task: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        task.update(fields)
        if "schedule" in fields or "enabled" in fields:
            task["next_run"] = next_after(task["schedule"], self.wall()) \
                if task["enabled"] else None
        self.tasks[task["id"]] = task
        self.changed()
        return task

    # -- the scheduler -----------------------------------------------------------------

    async def scheduler(self) -> None:
        """Start what is due, sleep until the next one is (or a task changes); forever."""
        while True:
            self._changed = trio.Event()
            now = self.wall()
            due = [t for t in self.tasks.values()
                   if t.get("enabled") and t.get("next_run") is not None and t["next_run"] <= now]
            for t in due:
                t["next_run"] = next_after(t["schedule"], now)
                try:
                    await self.fire(t, scheduled=True)
                except Exception:  # noqa: BLE001 - one task's failure never stops the others
                    log.exception("task %s could not start", t["id"])
                    self.svc.state.bus.log("error", f"the task {t['title']} could not start")
            if due:
                await self.save()
            soonest = min((t["next_run"] for t in self.tasks.values()
                           if t.get("enabled") and t.get("next_run") is not None),
                          default=now + TICK_MAX_S)
            with trio.move_on_after(min(max(soonest - self.wall(), 0.0), TICK_MAX_S)):
                await self._changed.wait()

    def running(self, task: dict[str, Any]) -> bool:
        cid = (task.get("last_run") or {}).get("conversation")
        return isinstance(cid, str) and self.svc.running(cid)

    async def fire(self, task: dict[str, Any], *, scheduled: bool = False) -> cv.Conv | None:
        """Start one run of the task: a new conversation with its prompt."""
        if self.running(task):
            if scheduled:
                return None                     # still running: this time is skipped
            raise HTTPError(409, "busy", "This task is running; wait for it to end or stop "
                            "its conversation.")
        svc = self.svc
        if task.get("workspace") not in svc.workspaces:
            task["last_run"] = {"at": cv.now(), "conversation": None, "state": "error",
                                "error": "The task's workspace was removed."}
            self.publish(task)
            return None
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.wall()))
        conv = await svc.create(f"{task['title']} ({stamp})"[:cv.TITLE_MAX], task["mode"],
                                task["workspace"], task["route"])
        conv["task"] = task["id"]
        try:
            await svc.post_message(conv, task["prompt"])
        except HTTPError as e:
            task["last_run"] = {"at": cv.now(), "conversation": conv["id"], "state": "error",
                                "error": e.message}
            self.publish(task)
            return conv
        task["last_run"] = {"at": cv.now(), "conversation": conv["id"], "state": "running"}
        self.publish(task)
        run = svc.runs.get(conv["id"])
        if run is not None and self._nursery is not None:
            self._nursery.start_soon(self._watch, task, conv, run.done)
        return conv

    async def _watch(self, task: dict[str, Any], conv: cv.Conv, done: trio.Event) -> None:
        await done.wait()
        last = task.get("last_run") or {}
        if last.get("conversation") == conv["id"]:
            last["state"] = "error" if conv["state"] == "error" else "done"
            self.publish(task)
            await self.save()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self.scheduler()
