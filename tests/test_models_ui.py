"""The Models screen in headless Chromium against a real server and the local hub: search,
files, inspect (the verdict's headline and colour), add, download with the progress bar
moving, cancel and resume, delete with a confirm. Screenshots go to docs/screenshots/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _hub import Hub
from _models_support import BIG, SLOW, models_server, stock_hub
from conftest import ServerProcess
from test_ui_browser import Watched, browser, open_page, shot  # noqa: F401 - the fixture

__all__ = ["browser"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("hub")
    h = Hub(folder)
    info = stock_hub(h, folder)
    yield h, info
    h.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path, hub: tuple[Hub, dict[str, Any]],  # noqa: F811
         tiny_moe: Path) -> Iterator[tuple[Watched, ServerProcess]]:
    h, _ = hub
    h.clear()
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-moe.gguf").write_bytes(tiny_moe.read_bytes())
    srv = models_server(tmp_path / "data", h, "--models-dir", str(models))
    w = open_page(browser, srv.url)
    w.page.evaluate("() => { location.hash = 'models'; }")
    w.wait("() => document.querySelector('#conn')?.dataset.state === 'live'", "the event stream")
    w.wait("() => document.querySelectorAll('#catalog .lib-row').length > 0", "the catalog")
    yield w, srv
    w.page.context.close()
    srv.stop()


def row_of(w: Watched, name: str) -> str:
    return f'#hf-results .hf-model[data-name="{name}"]'


def test_search_inspect_add_download_cancel_resume_delete(
        page: tuple[Watched, ServerProcess], hub: tuple[Hub, dict[str, Any]],
        tmp_path: Path) -> None:
    w, srv = page
    h, info = hub
    p = w.page
    assert "tiny-moe.gguf" in w.text("#local-models")
    shot(w, "models-screen.png")

    # search (text that is not a repository) -> repositories -> files
    p.fill("#hf-query", "slow")
    p.click("#hf-find")
    w.wait(f"() => !!document.querySelector('.hf-repo[data-repo=\"{SLOW}\"]')", "search results")
    p.click(f'.hf-repo[data-repo="{SLOW}"] .hf-open')
    w.wait("() => !!document.querySelector('.hf-model[data-name=\"slow-moe-F32.gguf\"]')", "files")

    # the verdict of a model larger than this machine: the headline, coloured by its code
    p.fill("#hf-query", BIG)
    p.click("#hf-find")
    big = "big-moe-120B-A5B-Q4_0.gguf"
    w.wait(f"() => !!document.querySelector('{row_of(w, big)}')", "the big model's files")
    p.click(f"{row_of(w, big)} .hf-inspect")
    w.wait("() => !!document.querySelector('#verdict-headline')", "the verdict")
    # (a models folder with less free than the 62.9 GB it needs says so first)
    st = os.statvfs(tmp_path / "models")
    headline = w.text("#verdict-headline")
    if info["big_size"] > st.f_bavail * st.f_frsize:
        assert headline.startswith("Not enough disk: it needs "), headline
        assert p.evaluate(
            "() => document.querySelector('#hf-verdict').classList.contains('fit-no_disk')")
    else:
        assert headline == "Fits here: the experts stream from flash"
        assert p.evaluate(
            "() => document.querySelector('#hf-verdict').classList.contains('fit-fits')")
    shot(w, "models-inspect.png")

    # add the slow one and download it: the bar moves
    size = info["slow"].stat().st_size
    h.fault(SLOW, "slow-moe-F32.gguf", rate=size // 10)
    p.fill("#hf-query", SLOW)
    p.click("#hf-find")
    w.wait(f"() => !!document.querySelector('{row_of(w, 'slow-moe-F32.gguf')}')", "files")
    p.click(f"{row_of(w, 'slow-moe-F32.gguf')} .hf-inspect")
    w.wait("() => !!document.querySelector('#hf-add')", "the add button")
    p.click("#hf-add")
    eid = f"hf:{SLOW}/slow-moe-F32.gguf"
    sel = f'#catalog .lib-row[data-id="{eid}"]'
    first = float(w.wait(f"() => {{ const b = document.querySelector('{sel} .dl-bar'); "
                         "return b && b.value > 0 ? String(b.value) : ''; }", "the bar to start"))
    later = float(w.wait(f"() => {{ const b = document.querySelector('{sel} .dl-bar'); "
                         f"return b && b.value > {first} ? String(b.value) : ''; }}", "the bar to move"))
    assert later > first
    shot(w, "models-downloading.png")

    # cancel: the part is kept, Resume names what is there
    p.click(f"{sel} .act-cancel")
    w.wait(f"() => document.querySelector('{sel} .act-download')?.textContent.startsWith('Resume')",
           "Resume")
    assert "Delete partial download" in w.text(sel)
    h.fault(SLOW, "slow-moe-F32.gguf", rate=size * 4)
    p.click(f"{sel} .act-download")
    w.wait(f"() => document.querySelector('{sel}')?.dataset.status === 'on_disk'", "on disk", 90)
    w.wait("() => document.querySelector('#local-models').textContent.includes('slow-moe-F32.gguf')",
           "the new model listed")

    # delete with a confirm
    local = '#local-models .lib-row[data-key="slow-moe-F32.gguf"]'
    p.click(f"{local} .lib-delete")
    assert "for good" in w.text(local)
    p.click(f"{local} .lib-confirm-delete")
    w.wait("() => !document.querySelector('#local-models .lib-row[data-key=\"slow-moe-F32.gguf\"]')",
           "the model gone")
    assert not (Path(srv.request("GET", "/api/models")[2]["models_dir"]) / "slow-moe-F32.gguf").exists()
    # the one refusal the page asked for: "slow" is not a repository id (then it searched)
    assert [e for e in w.errors() if "400" in e] == [
        "Failed to load resource: the server responded with a status of 400 ()"]
    w.assert_clean(allow=lambda text: "status of 400" in text)


def test_the_catalog_rows_say_their_chat_format(page: tuple[Watched, ServerProcess]) -> None:
    w, _ = page
    from bmoe.models.catalog import load_shipped
    wanted = {e.id: e.chat_format_name for e in load_shipped()}
    rows = w.page.evaluate("() => [...document.querySelectorAll('#catalog .lib-row')].map("
                           "r => [r.dataset.id, r.querySelector('.lib-format')?.textContent])")
    shown = {rid: text for rid, text in rows if rid in wanted}
    assert shown, rows
    for rid, text in shown.items():
        assert text and wanted[rid] in text, (rid, text)
