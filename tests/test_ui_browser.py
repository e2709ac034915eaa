"""The web UI in a real browser: headless Chromium (Debian's package) driven by Playwright.

Each test opens the page on a bmoe-server running the tiny MoE and checks, besides
what it is about, that the page logged no console error and met no CSP violation:
the server sends its CSP on every response, so anything inline or fetched from
elsewhere shows up as a `securitypolicyviolation` event.

Playwright's `wait_for_function` evaluates a string in the page, which the CSP (no
'unsafe-eval') refuses; waits here poll `page.evaluate` instead, which runs through the
debugger and is not subject to the page's policy. Screenshots for the docs are written
to docs/screenshots/.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
WAIT_S = 60.0
VIEWPORT = {"width": 1280, "height": 800}

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "font-src 'self'; connect-src 'self'; media-src 'none'; object-src 'none'; "
       "frame-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# Collects CSP violations from the first moment of every document (an init script is
# injected through the debugger, so the page's own policy does not refuse it).
WATCH_CSP = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', (e) => {
  window.__csp.push({directive: e.violatedDirective, blocked: e.blockedURI, sample: e.sample});
});
"""

# -- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium. Outside CI the tests skip without Playwright or the package;
    in CI (CI set, as scripts/test installs both) a missing browser is a failure."""
    if os.environ.get("CI"):
        import playwright.sync_api as sync_api
        assert CHROMIUM.exists(), "CI needs Debian's chromium package (apt-get install chromium)"
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
        if not CHROMIUM.exists():
            pytest.skip("needs Debian's chromium package (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    """A server of our own: these tests change its settings (and put them back). The
    server's default context, 16384, keeps an unbounded answer running long enough to
    stop even at the tiny model's thousands of tokens per second."""
    srv = start_server(tmp_path_factory.mktemp("ui-data"), "-m", str(tiny_moe))
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


@pytest.fixture
def short_ctx_server(tmp_path: Path, tiny_moe: Path) -> Iterator[ServerProcess]:
    """A 2048 context: short of what clients send, so a refusal makes ctx_advice warn."""
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "2048", "-n", "4")
    yield srv
    srv.stop()


@dataclass
class Watched:
    """A page with its console, page errors, CSP violations and requests recorded."""
    page: Any
    console: list[tuple[str, str]] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)

    def csp_violations(self) -> list[dict[str, str]]:
        return self.page.evaluate("() => window.__csp || []")

    def errors(self) -> list[str]:
        return [text for kind, text in self.console if kind in ("error", "pageerror")]

    def assert_clean(self, allow: Callable[[str], bool] = lambda _text: False) -> None:
        errors = [e for e in self.errors() if not allow(e)]
        assert errors == [], f"console errors: {errors}"
        assert self.csp_violations() == [], f"CSP violations: {self.csp_violations()}"
        assert self.console_csp() == [], self.console_csp()

    def console_csp(self) -> list[str]:
        return [t for _, t in self.console if "Content Security Policy" in t]

    def wait(self, js: str, what: str, timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.page.evaluate(js)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def text(self, selector: str) -> str:
        return self.page.locator(selector).first.inner_text()

    def posts(self, path: str) -> list[Any]:
        return [r for r in self.requests if r.method != "GET" and r.url.endswith(path)]


def open_page(browser: Any, url: str) -> Watched:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    watched = Watched(page)
    page.on("console", lambda m: watched.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: watched.console.append(("pageerror", str(e))))
    page.on("request", lambda r: watched.requests.append(r))
    page.add_init_script(WATCH_CSP)
    page.goto(url + "/")
    return watched


def open_ready(browser: Any, srv: ServerProcess) -> Watched:
    w = open_page(browser, srv.url)
    w.wait("() => document.querySelector('#status')?.dataset.state === 'ready'", "the model to show ready")
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "the event stream")
    return w


@pytest.fixture
def ui(browser: Any, ui_server: ServerProcess) -> Iterator[Watched]:
    w = open_ready(browser, ui_server)
    yield w
    w.page.context.close()


