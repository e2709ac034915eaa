"""MCP servers (`docs/agent.md`, "MCP servers"): the config checked, hostile tool schemas
bounded, results rendered; a real stdio server written with the official SDK
(`tests/mcp_test_server.py`) run by the supervisor, and misbehaving ones (a server that
hangs at initialize, one that writes garbage, one that dies, tools that hang, crash,
write garbage or flood) each ending with a sentence within its time limit and started
again with back-off; end to end, the agent driven by the scripted provider calls the
server's tool (approval in `ask`, refused in `read`), `GET /api/agent` lists the
servers to loopback and `[]` to a network peer, and `POST /api/mcp/{name}/restart`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from _e2e_support import wait_for
from conftest import ServerProcess, start_server
from mcp_types import (CallToolResult, EmbeddedResource, ImageContent, TextContent,
                       TextResourceContents)
from mcp_types import Tool as McpTool
from test_agent_e2e import (Scripted, api, conversation, kinds, provider,  # noqa: F401
                            setup_conversation, tool_call, wait_idle, wait_item, workspace)
from test_agent_part2_network import KEY, own_address, request

from bmoe.agent import mcp
from _netns import skip_outside_ci

SERVER_SCRIPT = str(Path(__file__).with_name("mcp_test_server.py"))


def stdio(mode: str = "good", **extra: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": [SERVER_SCRIPT, mode], **extra}


def config(**servers: dict[str, Any]) -> str:
    return json.dumps({"mcpServers": servers})


# -- the config file --------------------------------------------------------------------

def test_the_claude_format_is_read() -> None:
    got = mcp.parse_config(config(
        files={"command": "npx", "args": ["-y", "srv"], "env": {"TOKEN": "t"}, "cwd": "/tmp"},
        web={"type": "http", "url": "https://example.com/mcp", "headers": {"X-Key": "k"}},
        old={"type": "sse", "url": "http://127.0.0.1:9/sse"},
        bare={"url": "http://localhost:8000/mcp"}, slow={**stdio(), "timeout": 5}))
    assert got["files"] == mcp.ServerConfig("files", "stdio", command="npx", args=("-y", "srv"),
                                            env=(("TOKEN", "t"),), cwd="/tmp")
    assert got["web"].transport == "http" and got["web"].headers == (("X-Key", "k"),)
    assert got["old"].sse and got["bare"].transport == "http" and not got["bare"].sse
    assert got["slow"].timeout == 5.0
    assert all(c.problem is None for c in got.values())


@pytest.mark.parametrize("text", ["", "{", "[]", '{"servers": {}}', '{"mcpServers": []}',
                                  config(**{"../x": stdio()}), config(**{"a__b": stdio()}),
                                  config(**{"": stdio()}), config(**{"x" * 33: stdio()})])
def test_a_malformed_file_is_refused_whole(text: str) -> None:
    with pytest.raises(mcp.ConfigError) as e:
        mcp.parse_config(text)
    assert e.value.message.endswith(".") and "Traceback" not in e.value.message


@pytest.mark.parametrize("entry", [{"command": ""}, {"command": 3}, {"command": "x", "args": "a"},
                                   {"command": "x", "env": {"A": 1}}, {"command": "x", "cwd": "rel"},
                                   {"type": "http"}, {"type": "http", "url": "ftp://x"},
                                   {"type": "ws", "url": "http://x"}, "just a string",
                                   {"command": "x", "timeout": 0}, {"command": "x", "timeout": True}])
def test_a_bad_entry_is_a_failed_server(entry: Any) -> None:
    got = mcp.parse_config(config(bad=entry, good=stdio()))
    assert got["bad"].problem and got["bad"].problem.startswith("Its entry in the MCP config")
    assert got["good"].problem is None
    server = mcp.Server(got["bad"], lambda s: None)
    assert server.entry()["state"] == "failed" and server.entry()["error"] == got["bad"].problem


def test_a_missing_file_is_no_servers(tmp_path: Path) -> None:
    assert mcp.read_config(tmp_path / "mcp.json") == {}
    (tmp_path / "big.json").write_bytes(b" " * (mcp.MCP_CONFIG_MAX_BYTES + 1))
    with pytest.raises(mcp.ConfigError):
        mcp.read_config(tmp_path / "big.json")


# -- tools and results -----------------------------------------------------------------

def _tool(name: str = "t", schema: Any = None) -> McpTool:
    return McpTool(name=name, description="d", input_schema=schema or {"type": "object"})


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}}
    return node


@pytest.mark.parametrize("schema", [
    _nested(200),                                                      # deeper than any grammar
    {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                      for i in range(200)}},           # 16 KiB and more
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/nothing/here"}}},
    {"type": "object", "properties": {"a": False}},
    {"type": "string"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a|"}}},
])
def test_a_hostile_schema_is_not_offered(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        mcp.bounded_tool("srv", _tool(schema=schema))


def test_a_tool_is_offered_under_its_server_qualified_name() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 100000}},
              "required": ["n"]}
    tool = mcp.bounded_tool("files", _tool("read-it", schema))
    spec = tool.spec()["function"]
    assert spec["name"] == "mcp__files__read-it" and spec["description"] == "d"
    assert spec["parameters"]["required"] == ["n"]
    assert "maxLength" not in spec["parameters"]["properties"]["n"]   # relaxed as for any tool
    with pytest.raises(ValueError):
        mcp.bounded_tool("files", _tool("has space"))
    assert len(mcp.bounded_tool("s" * 32, _tool("t" * 25)).qualified) == 64
    with pytest.raises(ValueError):
        mcp.bounded_tool("s" * 32, _tool("t" * 26))      # past OpenAI's 64 characters
    servers = mcp.McpServers(Path("/nonexistent"), lambda e: None)
    servers.servers = {"files": mcp.Server(mcp.ServerConfig("files", "stdio", command="x"),
                                           lambda s: None)}
    found = servers.find("mcp__files__read__it")
    assert found is not None and found[1] == "read__it"
    assert servers.find("mcp__other__x") is None and servers.find("read_file") is None


def test_results_become_text() -> None:
    ok, text = mcp.render(CallToolResult(content=[
        TextContent(type="text", text="one"),
        ImageContent(type="image", data="aGVsbG8h", mime_type="image/png"),
        EmbeddedResource(type="resource", resource=TextResourceContents(
            uri="file:///a.txt", text="inside"))]))
    assert ok and text.splitlines() == ["one", "[an image, image/png, 6 bytes]",
                                        "[resource file:///a.txt]", "inside"]
    ok, text = mcp.render(CallToolResult(content=[TextContent(type="text", text="no")],
                                         is_error=True))
    assert not ok and text == "The tool reported an error: no"
    ok, text = mcp.render(CallToolResult(content=[TextContent(type="text", text="y" * 10**6)]))
    assert len(text) < mcp.MCP_OUTPUT_CHARS + 200 and "characters of output not shown" in text


# -- one real server, supervised (in process) ------------------------------------------

class Recorder(list[tuple[float, str, Any]]):
    """The server's state changes, (time, state, error), and a wait for one."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = trio.Event()

    def __call__(self, server: mcp.Server) -> None:
        self.append((trio.current_time(), server.state, server.error))
        self.changed.set()
        self.changed = trio.Event()

    def count(self, state: Any) -> int:
        return [s for _, s, _ in self].count(state)

    async def until(self, predicate: Any) -> None:
        while not predicate():
            await self.changed.wait()


