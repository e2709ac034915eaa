"""One run of a conversation: rounds of "call the model, run its tool calls".

Theory of operation
-------------------
`Run.main` appends an assistant item, asks the model for a round (the local model
through the turn service, exactly as `/v1/chat/completions` does: same turn line,
same cancel, same KV prefix reuse; or a provider through its SDK), streams what
arrives into that item and into `tool` items (`composing`), then runs each call: a
call that needs the person's approval waits (`waiting`) for `POST .../approval`.
The results go back as tool messages and the next round starts, until an answer
without calls, a stop (the run's cancel scope), `MAX_ROUNDS`, or a failure, which
becomes a `notice` item (no model, a context that no longer fits, a provider's
error). Nothing here writes files: the service saves the conversation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import trio

from ..engine import params
from ..engine.errors import EngineError
from ..engine.turn import TurnRequest
from ..http.errors import HTTPError
from ..runtime.turnevents import Finished, ReasoningDelta, Reset, TextDelta, ToolArgsDelta, ToolCallStart, TurnEvent
from ..runtime.turnservice import Turn, drive
from ..server import chatreq
from . import conversation as cv
from . import mcp, providers, skills, tools
from .paths import ToolError

MAX_ROUNDS = 40
TEST_SCRIPT_ENV = "BMOE_AGENT_TEST_SCRIPT"   # tests only: the local model's rounds, forced

SYSTEM_PROMPT = (
    "You are a coding agent working in the folder {root}. Use the tools to list, read, "
    "search and change its files and to run commands there; paths are relative to that "
    "folder. Read before you edit. When the work is done, answer briefly without a tool call.")
SYSTEM_READ = " You may only read: writing files and running commands are not allowed here."


class RunHost(Protocol):
    """What a run needs from the service that holds it (AgentService is one): the
    conversation's items and saves, the workspace, the stores. Typed here so the run does
    not import the service that imports it."""

    @property
    def state(self) -> Any: ...
    @property
    def chat_only(self) -> bool: ...
    @property
    def skills(self) -> skills.SkillStore: ...
    @property
    def mcp(self) -> mcp.McpServers: ...
    @property
    def providers(self) -> providers.ProviderStore: ...

    def add_item(self, conv: cv.Conv, item: cv.Item) -> None: ...
    def item_changed(self, conv: cv.Conv, item: cv.Item) -> None: ...
    def delta(self, conv: cv.Conv, item: cv.Item, **parts: str) -> None: ...
    def set_state(self, conv: cv.Conv, state: str) -> None: ...
    def fail(self, conv: cv.Conv, code: str, text: str) -> None: ...
    async def save(self, conv: cv.Conv) -> None: ...
    def workspace_root(self, conv: cv.Conv) -> Path | None: ...
    def test_round(self) -> str | None: ...
    def test_round_done(self) -> None: ...


class Stopped(Exception):
    """The person stopped the run while a call waited for them."""


class ItemSink:
    """A round's stream → the assistant item and its tool items, with their events."""

    def __init__(self, svc: RunHost, conv: cv.Conv, item: cv.Item) -> None:
        self.svc, self.conv, self.item = svc, conv, item
        self.calls: list[cv.Item] = []

    async def text(self, s: str) -> None:
        self.item["text"] += s
        self.svc.delta(self.conv, self.item, text=s)

    async def reasoning(self, s: str) -> None:
        self.item["reasoning"] += s
        self.svc.delta(self.conv, self.item, reasoning=s)

    async def reset(self, text: str, reasoning: str) -> None:
        self.item["text"], self.item["reasoning"] = text, reasoning
        self.svc.item_changed(self.conv, self.item)

    async def call_start(self, index: int, call_id: str, name: str) -> None:
        t = cv.tool_item(self.item["id"], call_id, name)
        self.calls.append(t)
        self.svc.add_item(self.conv, t)

    async def call_args(self, index: int, s: str) -> None:
        if index < len(self.calls):
            self.calls[index]["arguments"] += s
            self.svc.delta(self.conv, self.calls[index], arguments=s)


