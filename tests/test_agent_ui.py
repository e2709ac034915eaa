"""The Agent screen in headless Chromium, against a real server and a scripted
provider: open a conversation, send, approve a write, see the answer, preview the
page the agent wrote in its sandboxed frame, stop a running command; with no CSP
violation and no console error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import ServerProcess, start_server
from test_agent_e2e import Scripted, provider, tool_call  # noqa: F401 - the fixture
from test_ui_browser import Watched, browser, open_page, shot  # noqa: F401 - the fixture

PAGE = "<h1>Hi from the agent</h1><script>document.body.dataset.ran = 'yes';</script>"


@pytest.fixture
def agent_ui_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path / "data", wait_ready=False)
    yield srv
    srv.stop()


def test_the_agent_screen(browser: Any, agent_ui_server: ServerProcess, provider: Scripted,  # noqa: F811
                          tmp_path: Path) -> None:
    srv = agent_ui_server
    ws = tmp_path / "site"
    ws.mkdir()
    w = srv.request("POST", "/api/workspaces", {"path": str(ws)})[2]
    srv.request("PUT", "/api/providers/scripted", {"kind": "openai", "base_url": provider.url + "/v1",
                                                   "model": "m", "api_key": "sk-ui"})
    provider.script = [tool_call("write_file", path="index.html", content=PAGE),
                       "I wrote **index.html**: open the preview.",
                       tool_call("exec_shell_command", command="sleep 60")]
    page = open_page(browser, srv.url)
    try:
        _drive(page, w["id"], ws)
    finally:
        page.page.context.close()


def _drive(w: Watched, wid: str, ws: Path) -> None:
    p = w.page
    p.click(".tab[data-view=agent]")
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "the event stream")
    w.wait("() => document.querySelector('#agent-route option[value=scripted]')", "the provider")
    p.select_option("select[aria-label=Workspace]", wid)
    p.select_option("select[aria-label='Access mode']", "ask")
    p.select_option("#agent-route", "scripted")
    p.click("#agent-new")
    w.wait("() => document.querySelector('.agent-conv.current')", "the new conversation, open")
    p.fill("#agent-prompt", "Make me a page.")
    p.click("#agent-send")
    w.wait("() => document.querySelector('.agent-approval')", "the approval card")
    assert w.text(".agent-tool-name") == "write_file"
    assert json.loads(w.text(".agent-args"))["path"] == "index.html"
    assert not (ws / "index.html").exists()
    shot(w, "agent-approval.png")
    p.click(".agent-approval [data-decision=once]")
    w.wait("() => [...document.querySelectorAll('.agent-assistant .agent-text strong')]"
           ".some((e) => e.textContent === 'index.html')", "the answer, rendered")
    w.wait("() => document.querySelector('#agent-state')?.textContent === 'idle'", "the run to end")
    assert (ws / "index.html").read_text() == PAGE
    p.click(".agent-preview-button")
    frame = p.frame_locator(".agent-frame")
    assert frame.locator("h1").inner_text() == "Hi from the agent"
    assert p.get_attribute(".agent-frame", "sandbox") == "allow-scripts"
    shot(w, "agent.png")
    # a command that runs until stopped
    p.fill("#agent-prompt", "Now wait.")
    p.click("#agent-send")
    w.wait("() => document.querySelector('.agent-approval')", "the command's approval")
    p.click(".agent-approval [data-decision=always]")
    w.wait("() => document.querySelector('.agent-item[data-state=running]')", "the command running")
    p.click("#agent-stop")
    w.wait("() => document.querySelector('#agent-state')?.textContent === 'idle'", "the stop")
    states = p.evaluate("() => [...document.querySelectorAll('.agent-item[data-kind=tool]')]"
                        ".map((e) => e.dataset.state)")
    assert states == ["done", "failed"], states
    assert w.text(".agent-notice") == "Stopped."
    w.assert_clean()
