"""The agent's tools on real files: paths kept inside the workspace, capped reads,
exact edits, searches, commands as process groups; the store's atomic writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from bmoe.agent import conversation as cv
from bmoe.agent import preview, store, tools
from bmoe.agent.loop import literal_grammar
from bmoe.agent.paths import OutsideWorkspace, ToolError, resolve
from bmoe.agent.providers import anthropic_messages


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("def f():\n    return 1\n")
    (root / "notes.txt").write_text("one\ntwo\nthree\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return root


@pytest.mark.parametrize("name", ["../secret.txt", "src/../../secret.txt", "/etc/passwd",
                                  "link-out/secret.txt", "link-out", "dangling",
                                  "dangling/new.txt", "dangling-in/new.txt"])
def test_path_escapes_are_refused(ws: Path, name: str) -> None:
    os.symlink(ws.parent, ws / "link-out")
    os.symlink(ws.parent / "nowhere", ws / "dangling")
    os.symlink(ws / "missing-folder", ws / "dangling-in")
    with pytest.raises(OutsideWorkspace):
        resolve(ws, name)
    with pytest.raises(ToolError):
        tools.read_file(ws, {"path": name})
    with pytest.raises(ToolError):
        tools.write_file(ws, {"path": name, "content": "x"})
    assert (ws.parent / "secret.txt").read_text() == "outside\n"


def test_paths_inside_are_resolved(ws: Path) -> None:
    os.symlink(ws / "src", ws / "link-in")
    assert resolve(ws, "link-in/a.py") == (ws / "src" / "a.py").resolve()
    assert resolve(ws, str(ws / "notes.txt")) == (ws / "notes.txt").resolve()
    assert resolve(ws, "src/../notes.txt") == (ws / "notes.txt").resolve()
    with pytest.raises(ToolError):
        resolve(ws, "a\x00b")


def test_read_ranges_and_list(ws: Path) -> None:
    out = tools.read_file(ws, {"path": "notes.txt", "offset": 2, "limit": 1})
    assert out.split("\n")[0].strip() == "2\ttwo" and "offset 3" in out
    assert tools.list_files(ws, {}).split("\n") == ["notes.txt", "src/"]


def test_a_2_gb_file_read_is_capped(ws: Path) -> None:
    big = ws / "big.log"
    with open(big, "wb") as f:
        f.write(b"".join(b"line %d\n" % i for i in range(100_000)))
        f.truncate(2 * 2**30)                     # sparse: 2 GiB, no disk used
    t0 = time.monotonic()
    out = tools.read_file(ws, {"path": "big.log"})
    assert time.monotonic() - t0 < 2.0
    assert len(out.encode()) < tools.READ_MAX_BYTES + 64 * 1024
    assert out.splitlines()[-1].startswith("(more lines follow")
    out = tools.read_file(ws, {"path": "big.log", "offset": 100_001, "limit": 5})
    assert len(out.encode()) <= tools.READ_MAX_BYTES + 200   # the 2 GB "line" of holes, cut


def test_edit_needs_one_exact_match(ws: Path) -> None:
    (ws / "d.txt").write_text("x = 1\nx = 1\n")
    with pytest.raises(ToolError, match="occurs 2 times"):
        tools.edit_file(ws, {"path": "d.txt", "old_text": "x = 1", "new_text": "y"})
    with pytest.raises(ToolError, match="not found"):
        tools.edit_file(ws, {"path": "d.txt", "old_text": "z", "new_text": "y"})
    tools.edit_file(ws, {"path": "src/a.py", "old_text": "return 1", "new_text": "return 2"})
    assert (ws / "src" / "a.py").read_text() == "def f():\n    return 2\n"
    assert "Created" in tools.write_file(ws, {"path": "new/b.txt", "content": "hi"})
    assert (ws / "new" / "b.txt").read_text() == "hi"


def test_search(ws: Path) -> None:
    out = tools.search_files(ws, {"pattern": r"return \d"})
    assert out == "src/a.py:2:    return 1"
    assert tools.search_files(ws, {"pattern": "t[wh]", "glob": "*.txt"}).count("notes.txt") == 2
    with pytest.raises(ToolError, match="regular expression"):
        tools.search_files(ws, {"pattern": "("})


async def test_exec_runs_in_the_workspace_with_its_status(ws: Path) -> None:
    out = await tools.exec_shell_command(ws, {"command": "pwd; echo err >&2; exit 3"})
    assert str(ws.resolve()) in out and "err" in out and "(exit status 3)" in out
    out = await tools.exec_shell_command(ws, {"command": "head -c 200000 /dev/zero | tr '\\0' a"})
    assert "bytes of output not shown" in out and len(out) < tools.EXEC_OUTPUT_BYTES + 200


async def test_exec_time_limit_kills_the_group(ws: Path) -> None:
    t0 = time.monotonic()
    out = await tools.exec_shell_command(ws, {"command": "sleep 60 & sleep 60", "timeout_s": 1})
    assert time.monotonic() - t0 < 3 and "time limit" in out


async def test_a_cancelled_command_kills_its_whole_group(ws: Path) -> None:
    pidfile = ws / "pids"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tools.exec_shell_command, ws,
                           {"command": f"sleep 60 & echo $! > {pidfile}; sleep 60"})
        for _ in range(500):        # the file appears when the shell has started
            if pidfile.exists() and pidfile.read_text().strip():
                break
            await trio.sleep(0.02)
        t0 = time.monotonic()
        nursery.cancel_scope.cancel()
    assert time.monotonic() - t0 < 1.0
    child = int(pidfile.read_text())
    await trio.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_atomic_write_never_leaves_half_a_file(tmp_path: Path) -> None:
    """kill -9 a writer during 100 writes of a big conversation: each read parses."""
    target = tmp_path / "c.json"
    code = (f"import sys; sys.path.insert(0, {str(Path.cwd())!r})\n"
            "from bmoe.agent import store\nfrom pathlib import Path\n"
            f"p = Path({str(target)!r})\n"
            "for n in range(100):\n"
            "    store.write_json(p, {'n': n, 'items': ['x' * 1000] * 2000})\n"
            "    print(n, flush=True)\n")
    for kill_after in (3, 17, 41):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for _ in range(kill_after):
            proc.stdout.readline()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        value = json.loads(target.read_text())
        assert value["n"] >= kill_after - 1 and len(value["items"]) == 2000
    store.clean_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_credentials_mode(tmp_path: Path) -> None:
    from bmoe.agent.providers import ProviderStore
    ps = ProviderStore(tmp_path)
    ps.save("p1", {"id": "p1", "kind": "openai", "base_url": "http://x", "model": "m"}, "sk-1")
    assert (tmp_path / "credentials.json").stat().st_mode & 0o777 == 0o600
    assert "sk-1" not in (tmp_path / "agent" / "providers.json").read_text()
    assert ps.listing() == [{"id": "p1", "kind": "openai", "base_url": "http://x", "model": "m",
                             "has_key": True}]


def test_messages_and_recovery() -> None:
    conv = cv.new_conversation("t", "ask", None, "local")
    conv["items"] += [cv.user_item("hi"), a := cv.assistant_item()]
    t = cv.tool_item(a["id"], "call_1", "read_file")
    t["arguments"], t["state"] = '{"path": "x"}', "running"
    conv["items"].append(t)
    conv["state"] = "running"
    assert cv.recover(conv) and conv["state"] == "idle" and t["state"] == "failed"
    msgs = cv.to_messages(conv)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == "call_1"
    am = anthropic_messages(msgs)
    assert am[1]["content"][0] == {"type": "tool_use", "id": "call_1", "name": "read_file",
                                   "input": {"path": "x"}}
    assert am[2]["content"][0]["tool_use_id"] == "call_1"


def test_literal_grammar_escapes() -> None:
    assert literal_grammar('a "b"\n\\') == 'root ::= "a \\"b\\"\\n\\\\"\n'


def test_preview_policies_are_the_spec_strings() -> None:
    assert preview.policy("auto", True) == preview.POLICY_ON
    assert preview.policy("auto", False) == preview.POLICY_OFF
    assert preview.policy("off", True) == preview.POLICY_OFF


def test_compaction_leaves_old_results_out_step_by_step() -> None:
    conv = cv.new_conversation("t", "full", "w", "local")
    items = conv["items"]
    items.append(cv.user_item("go"))
    for n in range(3):
        a = cv.assistant_item()
        a["state"] = "done"
        t = cv.tool_item(a["id"], f"call_{n}", "read_file")
        t["state"], t["output"] = "done", f"result {n}"
        items += [a, t]
    items.append(cv.assistant_item())                          # the round under way
    assert cv.compaction_point(conv) == 5                      # keep the last round's result
    conv["elide_before"] = 5
    assert [m["content"] for m in cv.to_messages(conv) if m["role"] == "tool"] == \
        [cv.ELIDED, cv.ELIDED, "result 2"]
    assert cv.compaction_point(conv) == 7                      # then that one too
    conv["elide_before"] = 7
    assert cv.compaction_point(conv) is None
