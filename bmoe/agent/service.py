"""The agent's state on the trio side: conversations, workspaces, providers, runs.

Theory of operation
-------------------
Everything lives in memory and is written through: a conversation is saved whole to
`<data>/agent/conversations/<id>.json` (`store.write_json`: temp file, fsync, rename)
on a worker thread after each change that ends something (an item done, a state
change); one lock per conversation keeps its saves in order, and each save takes a
fresh snapshot, so the file on disk is always a whole, recent conversation. Deltas
are events only. At start every file is read back and whatever was running is marked
as ended (`conversation.recover`).

A run is a task in the service's nursery (`Run.main` under the run's cancel scope);
`stop` cancels that scope, which cancels the turn (the engine lets go of it), kills a
running command's process group, or ends a wait for approval.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import trio

from ..http.errors import HTTPError
from ..runtime.state import Runtime
from . import conversation as cv
from . import store
from .loop import Run, failure_notice, load_test_script
from .mcp import McpServers
from .providers import ProviderStore
from .skills import SkillStore
from .tasks import Tasks

log = logging.getLogger("bmoe.agent")

STOP_WAIT_S = 30.0        # how long POST .../stop waits for the run to end


def busy() -> HTTPError:
    return HTTPError(409, "busy", "This conversation is running; stop it or wait for it to end.")


def not_found(what: str = "conversation") -> HTTPError:
    return HTTPError(404, "not_found", f"There is no such {what}.")


class AgentService:
    def __init__(self, state: Runtime, data_dir: Path, *, chat_only: bool = False,
                 preview_network: str = "auto", skills_dir: Path | None = None,
                 mcp_config: Path | None = None) -> None:
        self.state = state
        self.dir = data_dir / "agent"
        self.conv_dir = self.dir / "conversations"
        self.chat_only = chat_only
        self.preview_network = preview_network
        self.convs: dict[str, cv.Conv] = {}
        self.workspaces: dict[str, dict[str, Any]] = {}
        self.providers = ProviderStore(data_dir)
        self.skills = SkillStore(data_dir, skills_dir)
        self.tasks = Tasks(self, self.dir / "tasks.json")
        self.mcp = McpServers(mcp_config or data_dir / "mcp.json", self._publish_mcp)
        self.runs: dict[str, Run] = {}
        self.stopping = False
        self._locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._test_script = load_test_script()

    # -- start and stop ----------------------------------------------------------------

    def load(self) -> None:
        """Read everything back (worker thread, at start)."""
        store.clean_temporaries(self.conv_dir)
        store.clean_temporaries(self.dir)
        if self.conv_dir.is_dir():
            for p in self.conv_dir.glob("*.json"):
                conv = store.read_json(p, None)
                if isinstance(conv, dict) and isinstance(conv.get("items"), list) \
                        and conv.get("id") == p.stem:
                    if cv.recover(conv):
                        store.write_json(p, conv)
                    self.convs[conv["id"]] = conv
        raw = store.read_json(self.dir / "workspaces.json", {})
        for w in (raw.get("workspaces") if isinstance(raw, dict) else None) or []:
            if isinstance(w, dict) and isinstance(w.get("id"), str):
                self.workspaces[w["id"]] = w
        self.providers.load()
        self.tasks.load()
        self.mcp.load()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.load)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                if not self.chat_only:
                    nursery.start_soon(self.tasks.run)    # a missed run starts now
                    nursery.start_soon(self.mcp.run)      # each server starts when wanted
                    if self.mcp.config_error:
                        self.state.bus.log("warning", self.mcp.config_error)
                await trio.sleep_forever()
        finally:
            self.stopping = True

    # -- events ----------------------------------------------------------------------

    def _publish(self, conv: cv.Conv, name: str, data: Any) -> None:
        self.state.bus.publish(name, data, local_only=cv.is_private(conv))

    def _publish_mcp(self, entry: dict[str, Any]) -> None:
        self.state.bus.publish("mcp", entry, local_only=True)

    def touch(self, conv: cv.Conv) -> None:
        conv["updated"] = cv.now()
        self._publish(conv, "conversation", cv.summary(conv))

    def set_state(self, conv: cv.Conv, state: str) -> None:
        conv["state"] = state
        self.touch(conv)

    def add_item(self, conv: cv.Conv, item: cv.Item) -> None:
        conv["items"].append(item)
        self._publish(conv, "item", {"conversation": conv["id"], "item": item})

    def item_changed(self, conv: cv.Conv, item: cv.Item) -> None:
        self._publish(conv, "item", {"conversation": conv["id"], "item": item})

    def delta(self, conv: cv.Conv, item: cv.Item, **parts: str) -> None:
        self._publish(conv, "delta", {"conversation": conv["id"], "item": item["id"], **parts})

    def fail(self, conv: cv.Conv, code: str, text: str) -> None:
        self.add_item(conv, cv.notice_item("error", code, text))
        conv["state"] = "error"

    # -- files -------------------------------------------------------------------------

    async def save(self, conv: cv.Conv) -> None:
        """Write the conversation whole (shielded: a stop never cuts a save short)."""
        lock = self._locks.setdefault(conv["id"], trio.Lock())
        with trio.CancelScope(shield=True):
            async with lock:
                if conv["id"] not in self.convs:
                    return
                data = store.encode(conv)     # the snapshot, taken on this thread
                await trio.to_thread.run_sync(store.write_bytes, self.path(conv["id"]), data)

    def path(self, cid: str) -> Path:
        return self.conv_dir / f"{cid}.json"

    async def save_workspaces(self) -> None:
        value = {"workspaces": list(self.workspaces.values())}
        await trio.to_thread.run_sync(store.write_json, self.dir / "workspaces.json", value)

    def workspace_root(self, conv: cv.Conv) -> Path | None:
        w = self.workspaces.get(conv.get("workspace") or "")
        return Path(w["path"]) if w else None

    # -- conversations -------------------------------------------------------------------

    def get(self, cid: str) -> cv.Conv:
        conv = self.convs.get(cid)
        if conv is None:
            raise not_found()
        return conv

    def running(self, cid: str) -> bool:
        return cid in self.runs

    async def create(self, title: str, mode: str, workspace: str | None, route: str) -> cv.Conv:
        conv = cv.new_conversation(title, mode, workspace, route)
        self.convs[conv["id"]] = conv
        try:
            await self.save(conv)
        except OSError:              # not on disk (a full data folder): not created
            self.convs.pop(conv["id"], None)
            raise
        self._publish(conv, "conversation", cv.summary(conv))
        return conv

    async def delete(self, conv: cv.Conv) -> None:
        if self.running(conv["id"]):
            raise busy()
        lock = self._locks.setdefault(conv["id"], trio.Lock())
        async with lock:
            self.convs.pop(conv["id"], None)
            await trio.to_thread.run_sync(store.remove, self.path(conv["id"]))
        self._locks.pop(conv["id"], None)
        self._publish(conv, "conversation", dict(cv.summary(conv), deleted=True))

    async def post_message(self, conv: cv.Conv, text: str) -> cv.Item:
        self._check_can_run(conv)
        item = cv.user_item(text)
        if not conv["items"] and conv["title"] in ("", "New conversation"):
            conv["title"] = " ".join(text.split())[:60] or "New conversation"
        self.add_item(conv, item)
        self._start(conv)
        await self.save(conv)
        return item

    async def edit_message(self, conv: cv.Conv, item_id: str, text: str) -> cv.Item:
        self._check_can_run(conv)
        idx = next((i for i, it in enumerate(conv["items"]) if it["id"] == item_id), None)
        if idx is None or conv["items"][idx]["kind"] != "user":
            raise not_found("user message")
        item = conv["items"][idx]
        item["text"] = text
        del conv["items"][idx + 1:]
        self.item_changed(conv, item)
        self._start(conv)
        await self.save(conv)
        return item

    def _check_can_run(self, conv: cv.Conv) -> None:
        if self.stopping or self.state.stopping:
            raise HTTPError(503, "stopping", "The server is stopping; send the message again "
                            "once it is back.")
        if self.running(conv["id"]):
            raise busy()
        if self._nursery is None:
            raise HTTPError(503, "stopping", "The agent is not running yet; try again shortly.")

    def _start(self, conv: cv.Conv) -> None:
        run = Run(self, conv)
        self.runs[conv["id"]] = run
        self.set_state(conv, "running")
        assert self._nursery is not None
        self._nursery.start_soon(self._drive, run)

    async def _drive(self, run: Run) -> None:
        conv = run.conv
        try:
            with run.scope:
                await run.main()
        except Exception as e:  # noqa: BLE001 - a run's failure is a notice, not a crash
            code, text = failure_notice(e)
            if code == "failed" and not hasattr(e, "code"):
                log.exception("an agent run failed")
                self.state.bus.log("error", f"an agent run failed: {type(e).__name__}")
            self.fail(conv, code, text)
        finally:
            with trio.CancelScope(shield=True):
                stopped = run.scope.cancelled_caught
                for item in conv["items"]:
                    if item["kind"] == "tool" and item["state"] in cv.TOOL_OPEN:
                        item["state"] = "denied" if item["state"] == "waiting" else "failed"
                        item["output"] = "The person stopped the run."
                        self.item_changed(conv, item)
                    elif item["kind"] == "assistant" and item.get("state") == "streaming":
                        item["state"] = "done"
                        self.item_changed(conv, item)
                if stopped:
                    self.add_item(conv, cv.notice_item("info", "stopped", "Stopped."))
                if conv["state"] != "error":
                    conv["state"] = "idle"
                self.runs.pop(conv["id"], None)
                self.touch(conv)
                await self.save(conv)
                run.done.set()

    async def stop(self, conv: cv.Conv) -> bool:
        run = self.runs.get(conv["id"])
        if run is None:
            return False
        run.stop()
        with trio.move_on_after(STOP_WAIT_S):
            await run.done.wait()
        return True

    def approve(self, conv: cv.Conv, item_id: str, decision: str, reason: str) -> cv.Item:
        run = self.runs.get(conv["id"])
        if run is None or not run.answer(item_id, decision, reason):
            raise HTTPError(404, "not_found", "That item is not waiting for an approval.")
        return next(it for it in conv["items"] if it["id"] == item_id)

    # -- tests ---------------------------------------------------------------------------

    def test_round(self) -> str | None:
        """The next scripted local round (tests only), taken once it has run."""
        return self._test_script[0] if self._test_script else None

    def test_round_done(self) -> None:
        if self._test_script:
            self._test_script.pop(0)


def folder_of(path: Any) -> Path:
    """An absolute, existing folder, canonical; 400 not_a_folder otherwise."""
    if not isinstance(path, str) or "\x00" in path or not os.path.isabs(path):
        raise HTTPError(400, "not_a_folder", "A workspace is an absolute path to a folder.")
    real = Path(os.path.realpath(path))
    if not real.is_dir():
        raise HTTPError(400, "not_a_folder", f"{path} is not an existing folder.")
    return real