def _server(mode: str, events: Any, **extra: Any) -> mcp.Server:
    cfg = mcp.parse_config(config(t=stdio(mode, **extra)))["t"]
    return mcp.Server(cfg, events)


async def test_tools_that_hang_crash_write_garbage_or_flood(monkeypatch: pytest.MonkeyPatch) -> None:
    events = Recorder()
    server = _server("good", events, timeout=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.supervise)
        await server.ready()
        assert server.state == "running"
        assert [t.name for t in server.tools] == ["add", "hang", "crash", "garbage", "flood"]
        ok, out = await server.call("add", {"a": 2, "b": 3})
        assert ok and out.startswith("2 + 3 = 5")
        expected = {"hang": "did not answer within 2 s, its time limit",
                    "crash": "exit status 3; its last words: about to crash on purpose",
                    "garbage": "lines in a row on its output that are not MCP messages",
                    "flood": "a line longer than 8 MiB"}
        for tool, said in expected.items():
            t0 = trio.current_time()
            with pytest.raises(mcp.McpCallError) as e:
                await server.call(tool, {})
            took = trio.current_time() - t0
            assert said in e.value.message and took < 2 + mcp.MCP_START_TIMEOUT_S, (tool, took)
            ok, out = await server.call("add", {"a": 1, "b": 1})    # started again
            assert ok and out.startswith("1 + 1 = 2"), tool
        assert server.restarts == 4
        assert events.count("failed") == 4
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("mode, start_s, said", [
    ("hang-init", 3.0, "did not start and list its tools within 3 s"),
    ("garbage", 15.0, "lines in a row on its output that are not MCP messages"),
    ("die", 15.0, "exit status 7; its last words: cannot start: no configuration")])