def shot(w: Watched, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    w.page.screenshot(path=str(SCREENSHOTS / name))


def tokens_seen(w: Watched) -> int:
    return int(w.page.evaluate("() => Number(document.querySelector('#metrics').dataset.tokens || 0)"))


# How the last answer ended: '' or 'streaming' while it runs, then a finish_reason or 'error'.
LAST_FINISH = ("() => { const a = [...document.querySelectorAll('.msg-assistant')].pop(); "
               "const f = a ? a.dataset.finish : ''; return f === 'streaming' ? '' : f; }")


def send(w: Watched, text: str) -> None:
    w.page.fill("#prompt", text)
    w.page.click("#send")


def assert_json_content_type(w: Watched) -> None:
    """Every request that is not a GET declared JSON (the server refuses others, 415)."""
    for r in w.requests:
        if r.method not in ("GET", "HEAD"):
            assert r.headers.get("content-type") == "application/json", (r.method, r.url, r.headers)


# -- the page itself --------------------------------------------------------------------

def test_assets_are_one_page_one_script_one_stylesheet_with_nothing_inline() -> None:
    html = (ASSETS / "index.html").read_text(encoding="utf-8")
    assert sorted(p.name for p in ASSETS.iterdir()) == ["app.css", "app.js", "index.html"]
    assert html.count("<script") == 1 and '<script src="/app.js" defer></script>' in html
    assert html.count('rel="stylesheet"') == 1 and "<style" not in html
    assert not re.search(r"\sstyle\s*=", html) and not re.search(r"\son[a-z]+\s*=", html)
    assert "javascript:" not in html
    script = (ASSETS / "app.js").read_text(encoding="utf-8")
    assert not re.search(r"\beval\(|new Function\(", script)


def test_static_files_carry_their_types_and_the_csp(ui_server: ServerProcess) -> None:
    for path, ctype in [("/", "text/html"), ("/app.js", "text/javascript"), ("/app.css", "text/css")]:
        status, headers, _ = ui_server.request("GET", path)
        assert status == 200, path
        assert headers["Content-Type"].startswith(ctype), (path, headers["Content-Type"])
        assert headers["Content-Security-Policy"] == CSP
        assert headers["X-Content-Type-Options"] == "nosniff"


# -- chat, metrics, stop ----------------------------------------------------------------

def start_and_stop(w: Watched, text: str, n: int) -> None:
    """Send `text` as the `n`th message, see it stream and the metrics move, stop it."""
    before = tokens_seen(w)
    send(w, text)
    w.wait(f"() => (document.querySelectorAll('.msg-assistant .md')[{n - 1}]?.textContent || '')"
           ".length > 20", f"answer {n} to stream")
    w.wait(f"() => Number(document.querySelector('#metrics').dataset.tokens) > {before + 20}",
           "token events in the metrics panel")
    assert w.page.locator("#stop").is_visible()


def stop(w: Watched, n: int) -> None:
    w.page.click("#stop")
    w.wait(LAST_FINISH, f"answer {n} to end")
    assert w.page.evaluate(LAST_FINISH) == "cancelled"


def test_chat_streams_moves_the_metrics_and_stops(ui: Watched, ui_server: ServerProcess) -> None:
    page = ui.page
    assert page.locator("#key-dialog").is_visible() is False
    assert ui.text("#think-label") == "Thinking"  # the label is the parameter table's
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions") else None)

    start_and_stop(ui, "Tell me a long story about the sea.", 1)
    assert ui.text("[data-metric=decode] .fig-value").endswith("tok/s")
    assert ui.text("[data-metric=rss] .fig-value").endswith("MiB")
    assert page.locator("[data-spark=tokS] .spark-line").get_attribute("points")
    text_then = ui.text(".msg-assistant .md")
    stop(ui, 1)
    assert "Stopped." in ui.text(".msg-assistant .msg-footer")
    assert len(ui.text(".msg-assistant .md")) >= len(text_then)
    assert len(ui.posts("/api/cancel")) == 1, "Stop posts /api/cancel"
    assert not ui_server.info()["generating"]
    ui.wait("() => document.querySelector('.summary')?.textContent.includes('(stopped)')",
            "the last-answer summary")
    assert ui.text("[data-metric=ttft] .fig-value") != "—"
    assert ui.text("[data-metric=prefill] .fig-value").endswith("tok/s")
    assert page.locator("#send").is_visible()

    # A second turn resends the history, the stopped answer included.
    start_and_stop(ui, "Go on, and tell me about the ships.", 2)
    shot(ui, "chat-streaming.png")
    stop(ui, 2)
    assert [len(b["messages"]) for b in bodies] == [1, 3]
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"]
    assert all(b["stream"] is True and b["think"] is True for b in bodies)
    assert_json_content_type(ui)
    ui.assert_clean()


# -- settings ---------------------------------------------------------------------------

def test_settings_saved_rejected_reloaded_and_persisted(ui: Watched, ui_server: ServerProcess) -> None:
    page = ui.page
    page.click(".tab[data-view=settings]")
    params = ui_server.request("GET", "/api/params")[2]
    groups = sorted({(p["group_order"], p["group_label"]) for p in params if p["form"]})
    shown = page.locator(".group-title").all_inner_texts()
    assert shown == [label for _, label in groups], shown  # in group_order, by group_label
    # Every form row and no other (the level filter starts at the form's rows).
    keys = page.evaluate("() => [...document.querySelectorAll('.row')].map(r => r.dataset.key)")
    assert set(keys) == {p["key"] for p in params if p["form"]}
    assert page.locator(".row[data-key=cache-mb] select.mode option").all_inner_texts() == \
        ["auto", "off", "a value in MiB"]

    # Max tokens: a number instead of its special value; Temperature out of its limits.
    page.select_option("#f-n-predict", "number")
    page.fill("#f-n-predict-number", "24")
    page.select_option("#f-temp", "number")
    page.fill("#f-temp-number", "5")
    page.fill("#f-ctx-size", "2048")
    page.click("#settings-save")
    ui.wait("() => document.querySelector('#settings-status').textContent.includes('not accepted')",
            "the save to answer")
    rejected = ui.text(".row[data-key=temp] .row-rejected")
    assert rejected.startswith("Temperature must be between"), rejected  # the server's words
    assert page.locator(".row[data-key=n-predict] .row-rejected").is_hidden()
    config = ui_server.request("GET", "/api/config")[2]
    assert config["values"]["n-predict"] == 24 and config["values"]["ctx-size"] == 2048
    assert {"n-predict", "ctx-size"} <= set(config["user_keys"])
    assert config["values"]["temp"] == 0.0
    ui.wait("() => !document.querySelector('#reload-banner').hidden", "the reload banner")
    assert "Context" in ui.text("#reload-banner")
    page.set_viewport_size({"width": 1280, "height": 1180})
    page.evaluate("() => document.querySelector('#view-settings').scrollTop = "
                  "document.querySelector('.group[data-group=generation]').offsetTop - 200")
    shot(ui, "settings.png")
    page.set_viewport_size(VIEWPORT)

    # The command line, and loading again with the new context.
    assert "--n-predict 24" in ui.text("#command")
    page.click("#load-again")
    ui.wait("() => document.querySelector('#reload-banner').hidden", "the banner to go")
    assert ui_server.wait_state("ready")["model"]["n_ctx"] == 2048

    # Persisted: a new page shows the saved value.
    page.reload()
    ui.wait("() => document.querySelector('#status')?.dataset.state === 'ready'", "ready again")
    page.click(".tab[data-view=settings]")
    assert page.input_value("#f-n-predict-number") == "24"
    assert page.input_value("#f-ctx-size") == "2048"
    ui.assert_clean()

    # Back to the defaults, with the row's own control, for the tests that follow.
    page.click(".row[data-key=n-predict] .link-button")
    page.click(".row[data-key=ctx-size] .link-button")
    ui.wait("() => !document.querySelector('#reload-banner').hidden", "the reload banner")
    page.click("#load-again")
    ui.wait("() => document.querySelector('#reload-banner').hidden", "the banner to go")
    config = ui_server.request("GET", "/api/config")[2]
    assert "n-predict" not in config["user_keys"] and "ctx-size" not in config["user_keys"]
    assert ui_server.wait_state("ready")["model"]["n_ctx"] == 16384


def test_chat_honours_the_saved_limit_and_the_thinking_toggle(ui: Watched,
                                                              ui_server: ServerProcess) -> None:
    ui_server.request("PUT", "/api/config", {"values": {"n-predict": 16}})
    try:
        bodies: list[dict[str, Any]] = []
        ui.page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
                   if r.url.endswith("/v1/chat/completions") else None)
        ui.page.locator("#think").uncheck()
        for n, text in enumerate(["First question?", "And a second one?"], start=1):
            send(ui, text)
            ui.wait(f"() => {{ const a = document.querySelectorAll('.msg-assistant'); "
                    f"return a.length === {n} && a[{n - 1}].dataset.finish === 'length'; }}",
                    f"answer {n} to stop at the token limit")
        assert [len(b["messages"]) for b in bodies] == [1, 3]
        assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
        first_answer = bodies[1]["messages"][1]
        assert isinstance(first_answer["content"], str) and first_answer["content"]
        assert bodies[1]["messages"][0] == {"role": "user", "content": "First question?"}
        assert all(b["stream"] is True and b["think"] is False for b in bodies)
        assert "Stopped at the token limit." in ui.text(".msg-assistant .msg-footer")
        ui.assert_clean()
    finally:
        ui_server.request("PUT", "/api/config", {"reset": ["n-predict"]})


