"""The agent on the local model: random weights cannot choose tools, so each round's
output is forced by a test-only grammar (`BMOE_AGENT_TEST_SCRIPT`): the text still
goes through the turn service, the template's tool-call framing, the parser and the
KV cache, and the tools really run."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import start_server
from test_agent_e2e import api, kinds, wait_idle


def call(name: str, **args: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_local_model_reads_edits_runs_and_answers(tmp_path: Path, tiny_moe: Path) -> None:
    ws = tmp_path / "project"
    ws.mkdir()
    (ws / "hello.py").write_text("print('hi')\n")
    script = tmp_path / "script.json"
    script.write_text(json.dumps([
        call("read_file", path="hello.py"),
        call("edit_file", path="hello.py", old_text="print('hi')", new_text="print('bye')"),
        call("exec_shell_command", command="python3 hello.py > out.txt; cat out.txt"),
        "Done: it says bye now."]))
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096",
                       env={"BMOE_AGENT_TEST_SCRIPT": str(script)})
    try:
        assert srv.info()["state"] == "ready"
        status, w = api(srv, "POST", "/api/workspaces", {"path": str(ws)})
        status, conv = api(srv, "POST", "/api/conversations", {"mode": "full", "workspace": w["id"]})
        cid = conv["id"]
        status, _ = api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "Say bye."})
        assert status == 202
        conv = wait_idle(srv, cid, timeout=240)
        assert kinds(conv) == ["user", "assistant", "tool:done", "assistant", "tool:done",
                               "assistant", "tool:done", "assistant"], conv["items"]
        assert (ws / "hello.py").read_text() == "print('bye')\n"
        assert (ws / "out.txt").read_text() == "bye\n"
        answers = [i for i in conv["items"] if i["kind"] == "assistant"]
        assert answers[-1]["text"] == "Done: it says bye now."
        assert json.loads(conv["items"][4]["arguments"])["new_text"] == "print('bye')"
        # each round after the first prefills only what was appended (KV prefix reuse)
        for a in answers[1:]:
            assert 0 < a["usage"]["prefilled"] < a["usage"]["prompt"] / 2, a["usage"]
    finally:
        srv.stop()


def test_a_conversation_past_the_context_ends_on_a_notice(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "512")
    try:
        status, conv = api(srv, "POST", "/api/conversations", {})
        cid = conv["id"]
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "word " * 3000})
        conv = wait_idle(srv, cid)
        notice = conv["items"][-1]
        assert conv["state"] == "error" and notice["kind"] == "notice"
        assert notice["code"] == "context_full" and "Context" in notice["text"], notice
        assert "{" not in notice["text"]                      # placeholders rendered
        status, _ = api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "again"})
        assert status == 202                                   # an error does not lock it
    finally:
        srv.stop()


def test_stopping_a_queued_round_leaves_another_clients_turn_running(tmp_path: Path,
                                                                     tiny_moe: Path) -> None:
    """A long chat answer holds the turn; the agent's round waits behind it; stopping the
    conversation withdraws only its place. Then the agent's own running round stops."""
    import threading
    import time
    import urllib.request

    from _e2e_support import wait_for

    srv = start_server(tmp_path / "data", "-m", str(tiny_moe))
    finish: list[str] = []
    chunks = [0]
    started = threading.Event()

    def long_chat() -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "go"}], "stream": True,
                           "max_tokens": 12000}).encode()
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    chunks[0] += 1
                    started.set()
                    choice = json.loads(line[6:])["choices"]
                    if choice and choice[0]["finish_reason"]:
                        finish.append(choice[0]["finish_reason"])

    try:
        t = threading.Thread(target=long_chat, daemon=True)
        t.start()
        assert started.wait(30)
        status, conv = api(srv, "POST", "/api/conversations", {})
        cid = conv["id"]
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "hello"})
        assert srv.info()["generating"]
        t0 = time.monotonic()
        status, body = api(srv, "POST", f"/api/conversations/{cid}/stop", {})
        assert body == {"stopped": True} and time.monotonic() - t0 < 1.0
        seen = chunks[0]
        wait_for(lambda: chunks[0] > seen + 5, 10, "the other answer to go on")
        assert finish == [], "the other client's answer was cut short"
        api(srv, "POST", "/api/cancel", {})
        t.join(30)
        assert finish == ["cancelled"], finish
        conv = wait_idle(srv, cid)
        assert kinds(conv)[-1] == "notice" and conv["items"][-1]["code"] == "stopped"
        # now the agent's own round runs; a stop ends it within a second
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "talk"})
        wait_for(lambda: any(i["kind"] == "assistant" and i["text"] for i in
                             api(srv, "GET", f"/api/conversations/{cid}")[1]["items"]),
                 30, "the agent's answer to stream")
        t0 = time.monotonic()
        status, body = api(srv, "POST", f"/api/conversations/{cid}/stop", {})
        took = time.monotonic() - t0
        assert body == {"stopped": True} and took < 1.0, took
        assert not srv.info()["generating"]
    finally:
        srv.stop()


def test_a_round_past_the_context_leaves_old_results_out(tmp_path: Path, tiny_moe: Path) -> None:
    ws = tmp_path / "project"
    ws.mkdir()
    (ws / "big.txt").write_text("".join(f"line {i} of a long file to read\n" for i in range(2000)))
    script = tmp_path / "script.json"
    script.write_text(json.dumps([call("read_file", path="big.txt"),
                                  call("list_files", path="."), "Read it."]))
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096",
                       env={"BMOE_AGENT_TEST_SCRIPT": str(script)})
    try:
        status, w = api(srv, "POST", "/api/workspaces", {"path": str(ws)})
        status, conv = api(srv, "POST", "/api/conversations", {"mode": "full", "workspace": w["id"]})
        cid = conv["id"]
        api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "Read big.txt."})
        conv = wait_idle(srv, cid, timeout=240)
        assert kinds(conv) == ["user", "assistant", "tool:done", "assistant", "notice",
                               "tool:done", "assistant"], conv["items"]
        assert conv["items"][4]["code"] == "compacted" and conv["state"] == "idle"
        assert conv["items"][-1]["text"] == "Read it."
        assert "line 1999" in conv["items"][2]["output"]        # the item keeps it whole
        assert conv["elide_before"] == 3          # the one round before: its result left out
    finally:
        srv.stop()