async def test_servers_that_never_start(monkeypatch: pytest.MonkeyPatch, mode: str,
                                        start_s: float, said: str) -> None:
    monkeypatch.setattr(mcp, "MCP_START_TIMEOUT_S", start_s)
    events = Recorder()
    server = _server(mode, events)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.supervise)
        t0 = trio.current_time()
        await server.ready()
        assert server.state == "failed" and said in (server.error or ""), server.error
        assert trio.current_time() - t0 < start_s + 3.0
        with pytest.raises(mcp.McpCallError) as e:
            await server.call("add", {"a": 1, "b": 2})
        assert e.value.message.startswith("The MCP server t is not running: ")
        nursery.cancel_scope.cancel()


async def test_restarts_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mcp, "MCP_BACKOFF_MIN_S", 0.5)
    events = Recorder()
    server = _server("die", events)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.supervise)
        server.want()
        await events.until(lambda: events.count("starting") >= 5)
        starts = [t for t, s, _ in events if s == "starting"]
        fails = [t for t, s, _ in events if s == "failed"]
        waits = [b - a for a, b in zip(fails, starts[1:], strict=False)]   # failed → next start
        assert [round(w * 2) / 2 for w in waits] == [0.5, 1.0, 2.0, 4.0], waits
        assert server.restarts == 4
        await events.until(lambda: events.count("failed") >= 5)    # now waiting 8 s
        t0 = trio.current_time()
        server.restart()                      # asked for: no waiting out the back-off
        await events.until(lambda: server.restarts >= 5)
        assert trio.current_time() - t0 < 1.0
        nursery.cancel_scope.cancel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The SDK's HTTP transports leave httpx2's response generators to the garbage collector
# when a session is cut short (a call past its time limit): ResourceWarnings from there.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind, path", [("http", "/mcp"), ("sse", "/sse")])
async def test_http_servers(kind: str, path: str) -> None:
    port = _free_port()
    proc = await trio.lowlevel.open_process([sys.executable, SERVER_SCRIPT, kind, str(port)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async def listening() -> bool:
            try:
                await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                return True
            except OSError:
                return False
        with trio.fail_after(30):
            while not await listening():   # noqa: ASYNC110 - a port has no event to wait on
                await trio.sleep(0.1)
        events = Recorder()
        cfg = mcp.parse_config(config(w={"type": kind, "url": f"http://127.0.0.1:{port}{path}",
                                         "headers": {"X-Test": "1"}, "timeout": 2}))["w"]
        server = mcp.Server(cfg, events)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.supervise)
            await server.ready()
            assert server.state == "running" and server.entry()["transport"] == "http"
            ok, out = await server.call("add", {"a": 4, "b": 5})
            assert ok and out.startswith("4 + 5 = 9")
            with pytest.raises(mcp.McpCallError) as e:
                await server.call("hang", {})
            assert "did not answer within 2 s" in e.value.message
            ok, out = await server.call("add", {"a": 1, "b": 1})      # a new session
            assert ok and server.restarts == 1
            nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        await proc.wait()
    events = Recorder()
    server = mcp.Server(cfg, events)              # nobody listens there now
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.supervise)
        await server.ready()
        assert server.state == "failed", server.entry()
        assert server.error == f"http://127.0.0.1:{port}{path} could not be reached or did " \
                               "not answer as an MCP server."
        nursery.cancel_scope.cancel()


