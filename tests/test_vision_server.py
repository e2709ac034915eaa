"""Images against a real bmoe-server with the model maker's vision pair: all three
protocols, token counts, KV reuse through an image, the limits, what the server says."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from bmoe.modelmaker.projector import ProjectorSpec, make_vision_pair

from conftest import ServerProcess, start_server

IMAGE_TOKENS = ProjectorSpec().image_tokens      # 16: a fixed-size projector


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 32)) -> str:
    b = io.BytesIO()
    Image.new("RGB", size, color).save(b, "PNG")
    return "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()


RED, BLUE, GREEN = png((220, 20, 20)), png((20, 20, 220)), png((20, 200, 20))


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("vision-models")
    model, _ = make_vision_pair(folder)
    srv = start_server(tmp_path_factory.mktemp("vision-data"), "-m", str(model), "-c", "2048")
    assert srv.info()["state"] == "ready", srv.info()
    yield srv
    srv.stop()


def chat(srv: ServerProcess, content: Any, **extra: Any) -> tuple[int, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    status, _, out = srv.request("POST", "/v1/chat/completions", body)
    return status, out


def parts(*items: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": x} if not x.startswith("data:") else
            {"type": "image_url", "image_url": {"url": x}} for x in items]


def test_the_server_says_it_reads_images(vision_server: ServerProcess) -> None:
    model = vision_server.info()["model"]
    assert model["vision"] is True and model["projector"] == "mmproj-bmoe-vision-test.gguf"
    _, _, models = vision_server.request("GET", "/v1/models")
    assert models["data"][0]["modalities"] == ["text", "image"]
    for path in ("/v1/models", "/models"):           # llama-server's list says it too
        listed = vision_server.request("GET", path)[2]["models"]
        assert listed[0]["capabilities"] == ["completion", "multimodal"], listed


def test_text_only_server_refuses_images_with_no_vision(server: ServerProcess) -> None:
    assert server.info()["model"]["vision"] is False
    _, _, models = server.request("GET", "/v1/models")
    assert models["data"][0]["modalities"] == ["text"]
    assert models["models"][0]["capabilities"] == ["completion"]
    status, out = chat(server, parts("look", RED))
    assert status == 400 and out["code"] == "no_vision"


def test_chat_image_costs_its_tokens_and_is_reused_when_resent(
        vision_server: ServerProcess) -> None:
    status, one = chat(vision_server, parts("Describe ", RED, " please."))
    assert status == 200, one
    _, two = chat(vision_server, parts("Describe ", RED, BLUE, " please."))
    grow = two["usage"]["prompt_tokens"] - one["usage"]["prompt_tokens"]
    # an image costs its 16 embeddings plus the projector's own begin/end text
    assert grow >= IMAGE_TOKENS
    assert one["bmoe"]["summary"]["image_tokens"] == IMAGE_TOKENS
    assert two["bmoe"]["summary"]["image_tokens"] == 2 * IMAGE_TOKENS
    # the same two images again: nothing encoded, the KV covers all but the last token
    _, again = chat(vision_server, parts("Describe ", RED, BLUE, " please."))
    assert again["bmoe"]["summary"]["images_encoded"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        again["usage"]["prompt_tokens"] - 1
    # a different second image: reuse ends where it starts, one image is encoded
    _, other = chat(vision_server, parts("Describe ", RED, GREEN, " please."))
    cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert other["bmoe"]["summary"]["images_encoded"] == 1
    # through the first image (same bytes), and no further than the second's start
    assert IMAGE_TOKENS < cached <= two["usage"]["prompt_tokens"] - IMAGE_TOKENS - 1
    assert cached > one["usage"]["prompt_tokens"] - len(" please.") - 8


def test_an_image_keeps_its_place_between_text_parts(vision_server: ServerProcess) -> None:
    _, first = chat(vision_server, parts("A", RED, "B"))
    _, moved = chat(vision_server, parts("AB", RED))
    # same text and image, another order: the prompt is not the same, so the reuse ends
    # before the image (the KV held "A" + image, the new prompt has "AB" there)
    assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] < \
        first["usage"]["prompt_tokens"] - IMAGE_TOKENS
    assert moved["bmoe"]["summary"]["images_encoded"] == 1


def test_anthropic_image_block(vision_server: ServerProcess) -> None:
    data = RED.split(",", 1)[1]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
    ]}]}
    status, _, out = vision_server.request("POST", "/v1/messages", body)
    assert status == 200, out
    status, _, text_only = vision_server.request("POST", "/v1/messages", {
        **body, "messages": [{"role": "user", "content": "What is this?"}]})
    assert out["usage"]["input_tokens"] + out["usage"].get("cache_read_input_tokens", 0) >= \
        text_only["usage"]["input_tokens"] + IMAGE_TOKENS
    _, _, counted = vision_server.request("POST", "/v1/messages/count_tokens", body)
    _, _, counted_text = vision_server.request("POST", "/v1/messages/count_tokens", {
        **body, "messages": [{"role": "user", "content": "What is this?"}]})
    assert counted["input_tokens"] >= counted_text["input_tokens"] + IMAGE_TOKENS - 2
    url_source = {**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}
    status, _, err = vision_server.request("POST", "/v1/messages", url_source)
    assert status == 400 and err["type"] == "error"


def test_responses_input_image(vision_server: ServerProcess) -> None:
    body = {"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": BLUE}]}]}
    status, _, out = vision_server.request("POST", "/v1/responses", body)
    assert status == 200, out
    status, _, text_only = vision_server.request("POST", "/v1/responses", {
        **body, "input": "What is this?"})
    assert out["usage"]["input_tokens"] >= text_only["usage"]["input_tokens"] + IMAGE_TOKENS


def _truncated_png() -> str:
    b = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("RGB").save(b, "PNG")
    raw = b.getvalue()
    return "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()


def _huge_png_header() -> str:
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 8100, 8100, 8, 2, 0, 0, 0)
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + \
        struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return "data:image/png;base64," + base64.b64encode(head + b"\0" * 32).decode()


@pytest.mark.parametrize("content,words", [
    (parts("nine", *[RED] * 9), "at most 8 images"),
    (parts("huge", _huge_png_header()), "65.6 MP"),
    (parts("fetch", "https://example.com/cat.png"), "does not fetch"),
    (parts("text", "data:text/plain;base64,aGVsbG8="), "not an image"),
    (parts("cut", _truncated_png()), "could not be decoded"),
])
def test_limits_are_400_with_reasons_and_the_server_lives(
        vision_server: ServerProcess, content: Any, words: str) -> None:
    if content[-1].get("type") == "text":      # the URL part is typed as text above
        content[-1] = {"type": "image_url", "image_url": {"url": content[-1]["text"]}}
    status, out = chat(vision_server, content)
    assert status == 400, out
    assert out["code"] == "invalid_request" and words in out["error"]
    status, ok = chat(vision_server, "still there?")
    assert status == 200, ok


def test_an_image_in_a_streamed_answer(vision_server: ServerProcess) -> None:
    status, _, body = vision_server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": parts("stream", GREEN)}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert b'"prompt_tokens"' in body and b"[DONE]" in body


def test_concurrent_image_turns_each_answer(vision_server: ServerProcess) -> None:
    results: list[int] = []

    def one(color: str) -> None:
        results.append(chat(vision_server, parts("x", color))[0])

    threads = [threading.Thread(target=one, args=(c,)) for c in (RED, BLUE, GREEN)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200, 200]


def test_unloading_and_reloading_keeps_the_pair(vision_server: ServerProcess,
                                                tmp_path: Path) -> None:
    model = vision_server.info()["model"]["path"]
    status, _, _ = vision_server.request("POST", "/api/session/load",
                                         {"model": model})
    assert status in (200, 202)
    info = vision_server.wait_state("ready", "error")
    assert info["model"]["vision"] is True, info


def test_the_mmproj_parameter_names_a_projector_the_folder_would_not_pair(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("mmproj-flag")
    model, proj = make_vision_pair(folder, name="bmoe-vision-test",
                                   projector_name="another-model")
    srv = start_server(tmp_path_factory.mktemp("mmproj-data"), "-m", str(model), "-c", "1024")
    try:
        assert srv.info()["model"]["vision"] is False        # another model's name: never
    finally:
        srv.stop()
    srv = start_server(tmp_path_factory.mktemp("mmproj-data2"), "-m", str(model), "-c", "1024",
                       "--mmproj", str(proj))
    try:
        info = srv.info()["model"]
        assert info["vision"] is True and info["projector"] == proj.name
        status, out = chat(srv, parts("look", RED))
        assert status == 200, out
    finally:
        srv.stop()
