"""Real clients' first requests, replayed against a real bmoe-server on every route.

``tests/fixtures/clients/`` holds the first model request of Claude Code, Codex CLI and
opencode as each really sent it (``scripts/capture-client-requests`` writes them: the
system prompt and the whole tool list; refresh them when those clients update). Each is
sent again here:

* on its own route, as captured (only the answer's budget cut: random weights never
  stop), and once more with its tool choice made ``required`` (``any`` for Messages);
* with its tool list translated into the other two protocols' shapes (Claude Code's
  tools as OpenAI chat tools and as a Responses request, and so on), with tool choice
  ``auto`` and ``required``, so every route sees every real tool list;
* on ``/v1/messages/count_tokens`` with each client's tools;

each streaming and not. Every case must answer ``200`` with a complete answer in its
protocol's shape, or refuse cleanly with ``400`` and the protocol's full-context code,
and the process must be alive afterwards (``GET /api/info`` answers). A case that kills
the server fails, and the next case starts a fresh one.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e2e_support import Reply, call, port_of
from conftest import ServerProcess, start_server

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json"))
PROMPT = "Say hi in one word."
BUDGET = 16                     # the answer's tokens in every case: random weights never stop
TIMEOUT_S = 600.0               # a ~20k-token prompt prefilled on one thread, plus a grammar

MESSAGES, COUNT, RESPONSES, CHAT = ("/v1/messages", "/v1/messages/count_tokens",
                                    "/v1/responses", "/v1/chat/completions")
ROUTES = (MESSAGES, RESPONSES, CHAT)
BILLING_HEADER = "x-anthropic-billing-header:"
SHORT = {MESSAGES: "messages", RESPONSES: "responses", CHAT: "chat", COUNT: "count_tokens"}


def load(path: Path) -> dict[str, Any]:
    fixture = json.loads(path.read_text())
    assert fixture["route"] in ROUTES, fixture["route"]
    assert fixture["body"].get("tools"), f"{path.name}: no tool list"
    return fixture


# -- a client's tools and system prompt, read from its own protocol ------------------

def tools_of(fixture: dict[str, Any]) -> list[dict[str, Any]]:
    """The client's function tools as ``{"name", "description", "schema"}``.

    Tools with no function shape (Codex's hosted ``web_search``) have no counterpart in
    the other protocols; they stay in the replay of the request as sent. A Responses
    ``namespace`` is flattened to its functions, named ``<namespace>__<name>``."""
    route, out = fixture["route"], []
    for tool in fixture["body"]["tools"]:
        if route == MESSAGES:
            if "input_schema" in tool:
                out.append(_tool(tool["name"], tool.get("description"), tool["input_schema"]))
        elif route == CHAT:
            fn = tool.get("function") or {}
            if tool.get("type") == "function" and fn.get("name"):
                out.append(_tool(fn["name"], fn.get("description"), fn.get("parameters")))
        elif tool.get("type") == "function":
            out.append(_tool(tool["name"], tool.get("description"), tool.get("parameters")))
        elif tool.get("type") == "namespace":
            out += [_tool(f"{tool['name']}__{t['name']}", t.get("description"), t.get("parameters"))
                    for t in tool.get("tools") or [] if t.get("type") == "function"]
    assert out, "no function tools"
    return out


def _tool(name: str, description: str | None, schema: Any) -> dict[str, Any]:
    return {"name": name, "description": description or "",
            "schema": schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}}


def system_of(fixture: dict[str, Any]) -> str:
    body, route = fixture["body"], fixture["route"]
    if route == MESSAGES:      # Claude Code's per-request billing header left out, as the server does
        system = body.get("system") or ""
        blocks = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
        return "\n\n".join(b for b in blocks if not b.startswith(BILLING_HEADER))
    if route == CHAT:
        return "\n\n".join(m["content"] if isinstance(m["content"], str) else
                           "\n\n".join(p.get("text", "") for p in m["content"])
                           for m in body["messages"] if m["role"] in ("system", "developer"))
    parts = [body.get("instructions") or ""]
    for item in body.get("input") or []:
        if item.get("type") == "message" and item.get("role") in ("system", "developer"):
            parts += [p.get("text", "") for p in item.get("content") or []]
    return "\n\n".join(p for p in parts if p)


# -- requests ------------------------------------------------------------------------

def translated(fixture: dict[str, Any], route: str, choice: str, stream: bool) -> dict[str, Any]:
    """The client's system prompt and tools as a fresh request on ``route``."""
    tools, system = tools_of(fixture), system_of(fixture)
    if route in (MESSAGES, COUNT):
        body: dict[str, Any] = {
            "model": "bmoe", "system": system, "messages": [{"role": "user", "content": PROMPT}],
            "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                      for t in tools]}
        if route == COUNT:
            return body
        return {**body, "max_tokens": BUDGET, "stream": stream,
                "tool_choice": {"type": "any" if choice == "required" else "auto"}}
    if route == RESPONSES:
        return {"model": "bmoe", "instructions": system, "input": PROMPT, "store": False,
                "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                           "parameters": t["schema"], "strict": False} for t in tools],
                "tool_choice": choice, "max_output_tokens": BUDGET, "stream": stream}
    return {"model": "bmoe", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": PROMPT}],
            "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["schema"]}} for t in tools],
            "tool_choice": choice, "max_tokens": BUDGET, "stream": stream}


def as_sent(fixture: dict[str, Any], choice: str, stream: bool) -> dict[str, Any]:
    """The captured body on its own route: its budget cut, ``stream`` and, for
    ``required``, the tool choice set; every other field as the client sent it.

    Codex sends no budget: the server's ``-n`` bounds its answer, as it would the
    client's."""
    body, route = copy.deepcopy(fixture["body"]), fixture["route"]
    body["stream"] = stream
    if route == MESSAGES:
        body["max_tokens"] = BUDGET
        if choice == "required":
            body["tool_choice"] = {"type": "any"}
    elif route == CHAT:
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body:
                body[key] = BUDGET
        if choice == "required":
            body["tool_choice"] = "required"
    elif choice == "required":
        body["tool_choice"] = "required"
    return body


def count_body(fixture: dict[str, Any]) -> dict[str, Any]:
    if fixture["route"] == MESSAGES:      # the same request, as Claude Code counts it
        body = copy.deepcopy(fixture["body"])
        for key in ("max_tokens", "stream", "metadata", "context_management", "output_config"):
            body.pop(key, None)
        return body
    return translated(fixture, COUNT, "auto", False)


def cases() -> Iterator[Any]:
    for path in FIXTURES:
        name = path.stem
        for route in ROUTES:
            for choice in ("auto", "required"):
                for stream in (False, True):
                    yield pytest.param(path, route, choice, stream,
                                       id=f"{name}-{SHORT[route]}-{choice}-{'stream' if stream else 'whole'}")
        yield pytest.param(path, COUNT, "auto", False, id=f"{name}-count_tokens")


# -- the server ----------------------------------------------------------------------

class LiveServer:
    """One bmoe-server for the module, started again if a case killed it."""

    def __init__(self, data_dir: Path, model: Path) -> None:
        self.data_dir, self.model = data_dir, model
        self.server: ServerProcess | None = None
        self.starts = 0

    def get(self) -> ServerProcess:
        if self.server is None or self.server.proc.poll() is not None:
            if self.server is not None:
                self.server.stop()
            self.starts += 1
            self.server = start_server(self.data_dir / f"run{self.starts}", "-m", str(self.model),
                                       "-c", "131072", "-n", "64")
            assert self.server.info()["state"] == "ready", self.server.info()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[LiveServer]:
    holder = LiveServer(tmp_path_factory.mktemp("real-clients"), tiny_moe)
    try:
        yield holder
    finally:
        holder.stop()


# -- what an answer must be ------------------------------------------------------------

def sse_events(body: bytes) -> list[tuple[str | None, str]]:
    events = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events


def check_answer(route: str, stream: bool, reply: Reply) -> None:
    if not stream or route == COUNT:
        body = reply.json()
        if route == COUNT:
            assert isinstance(body.get("input_tokens"), int) and body["input_tokens"] > 0, body
        elif route == MESSAGES:
            assert body["type"] == "message" and body["role"] == "assistant", body
            assert body["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence"), body
        elif route == RESPONSES:
            assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
        else:
            assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"], body
        return
    events = sse_events(reply.body)
    assert events, reply.body[:500]
    if route == MESSAGES:
        names = [n for n, _ in events]
        assert "error" not in names, events[-3:]
        assert names[0] == "message_start" and names[-1] == "message_stop", names
    elif route == RESPONSES:
        kinds = [json.loads(d)["type"] for _, d in events]
        assert "response.failed" not in kinds and "error" not in kinds, events[-3:]
        assert kinds[0] == "response.created", kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    else:
        assert events[-1][1] == "[DONE]", events[-3:]
        chunks = [json.loads(d) for _, d in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-3:]
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks[-3:]


def is_context_refusal(route: str, reply: Reply) -> bool:
    """A full context, said the way the route's protocol says it."""
    if reply.status != 400:
        return False
    body = reply.json()
    if route in (MESSAGES, COUNT):
        err = body.get("error") or {}
        return err.get("type") == "invalid_request_error" and err.get("message", "").startswith(
            "prompt is too long:")
    if route == RESPONSES:
        return body["error"]["code"] == "context_length_exceeded"
    return body.get("code") == "context_full"


def exit_code(srv: ServerProcess, wait: float = 0.0) -> int | None:
    """The process's exit code (a signal as its negative number), None while it runs.
    A crash closes the socket a moment before the process is gone: ``wait`` for it."""
    try:
        return srv.proc.wait(wait)
    except subprocess.TimeoutExpired:
        return None


# -- the test --------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "route", "choice", "stream"), list(cases()))
def test_real_client_request(live: LiveServer, path: Path, route: str, choice: str, stream: bool) -> None:
    fixture = load(path)
    srv = live.get()
    port = port_of(srv)
    own = route == fixture["route"]
    if route == COUNT:
        body = count_body(fixture)
    elif own:
        body = as_sent(fixture, choice, stream)
    else:
        body = translated(fixture, route, choice, stream)
    headers = [(k, v) for k, v in fixture["headers"].items()
               if own and k in ("anthropic-version", "anthropic-beta", "user-agent", "accept")]
    if route in (MESSAGES, COUNT) and not any(k == "anthropic-version" for k, _ in headers):
        headers.append(("anthropic-version", "2023-06-01"))
    target = route + (f"?{fixture['query']}" if own and fixture.get("query") else "")
    reply: Reply | None = None
    try:
        reply = call(port, "POST", target, body=body, headers=headers, timeout=TIMEOUT_S)
    except (ConnectionError, EOFError) as e:
        failure = repr(e)
    assert reply is not None, f"no answer ({failure}); the server's exit code: {exit_code(srv, 2.0)}"
    assert exit_code(srv) is None and call(port, "GET", "/api/info").status == 200, \
        f"the server died after answering {reply.status}: exit code {exit_code(srv)}"
    if reply.status == 400 and is_context_refusal(route, reply):
        return
    assert reply.status == 200, (reply.status, reply.body[:1000])
    check_answer(route, stream, reply)
