"""Hostile image bytes through the whole image path, in a child process (Hypothesis).

Every byte that reaches libmtmd has been checked in Python first; these tests throw
damaged, truncated, forged and random images at the real path (data URL, header,
Pillow, libmtmd's tokenizer and encoder, the image prefill). A crash kills the child
and fails the test, never the runner; a refusal must be a sentence, not an exception's
text.
"""

from __future__ import annotations

import base64
import io
import struct
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from bmoe.modelmaker.projector import make_vision_pair

from _vision_child import VisionChild

FORMATS = ("png", "jpeg", "gif", "webp")


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VisionChild]:
    model, _ = make_vision_pair(tmp_path_factory.mktemp("fuzz-pair"))
    c = VisionChild(model)
    yield c
    c.close()


def encoded(fmt: str, w: int, h: int, mode: str, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(pixels, "RGB").convert(mode)
    b = io.BytesIO()
    im.save(b, fmt.upper())
    return b.getvalue()


@st.composite
def damaged_images(draw: st.DrawFn) -> str:
    fmt = draw(st.sampled_from(FORMATS))
    mode = draw(st.sampled_from(("RGB", "L", "RGBA", "P") if fmt != "jpeg" else ("RGB", "L")))
    data = bytearray(encoded(fmt, draw(st.integers(1, 300)), draw(st.integers(1, 300)), mode,
                         draw(st.integers(0, 1000))))
    how = draw(st.sampled_from(("truncate", "flip", "forge_size", "random_tail", "intact")))
    if how == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "flip":
        for _ in range(draw(st.integers(1, 16))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif how == "forge_size":
        w, h = draw(st.integers(0, 70000)), draw(st.integers(0, 70000))
        if fmt == "png" and len(data) >= 24:
            data[16:24] = struct.pack(">II", w, h)
        elif fmt == "gif" and len(data) >= 10:
            data[6:10] = struct.pack("<HH", w & 0xFFFF, h & 0xFFFF)
        else:
            i = draw(st.integers(0, max(0, min(len(data), 64) - 4)))
            data[i:i + 4] = struct.pack(">HH", w & 0xFFFF, h & 0xFFFF)
    elif how == "random_tail":
        keep = draw(st.integers(0, min(len(data), 40)))
        data = data[:keep] + bytearray(draw(st.binary(min_size=0, max_size=2000)))
    media = draw(st.sampled_from((f"image/{fmt}", "", "image/png")))
    return f"data:{media};base64," + base64.b64encode(bytes(data)).decode()


def check(child: VisionChild, url: str) -> None:
    r = child.read(url)
    assert not r.crashed, f"the image path crashed (exit {r.returncode}) on {url[:120]}"
    assert not r.timed_out
    if not r.ok:
        assert r.refused[:1] == "`" or r.refused[:1].isupper(), r.refused
        assert "Traceback" not in r.refused and "Error" not in r.refused, r.refused


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(url=damaged_images())
def test_damaged_images_are_read_or_refused_never_crash(child: VisionChild, url: str) -> None:
    check(child, url)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(magic=st.sampled_from((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a",
                              b"RIFF\x00\x00\x00\x00WEBPVP8 ")),
       tail=st.binary(max_size=4000))
def test_random_bytes_behind_a_real_magic_never_crash(child: VisionChild, magic: bytes,
                                                      tail: bytes) -> None:
    check(child, "data:;base64," + base64.b64encode(magic + tail).decode())


def test_odd_but_valid_images_are_read(child: VisionChild) -> None:
    for fmt, size in (("png", (1, 1)), ("png", (2000, 3)), ("gif", (3, 900)),
                      ("webp", (1, 1)), ("jpeg", (640, 480))):
        r = child.read(f"data:image/{fmt};base64," + base64.b64encode(
            encoded(fmt, *size, "RGB", 1)).decode())
        assert r.ok, (fmt, size, r)