# -- on a real bmoe-server, through the scripted provider --------------------------------

@pytest.fixture
def mcp_server(tmp_path: Path) -> Any:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mcp.json").write_text(config(demo=stdio(timeout=3),
                                                       broken={"command": ""}))
    srv = start_server(tmp_path / "data", wait_ready=False)
    yield srv
    srv.stop()


def _agent_mcp(srv: ServerProcess) -> list[dict[str, Any]]:
    status, agent = api(srv, "GET", "/api/agent")
    assert status == 200
    return agent["mcp"]  # type: ignore[no-any-return]


def test_the_agent_calls_an_mcp_tool_after_approval(mcp_server: ServerProcess,
                                                    provider: Scripted,  # noqa: F811
                                                    workspace: Path) -> None:  # noqa: F811
    srv = mcp_server
    provider.script = [tool_call("mcp__demo__add", a=20, b=22), "The sum is 42."]
    cid = setup_conversation(srv, provider, workspace, "openai", "ask")
    api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "add 20 and 22"})
    item = wait_item(srv, cid, "waiting", timeout=60)
    assert item["name"] == "mcp__demo__add"
    status, _ = api(srv, "POST", f"/api/conversations/{cid}/approval",
                    {"item": item["id"], "decision": "once"})
    assert status == 200
    conv = wait_idle(srv, cid)
    assert kinds(conv) == ["user", "assistant", "tool:done", "assistant"], conv["items"]
    assert conv["items"][2]["output"].startswith("20 + 22 = 42")
    assert "20 + 22 = 42" in json.dumps(provider.requests[1]["messages"])   # the model saw it
    offered = {t["function"]["name"]: t["function"] for t in provider.requests[0]["tools"]}
    assert offered["mcp__demo__add"]["parameters"]["required"] == ["a", "b"]
    assert "read_file" in offered and not any("broken" in n for n in offered)

    listing = {s["name"]: s for s in _agent_mcp(srv)}
    assert set(listing) == {"demo", "broken"}
    demo = listing["demo"]
    assert demo["transport"] == "stdio" and demo["state"] == "running" and demo["error"] is None
    assert {"name": "mcp__demo__add", "description": "Add two integers."} in demo["tools"]
    assert listing["broken"]["state"] == "failed" and "`command`" in listing["broken"]["error"]
    pid = int(re.findall(r"pid (\d+)", conv["items"][2]["output"])[0])
    srv.stop()                                      # the server's process goes with bmoe
    wait_for(lambda: not _alive(pid), 10, "the MCP server's process to end")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is not alive
        return f.read().split(") ")[-1][0] != "Z"


def test_misbehaving_tools_end_the_call_and_the_server_stays_up(
        mcp_server: ServerProcess, provider: Scripted, workspace: Path) -> None:  # noqa: F811
    srv = mcp_server
    provider.script = [tool_call("mcp__demo__hang"), tool_call("mcp__demo__crash"),
                       tool_call("mcp__demo__garbage"), tool_call("mcp__demo__add", a=1, b=2),
                       tool_call("mcp__demo__nope"), "done"]
    cid = setup_conversation(srv, provider, workspace, "openai", "full")
    t0 = time.monotonic()
    api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "misbehave"})
    conv = wait_idle(srv, cid, timeout=120)
    took = time.monotonic() - t0
    tools = [i for i in conv["items"] if i["kind"] == "tool"]
    assert [t["state"] for t in tools] == ["failed", "failed", "failed", "done", "failed"], tools
    assert "did not answer within 3 s, its time limit" in tools[0]["output"]
    assert "stopped during the call" in tools[1]["output"] and "exit status 3" in tools[1]["output"]
    assert "not MCP messages" in tools[2]["output"]
    assert tools[3]["output"].startswith("1 + 2 = 3")
    assert "There is no tool named 'mcp__demo__nope' here." == tools[4]["output"]
    assert took < 3 * (3 + 20), took                    # each call within its limits
    assert srv.proc.poll() is None and conv["state"] == "idle"
    demo = next(s for s in _agent_mcp(srv) if s["name"] == "demo")
    assert demo["restarts"] == 3 and demo["state"] == "running"