class Run:
    def __init__(self, svc: RunHost, conv: cv.Conv) -> None:
        self.svc = svc
        self.conv = conv
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.turn: Turn | None = None
        self.waiting: dict[str, tuple[trio.Event, dict[str, Any]]] = {}

    def stop(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()
        self.scope.cancel()

    def answer(self, item_id: str, decision: str, reason: str) -> bool:
        slot = self.waiting.get(item_id)
        if slot is None:
            return False
        slot[1].update(decision=decision, reason=reason)
        slot[0].set()
        return True

    # -- the rounds ------------------------------------------------------------------

    async def main(self) -> None:
        for _ in range(MAX_ROUNDS):
            item = cv.assistant_item()
            self.svc.add_item(self.conv, item)
            sink = ItemSink(self.svc, self.conv, item)
            try:
                calls = await self.round(sink)
            finally:
                item["state"] = "done"
                self.svc.item_changed(self.conv, item)
            await self.svc.save(self.conv)
            if not calls:
                return
            for call in calls:
                await self.run_call(call)
                await self.svc.save(self.conv)
        self.svc.fail(self.conv, "round_limit", f"The run stopped after {MAX_ROUNDS} rounds "
                      "of tool calls without an answer; send a message to let it continue.")

    async def round(self, sink: ItemSink) -> list[cv.Item]:
        conv = self.conv
        root = self.svc.workspace_root(conv)
        offered = [] if self.svc.chat_only else tools.offered(conv["mode"], root is not None)
        system = None
        if not self.svc.chat_only and root is not None:
            system = SYSTEM_PROMPT.format(root=root) + (SYSTEM_READ if conv["mode"] == "read" else "")
            on = await trio.to_thread.run_sync(self.svc.skills.enabled, conv.get("skills") or [])
            if on:
                offered = [*offered, skills.SPEC]
                system += skills.system_note(on)
            if conv["mode"] != "read" and self.svc.mcp.servers:
                offered = [*offered, *await self.svc.mcp.specs()]
        # the assistant item just added holds nothing yet: the model answers after the rest
        if conv["route"] == "local":
            finish = await self.local_round_fitting(system, offered, sink)
            if finish == "cancelled":      # POST /api/cancel, or the server stopping
                self.svc.add_item(conv, cv.notice_item("info", "cancelled",
                                                       "The answer was cancelled."))
                return []
        else:
            entry = self.svc.providers.providers.get(conv["route"])
            if entry is None:
                raise providers.ProviderError(f"The provider {conv['route']} is no longer saved.")
            key = await trio.to_thread.run_sync(self.svc.providers.key, entry["id"])
            messages = cv.to_messages(conv)
            result = await providers.complete(entry, key, system, messages[:-1], offered, sink)
            for i, call in enumerate(result.calls):       # the stream's arguments are whole
                if i < len(sink.calls):
                    sink.calls[i]["arguments"] = call.arguments
        return sink.calls

    async def local_round_fitting(self, system: str | None, offered: list[dict[str, Any]],
                                  sink: ItemSink) -> str:
        """A local round; when the conversation no longer fits the context, the results
        of earlier rounds are left out of what the model sees (the items keep them) and
        the round is tried again, once per step back, until nothing more can go."""
        while True:
            messages = cv.to_messages(self.conv)
            try:
                return await self.local_round(system, messages[:-1], offered, sink)
            except EngineError as e:
                point = cv.compaction_point(self.conv) if e.code == "context_full" else None
                if point is None:
                    raise
                self.conv["elide_before"] = point
                self.svc.add_item(self.conv, cv.notice_item(
                    "info", "compacted", "Earlier tool results were left out of what the "
                    "model sees, so the conversation fits its context."))

    async def local_round(self, system: str | None, messages: list[dict[str, Any]],
                          offered: list[dict[str, Any]], sink: ItemSink) -> str:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            _local_message(m) for m in messages]
        req = TurnRequest(messages=msgs, tools=offered or None, tool_choice="auto",
                          max_tokens=chatreq.budget(None, "max_tokens", self.svc.state.config.values))
        forced = self.svc.test_round()
        if forced is not None:
            req.grammar, req.think = literal_grammar(forced), False
        turn = self.turn = Turn(self.svc.state, req)

        async def emit(ev: TurnEvent) -> None:
            if isinstance(ev, TextDelta):
                await sink.text(ev.text)
            elif isinstance(ev, ReasoningDelta):
                await sink.reasoning(ev.text)
            elif isinstance(ev, Reset):
                await sink.reset(ev.content, ev.reasoning)
            elif isinstance(ev, ToolCallStart):
                await sink.call_start(ev.index, ev.call_id, ev.name)
            elif isinstance(ev, ToolArgsDelta):
                await sink.call_args(ev.index, ev.text)

        try:
            fin: Finished = await drive(turn, emit, "revisable")
            if forced is not None:
                self.svc.test_round_done()
        finally:
            turn.close()
            self.turn = None
        view = fin.view
        sink.item["text"], sink.item["reasoning"] = view.content, view.reasoning
        sink.item["usage"] = {"prompt": fin.n_prompt, "prefilled": fin.n_prefilled,
                              "output": fin.n_output}
        for i, call in enumerate(view.tool_calls):
            if i >= len(sink.calls):
                cid = fin.call_ids[i] if i < len(fin.call_ids) else cv.new_id("call_")
                await sink.call_start(i, cid, call.name)
            sink.calls[i]["arguments"] = call.arguments_text or "{}"
        return fin.finish

    # -- one call ----------------------------------------------------------------------

    async def run_call(self, item: cv.Item) -> None:
        conv, svc = self.conv, self.svc
        root = svc.workspace_root(conv)
        name = item["name"]
        offered = {t["function"]["name"] for t in tools.offered(conv["mode"], root is not None)}
        try:
            args = json.loads(item["arguments"] or "{}")
        except ValueError:
            args = None
        if name == skills.TOOL and root is not None and not svc.chat_only and conv.get("skills"):
            return await self.read_skill(item, args)
        found = svc.mcp.find(name) if root is not None and not svc.chat_only else None
        if found is not None:
            return await self.run_mcp(item, args, *found)
        if root is None or svc.chat_only or name not in tools.SPECS:
            return self.finish(item, "failed", f"There is no tool named {name!r} here.")
        if name not in offered:
            return self.finish(item, "denied", "This conversation is read-only: files cannot be "
                               "written and commands cannot be run.")
        if not isinstance(args, dict):
            return self.finish(item, "failed", "The arguments are not a JSON object.")
        if name in tools.WRITE_TOOLS and not await self.approved(item):
            return None
        item["state"] = "running"
        svc.item_changed(conv, item)
        try:
            if name == "exec_shell_command":
                out = await tools.exec_shell_command(root, args)
            else:
                out = await trio.to_thread.run_sync(tools.SYNC_TOOLS[name], root, args)
        except ToolError as e:
            return self.finish(item, "failed", e.message)
        except OSError as e:
            return self.finish(item, "failed", f"The file could not be used: "
                               f"{e.strerror or 'the system refused'}.")
        self.finish(item, "done", out)

    async def run_mcp(self, item: cv.Item, args: Any, server: mcp.Server, tool: str) -> None:
        """An MCP server's tool: what it does is unknown here, so it is treated as a
        command is (refused in `read`, asked about in `ask`, run in `full`)."""
        conv, name = self.conv, item["name"]
        if conv["mode"] == "read":
            return self.finish(item, "denied", "This conversation is read-only: MCP tools "
                               "cannot be used.")
        if server.state == "running" and tool not in {t.name for t in server.tools}:
            return self.finish(item, "failed", f"There is no tool named {name!r} here.")
        if not isinstance(args, dict):
            return self.finish(item, "failed", "The arguments are not a JSON object.")
        if not await self.approved(item):
            return None
        item["state"] = "running"
        self.svc.item_changed(conv, item)
        try:
            ok, out = await server.call(tool, args)
        except mcp.McpCallError as e:
            return self.finish(item, "failed", e.message)
        self.finish(item, "done" if ok else "failed", out)

    async def read_skill(self, item: cv.Item, args: Any) -> None:
        """`read_skill`: reads what the person installed, so it is never asked about."""
        if not isinstance(args, dict):
            return self.finish(item, "failed", "The arguments are not a JSON object.")
        item["state"] = "running"
        self.svc.item_changed(self.conv, item)
        try:
            out = await trio.to_thread.run_sync(self.svc.skills.read_tool,
                                                list(self.conv.get("skills") or []), args)
        except ToolError as e:
            return self.finish(item, "failed", e.message)
        except (OSError, skills.SkillError):
            return self.finish(item, "failed", "The skill's file could not be read.")
        self.finish(item, "done", out)

    def finish(self, item: cv.Item, state: str, output: str) -> None:
        item["state"], item["output"] = state, output
        self.svc.item_changed(self.conv, item)

    async def approved(self, item: cv.Item) -> bool:
        """In `ask` mode, whether the person lets this call run (a call they denied is
        finished here); in `full`, and for a tool they allowed always, True."""
        conv, name = self.conv, item["name"]
        if conv["mode"] != "ask" or name in conv["allowed"]:
            return True
        decision, reason = await self.approval(item)
        if decision == "deny":
            item["reason"] = reason
            said = "The person denied this call." + (f" Their reason: {reason}" if reason else "")
            self.finish(item, "denied", said)
            return False
        if decision == "always" and name not in conv["allowed"]:
            conv["allowed"].append(name)
        return True

    async def approval(self, item: cv.Item) -> tuple[str, str]:
        event, answer = trio.Event(), dict[str, Any]()
        self.waiting[item["id"]] = (event, answer)
        item["state"] = "waiting"
        self.svc.item_changed(self.conv, item)
        self.svc.set_state(self.conv, "waiting")
        await self.svc.save(self.conv)
        try:
            await event.wait()
        finally:
            self.waiting.pop(item["id"], None)
        self.svc.set_state(self.conv, "running")
        return answer["decision"], answer.get("reason", "")


