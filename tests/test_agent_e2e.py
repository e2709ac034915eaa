"""The agent end to end against a real bmoe-server: the loop driven by a scripted
provider (a small OpenAI- / Anthropic-compatible server this test starts, reached
through the real provider code and the official SDKs) and by the local model under a
forced grammar; approvals, stop, restart, the preview's headers."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from _e2e_support import call, port_of, wait_for
from conftest import ServerProcess, start_server

from bmoe.agent import preview

KEY = "sk-scripted-0123456789"


# -- a scripted provider -----------------------------------------------------------------

def tool_call(name: str, **args: Any) -> dict[str, Any]:
    return {"call": name, "args": args}


class Scripted(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[Any] = []
        self.requests: list[dict[str, Any]] = []
        self.headers_seen: list[dict[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Scripted

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - the http.server name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self.server.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        step = self.server.script.pop(0) if self.server.script else "(script ended)"
        if isinstance(step, dict) and "status" in step:
            data = json.dumps({"error": {"message": step["message"], "type": "x"}}).encode()
            self.send_response(step["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = _anthropic(step) if self.path.endswith("/messages") else _openai(step)
        for chunk in events:
            self.wfile.write(chunk.encode())
            self.wfile.flush()
        self.close_connection = True


def _openai(step: Any) -> list[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 0,
                                      "model": "scripted", "choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": finish}]}) + "\n\n"
    out = [chunk({"role": "assistant", "content": ""})]
    if isinstance(step, str):
        out += [chunk({"content": step[:3]}), chunk({"content": step[3:]}), chunk({}, "stop")]
    else:
        args = json.dumps(step["args"])
        out += [chunk({"tool_calls": [{"index": 0, "id": "call_" + step["call"], "type": "function",
                                       "function": {"name": step["call"], "arguments": ""}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[:5]}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[5:]}}]}),
                chunk({}, "tool_calls")]
    return out + ["data: [DONE]\n\n"]


def _anthropic(step: Any) -> list[str]:
    def ev(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps(dict(data, type=name))}\n\n"
    out = [ev("message_start", {"message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "scripted",
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}})]
    if isinstance(step, str):
        out += [ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": step}}),
                ev("content_block_stop", {"index": 0})]
        stop = "end_turn"
    else:
        args = json.dumps(step["args"])
        out += [ev("content_block_start", {"index": 0, "content_block": {
                    "type": "tool_use", "id": "toolu_" + step["call"], "name": step["call"], "input": {}}}),
                ev("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta",
                                                                 "partial_json": args[:4]}}),
                ev("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta",
                                                                 "partial_json": args[4:]}}),
                ev("content_block_stop", {"index": 0})]
        stop = "tool_use"
    return out + [ev("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                       "usage": {"output_tokens": 1}}), ev("message_stop", {})]


@pytest.fixture
def provider() -> Iterator[Scripted]:
    srv = Scripted()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / "hello.py").write_text("print('hi')\n")
    return root


@pytest.fixture
def agent_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path / "data", wait_ready=False)
    yield srv
    srv.stop()


def api(srv: ServerProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, _, data = srv.request(method, path, body)
    return status, data


def setup_conversation(srv: ServerProcess, provider: Scripted | None, workspace: Path,
                       kind: str, mode: str) -> str:
    status, w = api(srv, "POST", "/api/workspaces", {"path": str(workspace)})
    assert status == 201, w
    route = "local"
    if provider is not None:
        base = provider.url + ("/v1" if kind == "openai" else "")
        status, p = api(srv, "PUT", f"/api/providers/{kind}1", {
            "kind": kind, "base_url": base, "model": "scripted", "api_key": KEY})
        assert status == 200 and p["has_key"] and "api_key" not in p, p
        route = f"{kind}1"
    status, conv = api(srv, "POST", "/api/conversations",
                       {"title": "t", "mode": mode, "workspace": w["id"], "route": route})
    assert status == 201, conv
    return str(conv["id"])


def conversation(srv: ServerProcess, cid: str) -> dict[str, Any]:
    status, conv = api(srv, "GET", f"/api/conversations/{cid}")
    assert status == 200, conv
    return conv  # type: ignore[no-any-return]


def wait_idle(srv: ServerProcess, cid: str, timeout: float = 60.0) -> dict[str, Any]:
    return wait_for(lambda: (c := conversation(srv, cid))["state"] in ("idle", "error") and c,
                    timeout, "the run to end")  # type: ignore[no-any-return]


def wait_item(srv: ServerProcess, cid: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
    def find() -> Any:
        conv = conversation(srv, cid)
        return next((i for i in conv["items"] if i["kind"] == "tool" and i["state"] == state), None)
    return wait_for(find, timeout, f"a tool item in state {state}")  # type: ignore[no-any-return]


def kinds(conv: dict[str, Any]) -> list[str]:
    return [i["kind"] + (":" + i["state"] if i["kind"] == "tool" else "") for i in conv["items"]]


THE_WORK = [tool_call("read_file", path="hello.py"),
            tool_call("edit_file", path="hello.py", old_text="print('hi')", new_text="print('bye')"),
            tool_call("exec_shell_command", command="python3 hello.py > out.txt; cat out.txt"),
            "All done."]


# -- the loop through providers ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_read_edit_run_answer(agent_server: ServerProcess, provider: Scripted, workspace: Path,
                              kind: str) -> None:
    provider.script = list(THE_WORK)
    cid = setup_conversation(agent_server, provider, workspace, kind, "full")
    status, data = api(agent_server, "POST", f"/api/conversations/{cid}/messages",
                       {"text": "Make it say bye."})
    assert status == 202 and data["item"]["kind"] == "user"
    conv = wait_idle(agent_server, cid)
    assert kinds(conv) == ["user", "assistant", "tool:done", "assistant", "tool:done",
                           "assistant", "tool:done", "assistant"], conv["items"]
    assert conv["items"][-1]["text"] == "All done." and conv["state"] == "idle"
    assert (workspace / "hello.py").read_text() == "print('bye')\n"
    assert (workspace / "out.txt").read_text() == "bye\n"
    assert "print('hi')" in conv["items"][2]["output"]
    assert "(exit status 0)" in conv["items"][6]["output"]
    # what the provider was sent: the tools, and each result back
    assert len(provider.requests) == 4
    last = json.dumps(provider.requests[-1])
    assert "bye" in last and "exec_shell_command" in last
    auth = provider.headers_seen[0].get("authorization") or provider.headers_seen[0].get("x-api-key")
    assert KEY in auth
    # the key is nowhere but credentials.json
    for p in agent_server.data_dir.rglob("*"):
        if p.is_file() and p.name != "credentials.json":
            assert KEY.encode() not in p.read_bytes(), p
    status, listing = api(agent_server, "GET", "/api/providers")
    assert KEY not in json.dumps(listing)


def test_a_provider_error_is_a_notice(agent_server: ServerProcess, provider: Scripted,
                                      workspace: Path) -> None:
    provider.script = [{"status": 401, "message": "bad key " + KEY}]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "full")
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "hi"})
    conv = wait_idle(agent_server, cid)
    notice = conv["items"][-1]
    assert conv["state"] == "error" and notice["kind"] == "notice" and notice["state"] == "error"
    assert "HTTP 401" in notice["text"] and KEY not in notice["text"]


def test_approval_wait_allow_deny(agent_server: ServerProcess, provider: Scripted,
                                  workspace: Path) -> None:
    provider.script = [tool_call("write_file", path="a.txt", content="A"),
                       tool_call("write_file", path="b.txt", content="B"),
                       tool_call("exec_shell_command", command="touch c.txt"),
                       tool_call("exec_shell_command", command="touch d.txt"),
                       tool_call("write_file", path="e.txt", content="E"), "ok"]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "ask")
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "go"})
    item = wait_item(agent_server, cid, "waiting")
    assert conversation(agent_server, cid)["state"] == "waiting" and not (workspace / "a.txt").exists()
    status, _ = api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "x"})
    assert status == 409
    status, data = api(agent_server, "POST", f"/api/conversations/{cid}/approval",
                       {"item": item["id"], "decision": "once"})
    assert status == 200
    item = wait_for(lambda: (i := wait_item(agent_server, cid, "waiting"))["id"] != item["id"] and i,
                    30, "the second approval")
    api(agent_server, "POST", f"/api/conversations/{cid}/approval",
        {"item": item["id"], "decision": "deny", "reason": "not b"})
    item = wait_for(lambda: (i := wait_item(agent_server, cid, "waiting"))["name"] ==
                    "exec_shell_command" and i, 30, "the command's approval")
    api(agent_server, "POST", f"/api/conversations/{cid}/approval",
        {"item": item["id"], "decision": "always"})
    item = wait_for(lambda: (i := wait_item(agent_server, cid, "waiting"))["name"] == "write_file"
                    and i, 30, "the last write's approval")   # d.txt ran without asking
    status, _ = api(agent_server, "POST", f"/api/conversations/{cid}/approval",
                    {"item": "i_nothing", "decision": "once"})
    assert status == 404
    api(agent_server, "POST", f"/api/conversations/{cid}/approval",
        {"item": item["id"], "decision": "once"})
    conv = wait_idle(agent_server, cid)
    assert sorted(p.name for p in workspace.iterdir()) == ["a.txt", "c.txt", "d.txt", "e.txt",
                                                           "hello.py"]
    denied = [i for i in conv["items"] if i["kind"] == "tool" and i["state"] == "denied"]
    assert len(denied) == 1 and denied[0]["reason"] == "not b"
    assert "not b" in json.dumps(provider.requests[2])       # the reason reached the model
    assert conv["allowed"] == ["exec_shell_command"]


def test_read_mode_offers_no_writes(agent_server: ServerProcess, provider: Scripted,
                                    workspace: Path) -> None:
    provider.script = [tool_call("write_file", path="a.txt", content="A"), "ok"]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "read")
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "go"})
    conv = wait_idle(agent_server, cid)
    assert kinds(conv)[2] == "tool:denied" and not (workspace / "a.txt").exists()
    names = [t["function"]["name"] for t in provider.requests[0]["tools"]]
    assert names == ["list_files", "read_file", "search_files"]


def test_stop_kills_a_running_command_group(agent_server: ServerProcess, provider: Scripted,
                                            workspace: Path) -> None:
    provider.script = [tool_call("exec_shell_command",
                                 command="sleep 60 & echo $! > bg.pid; sleep 60")]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "full")
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "wait"})
    wait_item(agent_server, cid, "running")
    pid = int(wait_for(lambda: (workspace / "bg.pid").exists() and
                       (workspace / "bg.pid").read_text().strip(), 10, "the pid"))
    t0 = time.monotonic()
    status, data = api(agent_server, "POST", f"/api/conversations/{cid}/stop", {})
    took = time.monotonic() - t0
    assert status == 200 and data == {"stopped": True} and took < 1.0, took
    wait_for(lambda: not _alive(pid), 1.0, "the background sleep to die")
    conv = conversation(agent_server, cid)
    assert conv["state"] == "idle" and kinds(conv)[-2:] == ["tool:failed", "notice"]
    status, data = api(agent_server, "POST", f"/api/conversations/{cid}/stop", {})
    assert data == {"stopped": False}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_edit_reruns_and_restart_reloads_whole(tmp_path: Path, provider: Scripted,
                                               workspace: Path) -> None:
    data = tmp_path / "data"
    srv = start_server(data, wait_ready=False)
    try:
        provider.script = [tool_call("list_files"), "first"]
        cid = setup_conversation(srv, provider, workspace, "anthropic", "full")
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "one"})
        conv = wait_idle(srv, cid)
        provider.script = ["second"]
        user = conv["items"][0]["id"]
        status, body = api(srv, "PUT", f"/api/conversations/{cid}/items/{user}", {"text": "two"})
        assert status == 202 and body["item"]["text"] == "two"
        conv = wait_idle(srv, cid)
        assert kinds(conv) == ["user", "assistant"] and conv["items"][1]["text"] == "second"
        status, _ = api(srv, "PUT", f"/api/conversations/{cid}", {"title": "renamed"})
        before = conversation(srv, cid)
    finally:
        srv.stop()
    srv = start_server(data, wait_ready=False)
    try:
        after = conversation(srv, cid)
        assert after == before and after["title"] == "renamed"
        status, listing = api(srv, "GET", "/api/conversations")
        assert [c["id"] for c in listing["conversations"]] == [cid]
        status, _ = api(srv, "DELETE", f"/api/conversations/{cid}", {})
        assert status == 200 and not (data / "agent" / "conversations" / f"{cid}.json").exists()
    finally:
        srv.stop()


def test_restart_mid_run_ends_what_was_running(tmp_path: Path, provider: Scripted,
                                               workspace: Path) -> None:
    data = tmp_path / "data"
    srv = start_server(data, wait_ready=False)
    try:
        provider.script = [tool_call("write_file", path="x.txt", content="x")]
        cid = setup_conversation(srv, provider, workspace, "openai", "ask")
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "go"})
        wait_item(srv, cid, "waiting")
    finally:
        srv.proc.kill()                                  # no clean stop
        srv.stop()
    srv = start_server(data, wait_ready=False)
    try:
        conv = conversation(srv, cid)
        assert conv["state"] == "idle" and kinds(conv) == ["user", "assistant", "tool:failed"]
        assert conv["items"][0]["text"] == "go"
    finally:
        srv.stop()


# -- routes, errors, preview ----------------------------------------------------------------

def test_errors(agent_server: ServerProcess, tmp_path: Path, workspace: Path) -> None:
    srv = agent_server
    assert api(srv, "POST", "/api/workspaces", {"path": "relative"})[1]["code"] == "not_a_folder"
    assert api(srv, "POST", "/api/workspaces", {"path": str(workspace / "hello.py")})[1]["code"] == \
        "not_a_folder"
    assert api(srv, "POST", "/api/conversations", {"mode": "everything"})[1]["code"] == "invalid_request"
    assert api(srv, "POST", "/api/conversations", {"route": "nobody"})[1]["code"] == "invalid_request"
    assert api(srv, "GET", "/api/conversations/c_missing")[0] == 404
    assert api(srv, "PUT", "/api/providers/x", {"kind": "gopher", "base_url": "http://a",
                                                "model": "m"})[1]["code"] == "invalid_request"
    status, agent = api(srv, "GET", "/api/agent")
    assert agent == {"tools": True, "commands": True, "mcp": [], "agents": agent["agents"]}
    status, conv = api(srv, "POST", "/api/conversations", {})
    status, body = api(srv, "POST", f"/api/conversations/{conv['id']}/messages", {"text": "hi"})
    assert status == 202
    conv = wait_idle(srv, conv["id"])
    assert conv["state"] == "error" and conv["items"][-1]["code"] == "no_model"


def test_chat_only(tmp_path: Path, workspace: Path) -> None:
    srv = start_server(tmp_path / "data", "--chat-only", wait_ready=False)
    try:
        assert api(srv, "GET", "/api/agent")[1]["tools"] is False
        status, body = api(srv, "POST", "/api/workspaces", {"path": str(workspace)})
        assert status == 409 and body["code"] == "chat_only"
    finally:
        srv.stop()


def test_preview_headers_are_byte_exact(agent_server: ServerProcess, workspace: Path,
                                        tmp_path: Path) -> None:
    (workspace / "index.html").write_bytes(b"<script>document.title='x'</script>")
    with open(workspace / "huge.bin", "wb") as f:
        f.truncate(16 * 2**20 + 1)
    os.symlink(tmp_path, workspace / "out")
    cid = setup_conversation(agent_server, None, workspace, "openai", "ask")
    port = port_of(agent_server)
    r = call(port, "GET", f"/api/conversations/{cid}/file?path=index.html")
    assert r.status == 200 and r.body == b"<script>document.title='x'</script>"
    assert r.header("content-security-policy") == preview.POLICY_ON   # auto, on loopback
    assert r.header("x-frame-options") == "SAMEORIGIN"
    assert r.header("x-content-type-options") == "nosniff"
    assert r.header("referrer-policy") == "no-referrer"
    assert r.header("content-type") == "text/html; charset=utf-8"
    assert [k for k, _ in r.headers].count("content-security-policy") == 1
    for path, status, code in [("../data", 403, "outside_workspace"), ("out/x", 403, "outside_workspace"),
                               ("/etc/passwd", 403, "outside_workspace"), ("huge.bin", 413, "too_large"),
                               ("missing.html", 404, "not_found")]:
        r = call(port, "GET", f"/api/conversations/{cid}/file?path={path}")
        assert (r.status, r.code) == (status, code), (path, r.body)


def test_preview_network_off(tmp_path: Path, workspace: Path) -> None:
    srv = start_server(tmp_path / "data", "--preview-network", "off", wait_ready=False)
    try:
        (workspace / "p.html").write_text("<p>x</p>")
        cid = setup_conversation(srv, None, workspace, "openai", "ask")
        r = call(port_of(srv), "GET", f"/api/conversations/{cid}/file?path=p.html")
        assert r.status == 200 and r.header("content-security-policy") == (
            "sandbox allow-scripts; default-src 'none'; script-src 'unsafe-inline'; "
            "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; media-src data: blob:; "
            "connect-src 'none'; object-src 'none'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'self'")
    finally:
        srv.stop()


def test_events_carry_conversation_item_and_delta(agent_server: ServerProcess, provider: Scripted,
                                                  workspace: Path) -> None:
    provider.script = [tool_call("list_files"), "Hello there."]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "full")
    port = port_of(agent_server)
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    sock.recv(4096)
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "hi"})
    wait_idle(agent_server, cid)
    buf = b""
    sock.settimeout(2)
    try:
        while b'"Hello there."' not in buf or b"idle" not in buf.split(b'"Hello there."')[-1]:
            buf += sock.recv(65536)
    except TimeoutError:
        pass
    sock.close()
    text = buf.decode()
    assert "event: conversation" in text and "event: item" in text and "event: delta" in text
    deltas = [json.loads(line[6:]) for block in text.split("\n\n") if "event: delta" in block
              for line in block.split("\n") if line.startswith("data: ")]
    assert any(d.get("arguments") for d in deltas) and any(d.get("text") for d in deltas)
    assert "".join(d.get("text", "") for d in deltas) == "Hello there."


def test_kill_9_during_conversation_writes(tmp_path: Path, provider: Scripted,
                                           workspace: Path) -> None:
    """A conversation saved about 80 times a run (each round and each call), the server
    killed with SIGKILL at three moments: the file always parses, whole, and reloads."""
    data = tmp_path / "data"
    cid = ""
    seen = 0
    for kill_at in (9, 31, 57):
        srv = start_server(data, wait_ready=False)
        try:
            if not cid:
                cid = setup_conversation(srv, provider, workspace, "openai", "full")
            assert len(conversation(srv, cid)["items"]) >= seen       # reloaded whole
            provider.script = [tool_call("list_files")] * 40 + ["end"]
            api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "list, forever"})
            want = seen + kill_at
            wait_for(lambda s=srv, c=cid, n=want: len(conversation(s, c)["items"]) >= n, 60,
                     "the run to get going")
        finally:
            srv.proc.kill()
            srv.stop()
        stored = json.loads((data / "agent" / "conversations" / f"{cid}.json").read_text())
        assert stored["id"] == cid and all(isinstance(i["id"], str) for i in stored["items"])
        assert len(stored["items"]) >= seen + kill_at - 4      # at most a round behind
        seen = len(stored["items"])
    srv = start_server(data, wait_ready=False)
    try:
        conv = conversation(srv, cid)
        assert len(conv["items"]) == seen and conv["state"] == "idle"
        assert not list((data / "agent" / "conversations").glob(".*"))   # no temporaries
    finally:
        srv.stop()


async def test_a_message_while_the_server_stops_is_503(tmp_path: Path) -> None:
    from bmoe.agent.service import AgentService
    from bmoe.http.errors import HTTPError
    from bmoe.runtime.events import EventBus

    class State:
        bus = EventBus()
        stopping = True

    svc = AgentService(State(), tmp_path)
    conv = await svc.create("t", "ask", None, "local")
    with pytest.raises(HTTPError) as e:
        await svc.post_message(conv, "hi")
    assert (e.value.status, e.value.code) == (503, "stopping")