# -- what the server says, shown as it says it ------------------------------------------

def test_a_refusal_is_shown_in_the_servers_words_and_links_the_context_setting(
        browser: Any, short_ctx_server: ServerProcess) -> None:
    ui = open_ready(browser, short_ctx_server)
    page = ui.page
    assert page.locator("#ctx-warning").is_hidden()  # short, but on loopback: no warning yet
    send(ui, "word " * 6000)
    ui.wait("() => !document.querySelector('.msg-assistant .msg-error')?.hidden", "the error")
    message = ui.text(".msg-assistant .msg-error-text")
    assert "Context" in message and "context_full" in ui.text(".msg-assistant .msg-error")
    ui.wait("() => !document.querySelector('#ctx-warning').hidden", "the ctx_advice warning")
    link = page.locator("#ctx-warning a")
    assert link.inner_text() == "Context"  # the parameter's label, not a key or a number
    link.click()
    ui.wait("() => !document.querySelector('#view-settings').hidden", "the settings view")
    assert page.evaluate("() => document.activeElement.id") == "f-ctx-size"
    # The refused turn left the history: the next request carries one message.
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
            if r.url.endswith("/v1/chat/completions") else None)
    page.click(".tab[data-view=chat]")
    send(ui, "Short one.")
    ui.wait("() => [...document.querySelectorAll('.msg-assistant')].pop().dataset.finish === 'length'",
            "the short answer")
    assert len(bodies[0]["messages"]) == 1
    # The refused request's 400 is a network error Chromium logs; nothing else may be.
    ui.assert_clean(allow=lambda t: "status of 400" in t)
    page.context.close()


