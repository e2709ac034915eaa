"""Tasks (`docs/agent.md`, "Tasks"): schedules checked, a one-minute schedule firing
under trio's mock clock, a run missed while the server was down started once at start
(under the mock clock, and on a real server), run now and `409 busy`, driven by the
scripted provider of `test_agent_e2e`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from _e2e_support import wait_for
from conftest import start_server
from test_agent_e2e import (Scripted, api, conversation, provider, tool_call,  # noqa: F401
                            wait_idle, wait_item, workspace)

from bmoe.agent import tasks

BASE = 1_800_000_030.0          # a wall clock half a minute past a minute


@pytest.mark.parametrize("raw", [{"cron": "*/5 * * * *"}, {"cron": "0 9 * * 1-5"},
                                 {"every_s": 60}, None])
def test_good_schedules(raw: Any) -> None:
    assert tasks.check_schedule(raw) == raw


@pytest.mark.parametrize("raw", [{"cron": "61 * * * *"}, {"cron": "* * *"}, {"cron": ""},
                                 {"cron": "* * * * * *"}, {"every_s": 5}, {"every_s": True},
                                 {"every_s": 1.5}, {"cron": "* * * * *", "every_s": 60}, "daily"])
def test_schedules_that_cannot_run(raw: Any) -> None:
    with pytest.raises(tasks.ScheduleError):
        tasks.check_schedule(raw)


def test_next_after() -> None:
    assert tasks.next_after({"every_s": 600}, BASE) == BASE + 600
    nxt = tasks.next_after({"cron": "* * * * *"}, BASE)
    assert nxt is not None and 0 < nxt - BASE <= 60 and nxt % 60 == 0
    assert tasks.next_after(None, BASE) is None


class Recording(tasks.Tasks):
    """The scheduler as built, with what a run does replaced by a note of when."""

    def __init__(self, tmp: Path) -> None:
        svc: Any = SimpleNamespace(state=SimpleNamespace(bus=SimpleNamespace(
            publish=lambda *a, **k: None)), workspaces={"w": {}}, running=lambda cid: False)
        super().__init__(svc, tmp / "tasks.json", wall=lambda: BASE + trio.current_time())
        self.fired: list[float] = []

    async def fire(self, task: dict[str, Any], *, scheduled: bool = False) -> Any:
        self.fired.append(self.wall())
        return None

    async def save(self) -> None:
        pass


async def run_for(t: Recording, seconds: float) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(t.run)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


async def test_a_one_minute_schedule_fires_each_minute(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    t = Recording(tmp_path)
    t.new({"prompt": "x", "workspace": "w", "schedule": {"cron": "* * * * *"}})
    await run_for(t, 3 * 60 + 20)
    assert len(t.fired) == 3, t.fired
    for k, at in enumerate(t.fired, start=1):
        assert at % 60 < 1 and abs(at - (BASE - 30 + 60 * k)) < 1, t.fired
    t.new({"prompt": "y", "workspace": "w", "schedule": {"every_s": 120}, "enabled": False})
    t.fired.clear()
    await run_for(t, 121)                 # a switched-off task never fires
    assert len(t.fired) == 2              # the first task's two minutes only


async def test_a_missed_run_happens_once_at_start(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    t = Recording(tmp_path)
    task = t.new({"prompt": "x", "workspace": "w", "schedule": {"cron": "* * * * *"}})
    task["next_run"] = BASE - 3600        # due an hour ago: sixty times missed
    await run_for(t, 20)
    assert t.fired == [BASE]              # once, at start
    assert task["next_run"] == BASE + 30  # then at the next minute


# -- on a real server ----------------------------------------------------------------------------

def test_run_now_busy_and_a_missed_run_at_start(tmp_path: Path, provider: Scripted,  # noqa: F811
                                                workspace: Path) -> None:  # noqa: F811
    data = tmp_path / "data"
    srv = start_server(data, wait_ready=False)
    try:
        status, w = api(srv, "POST", "/api/workspaces", {"path": str(workspace)})
        status, p = api(srv, "PUT", "/api/providers/p1", {
            "kind": "openai", "base_url": provider.url + "/v1", "model": "scripted",
            "api_key": "sk-x"})
        assert status == 200, p
        body = {"title": "Nightly", "prompt": "Write the note.", "workspace": w["id"],
                "mode": "ask", "route": "p1", "schedule": {"every_s": 3600}}
        status, err = api(srv, "POST", "/api/tasks", dict(body, schedule={"cron": "99 * * * *"}))
        assert status == 400 and err["code"] == "invalid_request" and "cron" in err["error"]
        status, task = api(srv, "POST", "/api/tasks", body)
        assert status == 201 and task["next_run"] > task["created"], task
        tid = task["id"]

        provider.script = [tool_call("write_file", path="note.txt", content="hi\n"), "Written."]
        status, out = api(srv, "POST", f"/api/tasks/{tid}/run")
        assert status == 202 and out["task"]["last_run"]["state"] == "running", out
        cid = out["conversation"]
        waiting = wait_item(srv, cid, "waiting")             # ask mode: the write waits
        status, err = api(srv, "POST", f"/api/tasks/{tid}/run")
        assert status == 409 and err["code"] == "busy"
        api(srv, "POST", f"/api/conversations/{cid}/approval",
            {"item": waiting["id"], "decision": "once"})
        conv = wait_idle(srv, cid)
        assert conv["items"][0]["text"] == "Write the note." and conv["title"].startswith("Nightly")
        assert (workspace / "note.txt").read_text() == "hi\n"
        wait_for(lambda: api(srv, "GET", f"/api/tasks/{tid}")[1]["last_run"]["state"] == "done",
                 30, "the task's run to be marked done")
    finally:
        srv.stop()

    # the server is down when the task is due: it runs once at the next start
    saved = json.loads((data / "agent" / "tasks.json").read_text())
    saved["tasks"][0]["next_run"] = saved["tasks"][0]["created"] - 7200
    (data / "agent" / "tasks.json").write_text(json.dumps(saved))
    provider.script = ["Nothing to do."]
    srv = start_server(data, wait_ready=False)
    try:
        task = wait_for(lambda: (t := api(srv, "GET", f"/api/tasks/{tid}")[1])["last_run"][
            "conversation"] != cid and t, 30, "the missed run to start")
        conv = wait_idle(srv, task["last_run"]["conversation"])
        assert conv["items"][-1]["text"] == "Nothing to do."
        assert task["next_run"] > saved["tasks"][0]["created"]
        status, listing = api(srv, "GET", "/api/conversations")
        assert len(listing["conversations"]) == 2               # one run, not two
        status, _ = api(srv, "DELETE", f"/api/tasks/{tid}")
        assert status == 200 and api(srv, "GET", f"/api/tasks/{tid}")[0] == 404
    finally:
        srv.stop()
