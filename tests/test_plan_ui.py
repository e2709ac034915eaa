"""The Plan screen in headless Chromium: the sentence, "label: brief" with the reason
folded, predicted beside measured, Measure again with its progress, Apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ServerProcess, start_server
from test_ui_browser import browser, open_ready, shot  # noqa: F401 - the fixture

__all__ = ["browser"]


@pytest.fixture
def plan_server(tmp_path: Path, tiny_moe: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096")
    yield srv
    srv.stop()


def test_the_plan_screen_measures_shows_and_applies(browser: Any,  # noqa: F811
                                                    plan_server: ServerProcess) -> None:
    w = open_ready(browser, plan_server)
    try:
        w.page.click('.tab[data-view="plan"]')
        w.wait("() => document.querySelector('#plan-sentence')?.textContent === 'No plan yet'",
               "the empty plan screen")
        assert w.page.evaluate("() => document.querySelector('#plan-apply').disabled")
        w.page.evaluate("() => { window.__steps = []; }")
        w.page.click("#plan-measure")
        w.wait("() => document.querySelector('#plan-sentence').dataset.regime", "a plan",
               timeout=90)
        sentence = w.text("#plan-sentence")
        body = plan_server.request("GET", "/api/plan?cached=1")[2]
        assert sentence == body["summary"]["sentence"]
        lines = w.page.evaluate("() => [...document.querySelectorAll('.plan-line')]"
                                ".map((e) => e.textContent)")
        assert len(lines) == len(body["decisions"])
        first = body["decisions"][0]
        assert f"{first['label']}: {first['brief']}" in lines
        # the reason is folded away until its decision is opened
        reason = w.page.locator(".plan-reason").first
        assert not reason.is_visible()
        w.page.locator(".plan-decision summary").first.click()
        assert reason.is_visible()
        assert w.text("#plan-speed .predicted").endswith("s/token")
        assert w.page.evaluate("() => document.querySelector('#plan-progress').hidden")
        assert not w.page.evaluate("() => document.querySelector('#plan-apply').disabled")
        w.page.click("#plan-apply")
        w.wait("() => document.querySelector('#plan-applied').textContent", "applied")
        config = plan_server.request("GET", "/api/config")[2]
        assert config["plan"] and len(config["plan"]) == len(body["decisions"])
        shot(w, "plan.png")
        # after an answer the measured column fills
        status, _, _ = plan_server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert status == 200
        w.page.reload()
        w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "events")
        w.page.click('.tab[data-view="plan"]')
        w.wait("() => (document.querySelector('#plan-speed .measured')?.textContent || '')"
               ".endsWith('s/token')", "the measured figure")
        w.assert_clean()
    finally:
        w.page.context.close()


def test_the_plan_screen_shows_progress_while_it_measures(browser: Any,  # noqa: F811
                                                          plan_server: ServerProcess) -> None:
    w = open_ready(browser, plan_server)
    try:
        w.page.click('.tab[data-view="plan"]')
        w.page.evaluate("""() => {
          window.__labels = [];
          const el = document.querySelector('#plan-progress-label');
          new MutationObserver(() => window.__labels.push(el.textContent))
            .observe(el, {childList: true, characterData: true, subtree: true});
        }""")
        w.page.click("#plan-measure")
        w.wait("() => document.querySelector('#plan-sentence').dataset.regime", "a plan",
               timeout=90)
        labels = w.page.evaluate("() => window.__labels")
        assert "Measuring the storage speed" in labels, labels
        w.wait("() => document.querySelector('#plan-progress').hidden", "progress hidden")
        w.assert_clean()
    finally:
        w.page.context.close()