# -- stream rendering, scripted: reasoning, reset, tool calls, hostile markdown, errors ---

def sse(*chunks: Any) -> str:
    out = []
    for c in chunks:
        out.append("data: " + (c if isinstance(c, str) else json.dumps(c)) + "\n\n")
    return "".join(out)


def delta(d: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d,
                                                             "finish_reason": None}], **extra}


HOSTILE = ("**bold** [site](https://example.com) [bad](javascript:alert(1)) "
           "<img src=x onerror=alert(1)> ![leak](https://evil.example/p.png) "
           "<style>body{display:none}</style><form action=/api/cancel><button>go</button></form>"
           "<svg onload=alert(1)></svg><video poster=https://evil.example/v.png></video>")


def test_reasoning_reset_tool_cards_sanitised_markdown_and_error_chunk(ui: Watched) -> None:
    page = ui.page
    body = sse(
        delta({"role": "assistant", "content": ""}),
        delta({"content": "<think>Weighing"}),
        delta({"content": " it up"}),
        delta({"content": "", "reasoning_content": "Weighing it up"}, bmoe={"reset": True}),
        delta({"content": HOSTILE}),
        delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
        {"error": {"message": "The model failed: out of memory while decoding.", "code": "failed"}},
        "[DONE]",
    )
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    send(ui, "scripted")
    ui.wait("() => [...document.querySelectorAll('.msg-assistant')].pop().dataset.finish === 'error'",
            "the scripted answer")
    box = page.locator(".msg-assistant").last
    reasoning = box.locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # folded
    assert box.locator(".reasoning-text").text_content() == "Weighing it up"
    md = box.locator(".md")
    assert "<think>" not in md.inner_text() and "Weighing" not in md.inner_text()
    assert md.locator("strong").inner_text() == "bold"
    assert md.locator("img, style, form, button, svg, video, script").count() == 0
    links = md.evaluate("el => [...el.querySelectorAll('a')].map(a => [a.getAttribute('href'), "
                        "a.target, a.rel, a.textContent])")
    assert ["https://example.com", "_blank", "noopener noreferrer", "site"] in links
    assert all(href.startswith("https://") and target == "_blank" and rel == "noopener noreferrer"
               for href, target, rel, _ in links)
    assert "<style>" in md.inner_text()  # raw HTML is shown as the text it is
    assert "javascript" not in md.evaluate("el => [...el.querySelectorAll('*')].flatMap("
                                           "e => [...e.attributes].map(a => a.value)).join(' ')")
    assert "leak" in md.inner_text()  # the remote image's alt text
    card = box.locator(".tool-card")
    assert card.locator(".tool-name").inner_text() == "get_weather"
    assert json.loads(card.locator(".tool-args").inner_text()) == {"city": "Paris"}
    assert box.locator(".msg-error-text").inner_text() == \
        "The model failed: out of memory while decoding."
    assert page.evaluate("() => document.body.offsetHeight > 0")  # the <style> did not apply
    ui.assert_clean()


