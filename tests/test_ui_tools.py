"""The Tools screen in headless Chromium, against a real server (the tiny generated
model, a scripted provider for the task's run, a scratch HOME for the clients' files):
create, refuse, edit and delete a skill and switch it on in a conversation; create a
task, run it now, see it running from its `task` event, be told it is busy, open its
conversation; connect Claude Code and see what was written, and be told why opencode's
file was left alone; the MCP section's help with no servers, and a configured server's
state, tools and restart. No CSP violation and no console error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import ServerProcess, start_server
from test_agent_e2e import Scripted, provider, tool_call  # noqa: F401 - the fixture
from test_ui_browser import Watched, assert_json_content_type, browser, open_page, shot  # noqa: F401

MCP_SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
BROKEN_OPENCODE = b'{\n  // my comment\n  "theme": "tokyonight",\n}\n'


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    broken = home / ".config" / "opencode" / "opencode.json"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(BROKEN_OPENCODE)
    return home


@pytest.fixture
def tools_server(tmp_path: Path, tiny_moe: Path, home: Path) -> Iterator[ServerProcess]:
    env = {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
           "CODEX_HOME": str(home / ".codex"), "XDG_CONFIG_HOME": str(home / ".config")}
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096", env=env)
    assert srv.info()["state"] == "ready"
    yield srv
    srv.stop()


def tools_page(browser: Any, srv: ServerProcess) -> Watched:
    w = open_page(browser, srv.url)
    w.page.click(".tab[data-view=tools]")
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "the event stream")
    assert w.page.evaluate("() => location.hash") == "#tools"
    return w


def test_skills_tasks_clients_and_no_mcp(browser: Any, tools_server: ServerProcess,  # noqa: F811
                                        provider: Scripted, home: Path, tmp_path: Path) -> None:  # noqa: F811
    srv = tools_server
    ws = tmp_path / "project"
    ws.mkdir()
    wid = srv.request("POST", "/api/workspaces", {"path": str(ws)})[2]["id"]
    srv.request("PUT", "/api/providers/scripted", {"kind": "openai", "base_url": provider.url + "/v1",
                                                   "model": "m", "api_key": "sk-ui"})
    w = tools_page(browser, srv)
    try:
        _skills(w, srv, wid)
        _tasks(w, srv, provider)
        _clients(w, home)
        _no_mcp(w)
        assert_json_content_type(w)
        w.assert_clean(lambda text: "409" in text or "400" in text)   # the refusals we asked for
    finally:
        w.page.context.close()


def _skills(w: Watched, srv: ServerProcess, wid: str) -> None:
    p = w.page
    p.fill("#skill-name", "release-notes")
    p.fill("#skill-description", "Use when writing release notes.")
    p.fill("#skill-body", "List the changes, newest first.")
    p.click("#skill-save")
    w.wait("() => document.querySelector('#skill-list [data-skill=release-notes][data-source=person]')",
           "the new skill, listed")
    skill_md = (srv.data_dir / "skills" / "release-notes" / "SKILL.md").read_text()
    assert "description: Use when writing release notes." in skill_md
    assert skill_md.rstrip().endswith("List the changes, newest first.")
    assert p.input_value("#skill-name") == ""                          # the form is cleared
    # the same name again: the server's 409, in its words
    p.fill("#skill-name", "release-notes")
    p.fill("#skill-description", "Again.")
    p.click("#skill-save")
    w.wait("() => !document.querySelector('#skill-error').hidden", "the conflict")
    assert w.text("#skill-error") == "You already have a skill named release-notes."
    # a name the server refuses (400 invalid name)
    p.fill("#skill-name", "Release Notes")
    p.click("#skill-save")
    w.wait("() => document.querySelector('#skill-error').textContent.startsWith(\"A skill's name is\")",
           "the invalid name refused")
    # edit: the instructions are read into the box; a new description, the body kept
    p.click("#skill-list [data-skill=release-notes] button[aria-label='Edit release-notes']")
    assert p.is_disabled("#skill-name")
    w.wait("() => document.querySelector('#skill-body').value.includes('newest first')",
           "the skill's instructions loaded for editing")
    p.fill("#skill-description", "Use for a changelog.")
    p.click("#skill-save")
    w.wait("() => document.querySelector('#skill-list [data-skill=release-notes] .tools-desc')"
           "?.textContent === 'Use for a changelog.'", "the edited description")
    skill_md = (srv.data_dir / "skills" / "release-notes" / "SKILL.md").read_text()
    assert "description: Use for a changelog." in skill_md and "newest first" in skill_md
    # a second skill to delete
    p.fill("#skill-name", "scratch")
    p.fill("#skill-description", "Throwaway.")
    p.click("#skill-save")
    w.wait("() => document.querySelector('#skill-list [data-skill=scratch]')", "the second skill")
    p.click("#skill-list [data-skill=scratch] button.danger")
    w.wait("() => !document.querySelector('#skill-list [data-skill=scratch]')", "the deleted skill gone")
    assert not (srv.data_dir / "skills" / "scratch").exists()
    # switched on in a conversation, from the Agent screen
    p.click(".tab[data-view=agent]")
    w.wait(f"() => document.querySelector('select[aria-label=Workspace] option[value=\"{wid}\"]')",
           "the workspace")
    p.select_option("select[aria-label=Workspace]", wid)
    p.click("#agent-new")
    w.wait("() => document.querySelector('.agent-conv.current')", "the new conversation")
    w.wait("() => !document.querySelector('#agent-skills').hidden", "the skill switches")
    p.click("#agent-skills summary")
    p.check("#agent-skills input[data-skill=release-notes]")
    w.wait("() => document.querySelector('#agent-skills summary').textContent === 'Skills (1 on)'",
           "the skill switched on")
    cid = p.evaluate("() => document.querySelector('.agent-conv.current').dataset.id")
    assert srv.request("GET", f"/api/conversations/{cid}")[2]["skills"] == ["release-notes"]
    p.uncheck("#agent-skills input[data-skill=release-notes]")
    w.wait("() => document.querySelector('#agent-skills summary').textContent === 'Skills (0 on)'",
           "the skill switched off")
    assert srv.request("GET", f"/api/conversations/{cid}")[2]["skills"] == []
    p.click(".tab[data-view=tools]")


def _tasks(w: Watched, srv: ServerProcess, provider: Scripted) -> None:  # noqa: F811
    p = w.page
    # a command that runs until stopped: the task's run stays `running`
    provider.script = [tool_call("exec_shell_command", command="sleep 60")]
    w.wait("() => document.querySelector('#task-route option[value=scripted]')", "the provider")
    p.fill("#task-title", "Nightly check")
    p.fill("#task-prompt", "Wait a minute.")
    p.select_option("#task-mode", "full")
    p.select_option("#task-route", "scripted")
    p.select_option("#task-schedule-kind", "cron")
    p.fill("#task-schedule-value", "0 9 * * 1-5 *")                   # six fields
    p.click("#task-save")
    w.wait("() => !document.querySelector('#task-error').hidden", "the schedule refused")
    assert "five fields" in w.text("#task-error")
    p.select_option("#task-schedule-kind", "every")
    p.fill("#task-schedule-value", "60")
    p.click("#task-save")
    w.wait("() => document.querySelector('#task-list [data-task]')", "the task, listed")
    tid = p.evaluate("() => document.querySelector('#task-list [data-task]').dataset.task")
    task = srv.request("GET", f"/api/tasks/{tid}")[2]
    assert task["schedule"] == {"every_s": 3600} and task["mode"] == "full" and task["route"] == "scripted"
    item = f"#task-list [data-task={tid}]"
    assert "Every hour" in w.text(item)
    assert w.text(f"{item} .task-next") in ("in 60 min", "in 1 h")
    # the relative times follow the clock without a rebuild (as the 30 s timer does)
    p.evaluate("() => window.bmoeApp.tools.refreshTimes(Date.now() / 1000 + 1800)")
    assert w.text(f"{item} .task-next") in ("in 30 min", "in 29 min")
    assert w.text(f"{item} .task-last") == "never"
    p.click(f"{item} button[data-action=run]")
    w.wait(f"() => document.querySelector('{item}')?.dataset.run === 'running'", "the run, running")
    w.wait(f"() => document.querySelector('{item} a.task-conv')", "the link to its conversation")
    p.evaluate("() => document.querySelector('#view-tools').scrollTo(0, 0)")
    shot(w, "tools.png")
    # run now again while it runs: the server's 409 busy, in its words
    p.click(f"{item} button[data-action=run]")
    w.wait(f"() => !document.querySelector('{item} p.error').hidden", "busy")
    assert w.text(f"{item} p.error").startswith("This task is running")
    # its conversation, opened from the task; stopped there; the task says how it ended
    cid = srv.request("GET", f"/api/tasks/{tid}")[2]["last_run"]["conversation"]
    p.click(f"{item} a.task-conv")
    w.wait("() => document.querySelector('.tab[data-view=agent]').getAttribute('aria-selected') === 'true'"
           f" && document.querySelector('.agent-conv.current')?.dataset.id === '{cid}'",
           "the task's conversation, open")
    w.wait("() => !document.querySelector('#agent-stop').hidden", "the stop button")
    p.click("#agent-stop")
    p.click(".tab[data-view=tools]")
    w.wait(f"() => ['done', 'error'].includes(document.querySelector('{item}')?.dataset.run)",
           "the run's end, from its task event")
    # edit: on demand only; then delete
    p.click(f"{item} button[aria-label='Edit Nightly check']")
    assert p.input_value("#task-schedule-value") == "60"
    p.select_option("#task-schedule-kind", "none")
    p.click("#task-save")
    w.wait(f"() => document.querySelector('{item}')?.textContent.includes('On demand only')", "the edit")
    assert srv.request("GET", f"/api/tasks/{tid}")[2]["schedule"] is None
    p.click(f"{item} button.danger")
    w.wait(f"() => !document.querySelector('{item}')", "the task gone")
    assert srv.request("GET", "/api/tasks")[2]["tasks"] == []


def _clients(w: Watched, home: Path) -> None:
    p = w.page
    w.wait("() => document.querySelectorAll('#client-list [data-client]').length === 3", "the catalog")
    ids = p.evaluate("() => [...document.querySelectorAll('#client-list [data-client]')].map((e) => e.dataset.client)")
    assert ids == ["claude-code", "codex", "opencode"]
    claude = home / ".claude" / "settings.json"
    assert str(claude) in w.text("#client-list [data-client=claude-code]")
    p.click("#connect-claude-code")
    w.wait("() => document.querySelector('#client-list [data-client=claude-code] .client-result')",
           "what connect wrote")
    assert w.text("#client-list [data-client=claude-code] .client-result") == \
        f"Claude Code now uses this server: wrote {claude}."
    assert "ANTHROPIC_BASE_URL" in json.loads(claude.read_text())["env"]
    assert "connected" in w.text("#client-list [data-client=claude-code] .tools-item-head")
    p.click("#connect-opencode")
    w.wait("() => document.querySelector('#client-list [data-client=opencode] .client-result.error')",
           "the conflict")
    said = w.text("#client-list [data-client=opencode] .client-result")
    assert "The file was left as it is" in said and "Traceback" not in said
    assert (home / ".config" / "opencode" / "opencode.json").read_bytes() == BROKEN_OPENCODE


def _no_mcp(w: Watched) -> None:
    w.page.click(".tools-nav button:has-text('MCP servers')")
    assert w.page.evaluate("() => document.activeElement.id") == "tools-mcp-title"
    assert w.page.evaluate("() => document.querySelectorAll('#mcp-list li').length") == 0
    help_text = w.text("#mcp-help")
    assert "No MCP servers are configured" in help_text and "mcp.json" in help_text
    assert json.loads(w.text("#mcp-help pre"))["mcpServers"]


def test_mcp_servers_state_tools_and_restart(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    data = tmp_path / "data"
    data.mkdir()
    (data / "mcp.json").write_text(json.dumps({"mcpServers": {
        "calc": {"command": sys.executable, "args": [MCP_SERVER, "good"]},
        "broken": {"command": sys.executable, "args": [MCP_SERVER, "die"]},
    }}))
    srv = start_server(data, wait_ready=False)
    try:
        w = tools_page(browser, srv)
        try:
            p = w.page
            w.wait("() => document.querySelector('#mcp-list [data-mcp=calc][data-state=running]')",
                   "the good server running (from its mcp event)")
            tools = p.evaluate("() => [...document.querySelectorAll('#mcp-list [data-mcp=calc] "
                               ".tools-mcp-tools code')].map((e) => e.textContent)")
            assert "mcp__calc__add" in tools, tools
            w.wait("() => document.querySelector('#mcp-list [data-mcp=broken][data-state=failed] .mcp-error')",
                   "the broken server's error")
            error = w.text("#mcp-list [data-mcp=broken] .mcp-error")
            assert error.endswith(".") and "Traceback" not in error, error
            assert not p.evaluate("() => document.querySelector('#mcp-help').textContent.includes('No MCP servers')")
            # the states calc's `mcp` events carry from here on
            p.evaluate("() => { window.__mcp = []; const t = window.bmoeApp.tools;"
                       " const f = t.onEvent.bind(t); t.onEvent = (n, d) => {"
                       " if (n === 'mcp') window.__mcp.push(`${d.name}:${d.state}`); f(n, d); }; }")
            p.click("#mcp-list [data-mcp=calc] button[aria-label='Restart calc']")
            w.wait("() => { const s = window.__mcp.filter((x) => x.startsWith('calc:'));"
                   " return s.length > 1 && s[0] !== 'calc:running' && s[s.length - 1] === 'calc:running'; }",
                   "calc stopped and running again")
            w.wait("() => document.querySelector('#mcp-list [data-mcp=calc]')?.dataset.state === 'running'"
                   " && document.querySelector('#mcp-list [data-mcp=calc]').textContent.includes('mcp__calc__add')",
                   "calc shown running, with its tools")
            assert len(w.posts("/api/mcp/calc/restart")) == 1
            shot(w, "tools-mcp.png")
            w.assert_clean()
        finally:
            w.page.context.close()
    finally:
        srv.stop()