def test_read_mode_neither_offers_nor_runs_mcp_tools(mcp_server: ServerProcess,
                                                     provider: Scripted,  # noqa: F811
                                                     workspace: Path) -> None:  # noqa: F811
    provider.script = [tool_call("mcp__demo__add", a=1, b=2), "ok"]
    cid = setup_conversation(mcp_server, provider, workspace, "openai", "read")
    api(mcp_server, "POST", f"/api/conversations/{cid}/messages", {"text": "go"})
    conv = wait_idle(mcp_server, cid)
    assert kinds(conv)[2] == "tool:denied" and "read-only" in conv["items"][2]["output"]
    assert "mcp__" not in json.dumps(provider.requests[0]["tools"])


def test_restart_route_and_a_malformed_config(tmp_path: Path) -> None:
    cfg = tmp_path / "servers.json"
    cfg.write_text(config(demo=stdio()))
    srv = start_server(tmp_path / "data", "--mcp-servers-config", str(cfg), wait_ready=False)
    try:
        assert _agent_mcp(srv)[0]["state"] in ("stopped", "starting")    # asked: it starts
        wait_for(lambda: _agent_mcp(srv)[0]["state"] == "running", 30, "the server to run")
        status, entry = api(srv, "POST", "/api/mcp/demo/restart", {})
        assert status == 200 and entry["name"] == "demo"
        wait_for(lambda: (s := _agent_mcp(srv)[0])["restarts"] == 1 and s["state"] == "running",
                 30, "the restart")
        status, err = api(srv, "POST", "/api/mcp/nope/restart", {})
        assert status == 404 and err["code"] == "not_found"
    finally:
        srv.stop()
    (tmp_path / "data" / "mcp.json").write_text('{"mcpServers": {"a": ')
    log = tmp_path / "server.log"
    srv = start_server(tmp_path / "data", "--log-file", str(log), wait_ready=False)
    try:
        status, agent = api(srv, "GET", "/api/agent")
        assert status == 200 and agent["mcp"] == []        # refused, and the server runs on
        wait_for(lambda: "The MCP servers' config mcp.json is not used: It is not valid JSON "
                 "(line 1)." in log.read_text(), 10, "the config's refusal in the log")
    finally:
        srv.stop()


def test_a_network_peer_sees_no_mcp_servers(tmp_path: Path) -> None:
    ip = own_address()
    if ip is None:
        skip_outside_ci("this machine has no non-loopback IPv4 address")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mcp.json").write_text(config(demo=stdio()))
    (tmp_path / "key").write_text(KEY)
    srv = start_server(tmp_path / "data", "--host", "0.0.0.0", "--api-key-file",
                       str(tmp_path / "key"), wait_ready=False)
    try:
        port = srv.url.rsplit(":", 1)[1]
        net, local = f"http://{ip}:{port}", f"http://127.0.0.1:{port}"
        status, agent = request(net, "GET", "/api/agent")
        assert status == 200 and agent["mcp"] == []
        status, out = request(net, "POST", "/api/mcp/demo/restart")
        assert status == 403 and out["code"] == "local_only"
        status, agent = request(local, "GET", "/api/agent")
        assert status == 200 and [s["name"] for s in agent["mcp"]] == ["demo"]
        assert set(agent["mcp"][0]) == {"name", "transport", "state", "error", "tools", "restarts"}
    finally:
        srv.stop()