# -- models, load progress, reconnecting ----------------------------------------------

def test_models_unload_load_and_the_load_clock(ui: Watched, ui_server: ServerProcess) -> None:
    page = ui.page
    page.click(".tab[data-view=models]")
    model_path = ui_server.info()["model"]["path"]
    assert page.input_value("#model-path") == model_path
    page.click("#model-unload")
    ui.wait("() => document.querySelector('#view-models').dataset.state === 'empty'", "unloaded")
    assert ui.text("#status .status-text") == "No model loaded"
    page.click("#model-load")
    ui.wait("() => document.querySelector('#view-models').dataset.state === 'ready'", "loaded")
    assert Path(model_path).name in ui.text("#model-state")
    # A path that is no model: the server's words, at the field.
    page.fill("#model-path", "/nonexistent/model.gguf")
    page.click("#model-load")
    ui.wait("() => document.querySelector('#view-models').dataset.state === 'error'", "a failed load")
    ui.wait("() => !document.querySelector('#model-message').hidden", "the reason")
    assert ui.text("#model-message") == ui_server.info()["error"]  # as the server words it
    assert ui.text("#status .status-text") == "Load failed"
    page.fill("#model-path", model_path)
    page.click("#model-load")
    ui.wait("() => document.querySelector('#view-models').dataset.state === 'ready'", "loaded again")

    # The load clock counts on from the server's load_elapsed_s (a load of the tiny model is
    # too quick to watch, so the page is handed the state event a slow load would publish).
    info = ui_server.info()
    slow = {**info, "state": "loading", "model": None, "load_elapsed_s": 12.4}
    page.evaluate("info => window.bmoeApp.onEvent('state', info)", slow)
    page.evaluate("ev => window.bmoeApp.onEvent('plan_progress', ev)",
                  {"step": "storage", "label": "Measuring storage", "index": 3, "count": 7})
    first = ui.text("#load-clock")
    assert first.startswith("12.") and "Measuring storage" in first, first
    time.sleep(1.1)
    later = ui.text("#load-clock")
    assert float(later.split(" ")[0]) >= 13.4, later
    page.evaluate("info => window.bmoeApp.onEvent('state', info)", info)
    assert page.locator(".load-progress").is_hidden()
    shot(ui, "models.png")
    ui.assert_clean()