def _local_message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the chat template reads it (arguments as an object)."""
    if m["role"] != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        args = c["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append({"id": c["id"], "type": "function",
                      "function": {"name": c["function"]["name"], "arguments": args}})
    return dict(m, tool_calls=calls)


def literal_grammar(text: str) -> str:
    """A GBNF that admits exactly `text` (tests: random weights cannot choose tools)."""
    esc = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace(
        "\r", "\\r").replace("\t", "\\t")
    return f'root ::= "{esc}"\n'


def load_test_script() -> list[str]:
    path = os.environ.get(TEST_SCRIPT_ENV)
    if not path:
        return []
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [s for s in value if isinstance(s, str)] if isinstance(value, list) else []


def failure_notice(e: BaseException) -> tuple[str, str]:
    """(code, sentence) for a run's own failure."""
    if isinstance(e, EngineError):
        if e.code == "context_full":
            return "context_full", ("The conversation no longer fits the model's context: "
                                    + params.render(e.message, "label") +
                                    " Start a new conversation, or raise Context and reload.")
        return e.code, params.render(e.message, "label")
    if isinstance(e, HTTPError):
        return e.code or "failed", e.message
    if isinstance(e, providers.ProviderError):
        return "provider_error", e.message
    return "failed", "The run failed because of an error in the server; its log has the details."
