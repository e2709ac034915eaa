"""A conversation and its items as stored (plain JSON values), and what the model sees.

Pure: no I/O. Shapes are `docs/agent.md`'s.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

MODES = ("read", "ask", "full")
CONV_STATES = ("idle", "running", "waiting", "error")
TOOL_OPEN = ("composing", "waiting", "running")
TITLE_MAX = 200

Conv = dict[str, Any]
Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(8)


def now() -> float:
    return round(time.time(), 3)


def new_conversation(title: str, mode: str, workspace: str | None, route: str) -> Conv:
    t = now()
    return {"id": new_id("c_"), "title": title[:TITLE_MAX], "created": t, "updated": t,
            "state": "idle", "mode": mode, "workspace": workspace, "route": route,
            "allowed": [], "items": []}


def user_item(text: str) -> Item:
    return {"id": new_id("i_"), "kind": "user", "created": now(), "text": text}


def assistant_item() -> Item:
    return {"id": new_id("i_"), "kind": "assistant", "created": now(), "text": "",
            "reasoning": "", "state": "streaming"}


def tool_item(parent: str, call_id: str, name: str) -> Item:
    return {"id": new_id("i_"), "kind": "tool", "created": now(), "parent": parent,
            "call_id": call_id, "name": name, "arguments": "", "state": "composing",
            "output": "", "reason": ""}


def notice_item(state: str, code: str, text: str) -> Item:
    return {"id": new_id("i_"), "kind": "notice", "created": now(), "state": state,
            "code": code, "text": text}


def summary(conv: Conv) -> dict[str, Any]:
    """The `conversation` event's data."""
    return {k: conv[k] for k in ("id", "title", "state", "updated")}


def listing_entry(conv: Conv) -> dict[str, Any]:
    return {k: conv[k] for k in ("id", "title", "state", "updated", "created", "mode",
                                 "workspace", "route")}


def is_private(conv: Conv) -> bool:
    """A conversation that reaches this computer (a workspace) or a secret (a provider)."""
    return bool(conv.get("workspace")) or conv.get("route", "local") != "local"


def compaction_point(conv: Conv) -> int | None:
    """Where to move `elide_before`: first so that only the last round's results stay
    whole (the assistant item before the current one), then so that none do (the
    current one); None when nothing more can be left out."""
    items, done = conv["items"], conv.get("elide_before", 0)
    assistants = [i for i, it in enumerate(items) if it["kind"] == "assistant"]
    for point in assistants[-2:]:
        if point > done and any(it["kind"] == "tool" for it in items[done:point]):
            return point
    return None


def recover(conv: Conv) -> bool:
    """After a restart: nothing runs any more. Returns whether anything changed."""
    changed = False
    for item in conv["items"]:
        if item["kind"] == "assistant" and item.get("state") == "streaming":
            item["state"] = "done"
            changed = True
        elif item["kind"] == "tool" and item.get("state") in TOOL_OPEN:
            item["state"] = "failed"
            item["output"] = "The server stopped before this call finished."
            changed = True
    if conv["state"] in ("running", "waiting"):
        conv["state"] = "idle"
        changed = True
    return changed


ELIDED = "(this result was left out to fit the model's context; call the tool again if needed)"


def to_messages(conv: Conv) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI shape, tool calls' arguments as text).
    Tool results of items before `elide_before` are left out (compaction)."""
    out: list[dict[str, Any]] = []
    items = conv["items"]
    elided = {it["id"] for it in items[: conv.get("elide_before", 0)] if it["kind"] == "tool"}
    calls_of: dict[str, list[Item]] = {}
    for item in items:
        if item["kind"] == "tool":
            calls_of.setdefault(item["parent"], []).append(item)
    for item in items:
        kind = item["kind"]
        if kind == "user":
            out.append({"role": "user", "content": item["text"]})
        elif kind == "assistant":
            calls = calls_of.get(item["id"], [])
            msg: dict[str, Any] = {"role": "assistant", "content": item["text"]}
            if item.get("reasoning"):
                msg["reasoning_content"] = item["reasoning"]
            if calls:
                msg["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"] or "{}"}} for c in calls]
            out.append(msg)
            for c in calls:
                text = ELIDED if c["id"] in elided else \
                    c.get("output") or f"(the call ended {c['state']})"
                out.append({"role": "tool", "tool_call_id": c["call_id"], "content": text})
    return out
