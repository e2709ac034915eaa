"""Remote models a conversation may be routed to, through the official SDKs.

`providers.json` (in `<data>/agent/`) lists them without secrets; their keys are in
`<data>/credentials.json`, created 0600, and are never returned, logged or put on a
command line. A round streams through `openai.AsyncOpenAI` (chat completions with
tools) or `anthropic.AsyncAnthropic` (Messages); both run on trio through httpx. A
provider's failure is a `ProviderError` whose message is a sentence for the person.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from . import store

KINDS = ("openai", "anthropic")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PROVIDER_TIMEOUT_S = 600.0       # one round's longest wait for a provider
PROVIDER_MAX_TOKENS = 8192       # an Anthropic round's max_tokens (required there)


class ProviderError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class Call:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class RoundResult:
    text: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)


class Sink(Protocol):
    """Where a round's stream goes as it arrives (the conversation's items)."""

    async def text(self, s: str) -> None: ...
    async def reasoning(self, s: str) -> None: ...
    async def call_start(self, index: int, call_id: str, name: str) -> None: ...
    async def call_args(self, index: int, s: str) -> None: ...
    async def reset(self, text: str, reasoning: str) -> None: ...


class ProviderStore:
    def __init__(self, data_dir: Path) -> None:
        self.list_path = data_dir / "agent" / "providers.json"
        self.cred_path = data_dir / "credentials.json"
        self.providers: dict[str, dict[str, Any]] = {}

    def load(self) -> None:
        raw = store.read_json(self.list_path, {})
        items = raw.get("providers") if isinstance(raw, dict) else None
        self.providers = {p["id"]: p for p in items or [] if isinstance(p, dict) and
                          isinstance(p.get("id"), str)}

    def listing(self) -> list[dict[str, Any]]:
        keys = self._keys()
        return [dict(p, has_key=bool(keys.get(p["id"]))) for p in self.providers.values()]

    def _keys(self) -> dict[str, str]:
        raw = store.read_json(self.cred_path, {})
        prov = raw.get("providers") if isinstance(raw, dict) else None
        return {k: v for k, v in (prov or {}).items() if isinstance(v, str)}

    def key(self, pid: str) -> str:
        return self._keys().get(pid, "")

    def save(self, pid: str, entry: dict[str, Any], key: str | None) -> dict[str, Any]:
        """Write the entry (and its key, when one is given). Worker thread."""
        self.providers[pid] = entry
        store.write_json(self.list_path, {"providers": list(self.providers.values())})
        if key is not None:
            self._write_key(pid, key)
        return dict(entry, has_key=bool(self.key(pid)))

    def delete(self, pid: str) -> None:
        self.providers.pop(pid, None)
        store.write_json(self.list_path, {"providers": list(self.providers.values())})
        self._write_key(pid, None)

    def _write_key(self, pid: str, key: str | None) -> None:
        raw = store.read_json(self.cred_path, {})
        raw = raw if isinstance(raw, dict) else {}
        prov: dict[str, str] = raw["providers"] if isinstance(raw.get("providers"), dict) else {}
        if key:
            prov[pid] = key
        else:
            prov.pop(pid, None)
        raw["providers"] = prov
        store.write_json(self.cred_path, raw, mode=0o600)


def check_entry(pid: str, body: dict[str, Any]) -> dict[str, Any]:
    """The saved form of a provider from a request body; ValueError with a sentence."""
    if not ID_RE.match(pid):
        raise ValueError("A provider id is letters, digits, `.`, `_` and `-` (at most 64).")
    kind = body.get("kind")
    if kind not in KINDS:
        raise ValueError("`kind` must be \"openai\" or \"anthropic\".")
    url = body.get("base_url")
    if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
        raise ValueError("`base_url` must be an http or https URL.")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ValueError("`model` must name the provider's model.")
    key = body.get("api_key")
    if key is not None and not isinstance(key, str):
        raise ValueError("`api_key` must be a string.")
    return {"id": pid, "kind": kind, "base_url": url.rstrip("/"), "model": model.strip()}


# -- one round ------------------------------------------------------------------------

Complete = Callable[[list[dict[str, Any]], list[dict[str, Any]], Sink], Awaitable[RoundResult]]


def _redact(text: str, key: str) -> str:
    return text.replace(key, "…") if key else text


def _failure(entry: dict[str, Any], e: Exception, key: str) -> ProviderError:
    import anthropic
    import openai
    name = entry["id"]
    status = getattr(e, "status_code", None)
    if isinstance(e, (openai.APIConnectionError, anthropic.APIConnectionError)):
        if isinstance(e, (openai.APITimeoutError, anthropic.APITimeoutError)):
            return ProviderError(f"The provider {name} did not answer in time.")
        return ProviderError(f"The provider {name} could not be reached at {entry['base_url']}.")
    if status is not None:
        body = getattr(e, "body", None)
        said = ""
        if isinstance(body, dict):
            err = body.get("error", body)
            said = err.get("message", "") if isinstance(err, dict) else ""
        said = _redact(str(said)[:300], key)
        return ProviderError(f"The provider {name} refused the request (HTTP {status})"
                             + (f": {said}" if said else "."))
    return ProviderError(f"The provider {name} sent an answer that could not be read.")


async def complete(entry: dict[str, Any], key: str, system: str | None,
                   messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                   sink: Sink) -> RoundResult:
    """One round with a provider: streamed into `sink`, the whole answer returned."""
    import anthropic
    import openai
    try:
        if entry["kind"] == "anthropic":
            return await _anthropic_round(entry, key, system, messages, tools, sink)
        return await _openai_round(entry, key, system, messages, tools, sink)
    except (openai.APIError, anthropic.APIError) as e:
        raise _failure(entry, e, key) from None
    except (ValueError, KeyError, TypeError):
        raise ProviderError(f"The provider {entry['id']} sent an answer that could not be "
                            "read.") from None


async def _openai_round(entry: dict[str, Any], key: str, system: str | None,
                        messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                        sink: Sink) -> RoundResult:
    import openai
    client = openai.AsyncOpenAI(base_url=entry["base_url"], api_key=key or "none",
                                max_retries=0, timeout=PROVIDER_TIMEOUT_S)
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        _openai_message(m) for m in messages]
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    out = RoundResult()
    by_index: dict[int, Call] = {}
    async with client:
        stream = await client.chat.completions.create(model=entry["model"], messages=msgs,
                                                      stream=True, **kw)
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content:
                out.text += delta.content
                await sink.text(delta.content)
            rc = getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get(
                "reasoning_content")
            if isinstance(rc, str) and rc:
                out.reasoning += rc
                await sink.reasoning(rc)
            for tc in delta.tool_calls or []:
                call = by_index.get(tc.index)
                if call is None:
                    call = by_index[tc.index] = Call(tc.id or f"call_{tc.index}",
                                                     (tc.function.name if tc.function else "") or "")
                    out.calls.append(call)
                    await sink.call_start(len(out.calls) - 1, call.call_id, call.name)
                args = tc.function.arguments if tc.function else None
                if args:
                    call.arguments += args
                    await sink.call_args(out.calls.index(call), args)
    return out


def _openai_message(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "assistant" and m.get("tool_calls"):
        return {"role": "assistant", "content": m.get("content") or None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": _args_text(c["function"]["arguments"])}}
            for c in m["tool_calls"]]}
    if m["role"] == "tool":
        return {"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]}
    return {"role": m["role"], "content": m.get("content") or ""}


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _args_object(args: Any) -> dict[str, Any]:
    if isinstance(args, dict):
        return args
    try:
        value = json.loads(args) if isinstance(args, str) and args.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def anthropic_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Anthropic Messages: tool results become a user turn's blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                     "content": m["content"] or "(no output)"}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": _args_object(c["function"]["arguments"])})
            out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "…"}]})
        else:
            out.append({"role": "user", "content": m.get("content") or ""})
    return out


async def _anthropic_round(entry: dict[str, Any], key: str, system: str | None,
                           messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                           sink: Sink) -> RoundResult:
    import anthropic
    client = anthropic.AsyncAnthropic(base_url=entry["base_url"], api_key=key or "none",
                                      max_retries=0, timeout=PROVIDER_TIMEOUT_S)
    kw: dict[str, Any] = {}
    if tools:
        kw["tools"] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"]} for t in tools]
    if system:
        kw["system"] = system
    out = RoundResult()
    block_call: dict[int, Call] = {}
    async with client:
        async with client.messages.stream(model=entry["model"], max_tokens=PROVIDER_MAX_TOKENS,
                                          messages=anthropic_messages(messages),  # type: ignore[arg-type]
                                          **kw) as stream:
            async for ev in stream:
                if ev.type == "content_block_start" and ev.content_block.type == "tool_use":
                    call = Call(ev.content_block.id, ev.content_block.name)
                    block_call[ev.index] = call
                    out.calls.append(call)
                    await sink.call_start(len(out.calls) - 1, call.call_id, call.name)
                elif ev.type == "content_block_delta":
                    d = ev.delta
                    if d.type == "text_delta":
                        out.text += d.text
                        await sink.text(d.text)
                    elif d.type == "thinking_delta":
                        out.reasoning += d.thinking
                        await sink.reasoning(d.thinking)
                    elif d.type == "input_json_delta" and ev.index in block_call:
                        call = block_call[ev.index]
                        call.arguments += d.partial_json
                        await sink.call_args(out.calls.index(call), d.partial_json)
    return out
