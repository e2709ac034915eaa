"""Attaching images in the web UI, in headless Chromium: pick or paste, a thumbnail in
the tray and in the message, the image_url part on the wire, refusals with reasons."""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Iterator

import pytest
from PIL import Image

from bmoe.modelmaker.projector import make_vision_pair
from conftest import ServerProcess, start_server
from test_ui_browser import LAST_FINISH, Watched, browser, open_ready, shot  # noqa: F401

_ = browser  # the fixture, imported so pytest finds it here


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (64, 40)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, "PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def vision_ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model, _ = make_vision_pair(tmp_path_factory.mktemp("ui-vision-models"))
    srv = start_server(tmp_path_factory.mktemp("ui-vision-data"), "-m", str(model), "-c", "2048",
                       "-n", "4")
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


@pytest.fixture
def vui(browser: Any, vision_ui_server: ServerProcess) -> Iterator[Watched]:  # noqa: F811
    w = open_ready(browser, vision_ui_server)
    w.wait("() => document.querySelector('#attach')?.getAttribute('aria-disabled') === 'false'",
           "the attach button to know the model reads images")
    yield w
    w.page.context.close()


def attach(w: Watched, *files: tuple[str, str, bytes]) -> None:
    w.page.set_input_files("#attach-file", files=[
        {"name": n, "mimeType": t, "buffer": b} for n, t, b in files])


def test_attach_shows_a_thumbnail_and_sends_an_image_part(vui: Watched) -> None:
    attach(vui, ("red.png", "image/png", png_bytes((220, 30, 30))))
    vui.wait("() => document.querySelectorAll('#attach-tray img.thumb').length === 1",
             "the thumbnail in the tray")
    vui.page.fill("#prompt", "What colour is this?")
    vui.page.click("#send")
    vui.wait(LAST_FINISH, "the answer")
    assert vui.page.evaluate("() => document.querySelectorAll('#attach-tray img').length") == 0
    src = vui.page.evaluate(
        "() => document.querySelector('.msg-user .msg-images img.thumb')?.getAttribute('src')")
    assert src and src.startswith("data:image/png;base64,")
    body = json.loads(vui.posts("/v1/chat/completions")[-1].post_data)
    content = body["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What colour is this?"}
    assert content[1]["type"] == "image_url" and content[1]["image_url"]["url"] == src
    finish = vui.page.evaluate(LAST_FINISH)
    assert finish in ("length", "stop"), vui.text(".msg-assistant:last-child")
    footer = vui.text(".msg-assistant:last-of-type .msg-footer")
    assert "prompt" in footer
    shot(vui, "chat-image.png")
    vui.assert_clean()


def test_a_pasted_image_is_attached(vui: Watched) -> None:
    data = base64.b64encode(png_bytes((30, 30, 220))).decode()
    vui.page.evaluate("""(b64) => {
      const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
      const dt = new DataTransfer();
      dt.items.add(new File([bytes], 'pasted.png', {type: 'image/png'}));
      document.querySelector('#prompt').dispatchEvent(
        new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true}));
    }""", data)
    vui.wait("() => document.querySelectorAll('#attach-tray img.thumb').length === 1",
             "the pasted image's thumbnail")
    vui.page.click(".thumb-remove")
    vui.wait("() => document.querySelector('#attach-tray').hidden", "the tray to empty")
    vui.assert_clean()


def test_refusals_are_shown_with_their_reasons(vui: Watched) -> None:
    attach(vui, ("notes.txt", "text/plain", b"hello"))
    vui.wait("() => !document.querySelector('#attach-note').hidden", "the refusal")
    assert "notes.txt is not a PNG, JPEG, GIF or WebP image" in vui.text("#attach-note")
    img = png_bytes((10, 200, 10), (8, 8))
    attach(vui, *[(f"i{i}.png", "image/png", img) for i in range(9)])
    vui.wait("() => document.querySelectorAll('#attach-tray img.thumb').length === 8",
             "eight thumbnails")
    assert "at most 8 images" in vui.text("#attach-note")
    broken = png_bytes((1, 2, 3))[:30]
    vui.page.click("#new-chat")
    attach(vui, ("broken.png", "image/png", broken))
    vui.wait("() => document.querySelector('#attach-note').textContent.includes('broken.png')",
             "the broken image's refusal")
    assert "could not be read" in vui.text("#attach-note")
    vui.assert_clean(allow=lambda text: "Failed to load resource" in text or "broken" in text)


def test_a_model_without_a_projector_refuses_to_attach(browser: Any,  # noqa: F811
                                                       server: ServerProcess) -> None:
    w = open_ready(browser, server)
    try:
        assert w.page.evaluate("() => document.querySelector('#attach').getAttribute("
                               "'aria-disabled')") == "true"
        w.page.click("#attach", force=True)   # aria-disabled: it still explains itself
        w.wait("() => !document.querySelector('#attach-note').hidden", "the refusal")
        assert "reads no images" in w.text("#attach-note")
        w.assert_clean()
    finally:
        w.page.context.close()