def hold_event_streams(srv: ServerProcess, n: int) -> list[http.client.HTTPConnection]:
    """Open `n` event streams and keep them (the server admits 8)."""
    held = []
    host, port = srv.url.removeprefix("http://").split(":")
    deadline = time.monotonic() + 10
    while len(held) < n:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/api/events")
        resp = conn.getresponse()
        if resp.status == 200:
            held.append(conn)
            continue
        conn.close()  # a stream a closed page held is given back within a second
        assert time.monotonic() < deadline, f"event streams stay full ({resp.status})"
        time.sleep(0.2)
    return held


def test_event_stream_backs_off_when_full_or_lost_and_comes_back(
        browser: Any, ui_server: ServerProcess) -> None:
    held = hold_event_streams(ui_server, 8)
    try:
        w = open_page(browser, ui_server.url)
        w.wait("() => document.querySelector('#conn')?.dataset.state === 'retrying'",
               "the page to back off (503 streams_full)")
        assert "too many open event streams" in (w.page.get_attribute("#conn", "title") or "")
        retries_when_full = len([r for r in w.requests if r.url.endswith("/api/events")])
    finally:
        held.pop().close()
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "a place freed")
    assert retries_when_full >= 1
    for conn in held:
        conn.close()
    # Lost: the stream's requests fail at the network for a while, then work again.
    failures: list[int] = []

    def fail_a_few(route: Any) -> None:
        if len(failures) < 2:
            failures.append(1)
            route.abort()
        else:
            route.continue_()

    w.page.route("**/api/events", fail_a_few)
    w.page.evaluate("() => window.bmoeApp.events.controller.abort()")  # drop the live stream
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'retrying'", "a lost stream")
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "reconnected")
    assert len(failures) == 2
    # Chromium logs the refused (503) and aborted requests; nothing else may be.
    w.assert_clean(allow=lambda t: "status of 503" in t or "net::ERR_FAILED" in t)
    w.page.context.close()


# -- the key ----------------------------------------------------------------------------

def test_with_a_key_the_page_asks_for_it_and_then_works(browser: Any, tmp_path: Path,
                                                        tiny_moe: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("correct horse battery staple\n")
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096", "-n", "12",
                       "--api-key-file", str(key_file), wait_ready=False)
    try:
        srv.key = "correct horse battery staple"
        srv.wait_state("ready")
        w = open_page(browser, srv.url)
        page = w.page
        w.wait("() => document.querySelector('#key-dialog').open", "the key prompt")
        shot(w, "key-prompt.png")
        page.fill("#key-input", "wrong")
        page.click("#key-submit")
        w.wait("() => document.querySelector('#key-dialog').open && "
               "!document.querySelector('#key-error').hidden", "the refusal")
        page.fill("#key-input", "correct horse battery staple")
        page.click("#key-submit")
        w.wait("() => document.querySelector('#status')?.dataset.state === 'ready'", "ready")
        w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "events")
        assert not page.evaluate("() => document.querySelector('#key-dialog').open")
        assert page.evaluate("() => localStorage.getItem('bmoe.apiKey')") == srv.key
        before = tokens_seen(w)
        send(w, "Hello with a key.")
        w.wait("() => [...document.querySelectorAll('.msg-assistant')].pop()?.dataset.finish === 'length'",
               "the answer")
        w.wait(f"() => Number(document.querySelector('#metrics').dataset.tokens) > {before}",
               "token events through the keyed event stream")
        sent = [r for r in w.requests if "/api/" in r.url or "/v1/" in r.url]
        after_key = [r for r in sent if r.headers.get("authorization")]
        assert any(r.url.endswith("/api/events") for r in after_key)
        assert all(r.headers["authorization"] == f"Bearer {srv.key}" or
                   r.headers["authorization"] == "Bearer wrong" for r in after_key)
        # A reload uses the kept key without asking.
        page.reload()
        w.wait("() => document.querySelector('#status')?.dataset.state === 'ready'", "ready")
        assert not page.evaluate("() => document.querySelector('#key-dialog').open")
        # Chromium logs each refused request (401) as a network error; nothing else may be.
        w.assert_clean(allow=lambda t: "status of 401" in t)
        page.context.close()
    finally:
        srv.stop()
