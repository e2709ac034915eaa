"""Images as requests carry them: data URLs, headers read before decoding, Pillow's
decode checked against the header (no model needed)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from bmoe.engine import images as im
from bmoe.engine.images import ImageRefused, ImageSet, decode_rgb, read_data_url


def encoded(fmt: str, size: tuple[int, int] = (40, 30), mode: str = "RGB") -> bytes:
    b = io.BytesIO()
    Image.new(mode, size, (200, 30, 60) if mode == "RGB" else None).save(b, fmt.upper())
    return b.getvalue()


def url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    crc = zlib.crc32(b"IHDR" + ihdr)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", crc)


@pytest.mark.parametrize("fmt,media", [("png", "image/png"), ("jpeg", "image/jpeg"),
                                       ("gif", "image/gif"), ("webp", "image/webp")])
def test_each_format_is_read_from_its_header_then_decoded(fmt: str, media: str) -> None:
    data = encoded(fmt, (37, 23))
    img = read_data_url(url(data, media), "x")
    assert (img.format, img.width, img.height) == (fmt, 37, 23)
    bmp = decode_rgb(img, "image 1")
    assert (bmp.width, bmp.height, len(bmp.rgb)) == (37, 23, 37 * 23 * 3)


def test_a_data_url_without_a_media_type_is_told_by_its_bytes() -> None:
    assert read_data_url("data:;base64," + base64.b64encode(encoded("png")).decode(),
                         "x").format == "png"


@pytest.mark.parametrize("value,words", [
    ("https://example.com/cat.png", "does not fetch"),
    ("http://127.0.0.1:8080/api/info", "does not fetch"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello world").decode(), "not a PNG"),
    (42, "must be a string"),
])
def test_what_is_not_an_inline_image_is_refused_with_a_reason(value: object, words: str) -> None:
    with pytest.raises(ImageRefused, match=words):
        read_data_url(value, "messages[0].content[1].image_url.url")


def test_a_declared_type_must_be_what_the_bytes_are() -> None:
    with pytest.raises(ImageRefused, match="declares image/jpeg but its bytes are PNG"):
        read_data_url(url(encoded("png"), "image/jpeg"), "x")


def test_more_than_64_megapixels_is_refused_from_the_header_before_decoding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*_a: object, **_k: object) -> None:
        raise AssertionError("decoded")

    monkeypatch.setattr(Image, "open", no_decoding)
    data = png_header(8100, 8100) + b"\x00" * 64       # 65.6 MP, no pixel data at all
    with pytest.raises(ImageRefused, match=r"8100 x 8100 pixels \(65.6 MP\)"):
        read_data_url(url(data), "x")
    assert read_data_url(url(png_header(8000, 8000)), "x").pixels == 64_000_000


@pytest.mark.parametrize("fmt", ["png", "jpeg", "gif", "webp"])
def test_a_truncated_image_passes_the_header_and_is_refused_by_the_decoder(fmt: str) -> None:
    data = encoded(fmt, (64, 48))
    cut = data[: max(40, len(data) // 2)]
    img = read_data_url(url(cut, f"image/{fmt}"), "x")
    with pytest.raises(ImageRefused, match="could not be decoded"):
        decode_rgb(img, "image 1")


def test_a_header_cut_short_is_refused_before_the_decoder() -> None:
    for fmt in ("png", "jpeg", "gif", "webp"):
        head = encoded(fmt)[:9]
        with pytest.raises(ImageRefused, match="truncated or damaged|not a PNG"):
            read_data_url(url(head, f"image/{fmt}"), "x")


def test_an_image_whose_pixels_disagree_with_its_header_is_refused() -> None:
    data = bytearray(encoded("png", (40, 30)))
    data[16:24] = struct.pack(">II", 41, 30)           # IHDR says 41 wide, CRC now wrong
    with pytest.raises(ImageRefused):
        decode_rgb(read_data_url(url(bytes(data)), "x"), "image 1")


def test_transparency_is_composited_on_white_and_large_images_scaled_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = io.BytesIO()
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(b, "PNG")
    bmp = decode_rgb(read_data_url(url(b.getvalue()), "x"), "image 1")
    assert bmp.rgb[:3] == b"\xff\xff\xff"
    monkeypatch.setattr(im, "BITMAP_MAX_PIXELS", 100)
    bmp = decode_rgb(read_data_url(url(encoded("png", (40, 30))), "x"), "image 1")
    assert bmp.width * bmp.height <= 100 and len(bmp.rgb) == bmp.width * bmp.height * 3


def test_at_most_eight_images_per_message_and_markers_keep_their_places() -> None:
    images = ImageSet()
    one = url(encoded("png"))
    marks = [images.add(one, f"messages[0].content[{i}]", "messages[0]") for i in range(8)]
    assert len(set(marks)) == 8 and images.pattern().fullmatch(marks[3]).group(1) == "3"
    images.add(one, "messages[2].content[0]", "messages[2]")      # another message
    with pytest.raises(ImageRefused, match="at most 8 images"):
        images.add(one, "messages[0].content[8]", "messages[0]")
    assert ImageSet().nonce != images.nonce


def test_add_makes_the_cheap_checks_and_resolve_reads_the_bytes() -> None:
    images = ImageSet()
    with pytest.raises(ImageRefused, match="does not fetch"):
        images.add("https://example.com/a.png", "u", "m0")
    images.add(url(png_header(8100, 8100)), "big", "m0")       # not decoded yet
    assert len(images) == 1
    with pytest.raises(ImageRefused, match="65.6 MP"):
        images.resolve()
    ok = ImageSet()
    ok.add(url(encoded("gif"), "image/gif"), "g", "m0")
    ok.resolve()
    assert ok.items[0].format == "gif"
