"""Images as a request carries them: data URLs checked and decoded in Python.

Theory of operation
-------------------
Crash safety comes first: libmtmd's own decoder (stb_image) never sees a client's
bytes. An image travels as a data URL; `read_data_url` (cheap, no decoding, run by the
protocol decoders) refuses anything that is not one, decodes the base64 strictly, tells
the format by its magic bytes (PNG, JPEG, GIF, WebP; what the URL declares is only
checked against it), and reads the width and height from the format's own header with
`struct`, so an image declaring more than `MAX_PIXELS` is refused before any decoder
runs. `decode_rgb` (engine thread) then decodes with Pillow, checks that what it read is
the format and the size the header declared, takes the first frame of an animation,
composites transparency on white and scales down past `BITMAP_MAX_PIXELS` (larger than
any projector's own cap), and hands libmtmd plain RGB bytes of a known size.

Every refusal is an `ImageRefused` with a sentence for a person; no exception's text
is ever shown.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import secrets
import struct
from dataclasses import dataclass
from typing import Any

MAX_IMAGES_PER_MESSAGE = 8
MAX_PIXELS = 64_000_000          # declared width x height refused above this (64 MP)
BITMAP_MAX_PIXELS = 16_777_216   # what reaches libmtmd is scaled down to this (16 MP)
FORMATS = ("png", "jpeg", "gif", "webp")
_DECLARED = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg",
             "image/gif": "gif", "image/webp": "webp"}
_PILLOW_FORMAT = {"png": "PNG", "jpeg": "JPEG", "gif": "GIF", "webp": "WEBP"}
_WHITESPACE = b" \t\r\n\f\v"     # what a data URL may wrap its base64 with


class ImageRefused(ValueError):
    """An image the server will not read; the message is a sentence for a person."""


@dataclass(frozen=True)
class ImageInput:
    """One checked image: its bytes, format and declared size, and their hash."""

    data: bytes
    format: str
    width: int
    height: int
    digest: bytes          # sha256 of the bytes: the image's identity in the KV

    @property
    def pixels(self) -> int:
        return self.width * self.height


class ImageSet:
    """The images of one request in order; each leaves a marker at its place in the text.

    The marker carries a random nonce, so no text a client writes can stand for an
    image; the engine splits the rendered prompt at the markers. `add` makes the cheap
    checks (a data URL, base64, a type that is an image, the count per message) where
    the decoder reads the body; `resolve` decodes the base64 and reads the headers, which
    takes a moment for a large image, so the server runs it in a worker thread.
    """

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self._raw: list[tuple[str, str]] = []        # (data URL, where)
        self._items: list[ImageInput] = []
        self._per_message: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def items(self) -> list[ImageInput]:
        self.resolve()
        return self._items

    def add(self, url: object, where: str, message: str) -> str:
        """Check the data URL at `where` (in `message`) and return its marker."""
        n = self._per_message.get(message, 0) + 1
        if n > MAX_IMAGES_PER_MESSAGE:
            raise ImageRefused(f"A message may carry at most {MAX_IMAGES_PER_MESSAGE} images; "
                               f"`{message}` has more.")
        self._per_message[message] = n
        data_url_head(url, where)          # a str from here on
        self._raw.append((str(url), where))
        return self.marker(len(self._raw) - 1)

    def resolve(self) -> None:
        """Decode and check every image not read yet (`ImageRefused` on the first fault)."""
        while len(self._items) < len(self._raw):
            url, where = self._raw[len(self._items)]
            self._items.append(read_data_url(url, where))

    def marker(self, i: int) -> str:
        return f"<bmoe-image-{self.nonce}-{i}>"

    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"<bmoe-image-{self.nonce}-(\d+)>")


def data_url_head(url: object, where: str) -> tuple[str, str]:
    """The declared media type and the base64 payload of a data URL (no decoding)."""
    if not isinstance(url, str):
        raise ImageRefused(f"`{where}` must be a string: a data URL of the image.")
    if not url.startswith("data:"):
        raise ImageRefused(f"`{where}` must be an inline data URL (data:image/png;base64,...): "
                           "the server does not fetch URLs.")
    head, comma, payload = url.partition(",")
    if not comma:
        raise ImageRefused(f"`{where}` is not a data URL: it has no comma before the data.")
    params = head[5:].split(";")
    declared = params[0].strip().lower()
    if "base64" not in [p.strip().lower() for p in params[1:]]:
        raise ImageRefused(f"`{where}` must carry its image as base64 (data:image/png;base64,...).")
    if declared and declared not in _DECLARED:
        raise ImageRefused(f"`{where}` declares {declared[:60]!r}, which is not an image this "
                           f"server reads ({', '.join(FORMATS)}).")
    return declared, payload


def read_data_url(url: object, where: str) -> ImageInput:
    """The image a data URL carries, its header read and checked (never decoded)."""
    declared, payload = data_url_head(url, where)
    data = _base64(payload, where)
    fmt = sniff(data)
    if fmt is None:
        raise ImageRefused(f"`{where}` is not a PNG, JPEG, GIF or WebP image (its first bytes "
                           "are none of theirs).")
    if declared and _DECLARED[declared] != fmt:
        raise ImageRefused(f"`{where}` declares {declared} but its bytes are {fmt.upper()}.")
    width, height = header_size(data, fmt, where)
    if width < 1 or height < 1:
        raise ImageRefused(f"`{where}`: the image's header declares an empty image.")
    if width * height > MAX_PIXELS:
        raise ImageRefused(f"`{where}`: the image declares {width} x {height} pixels "
                           f"({width * height / 1e6:.1f} MP), more than the "
                           f"{MAX_PIXELS // 1_000_000} MP an image may have.")
    return ImageInput(data, fmt, width, height, hashlib.sha256(data).digest())


def _base64(payload: str, where: str) -> bytes:
    try:
        raw = payload.encode("ascii").translate(None, _WHITESPACE)
        return base64.b64decode(raw, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise ImageRefused(f"`{where}`: the image's base64 data is not valid base64.") from None


def sniff(data: bytes) -> str | None:
    """The format the magic bytes name, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def header_size(data: bytes, fmt: str, where: str) -> tuple[int, int]:
    """Width and height as the format's header declares them (no decoding)."""
    try:
        if fmt == "png":
            return _png_size(data)
        if fmt == "gif":
            return struct.unpack_from("<HH", data, 6)
        if fmt == "webp":
            return _webp_size(data)
        return _jpeg_size(data)
    except (struct.error, IndexError, ValueError):
        raise ImageRefused(f"`{where}`: the {fmt.upper()} image's header is truncated or "
                           "damaged.") from None


def _png_size(data: bytes) -> tuple[int, int]:
    if data[12:16] != b"IHDR":
        raise ValueError("no IHDR")
    w, h = struct.unpack_from(">II", data, 16)
    return int(w), int(h)


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        if len(data) < 30:
            raise ValueError("short")
        return w, h
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            raise ValueError("bad VP8L")
        bits = int.from_bytes(data[21:25], "little")
        if len(data) < 25:
            raise ValueError("short")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise ValueError("bad VP8")
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    raise ValueError("unknown WebP chunk")


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i = 2
    while True:
        while data[i] != 0xFF:        # IndexError past the end: truncated
            i += 1
        while data[i] == 0xFF:
            i += 1
        marker = data[i]
        i += 1
        if marker in (0x01, *range(0xD0, 0xD8)):  # no length
            continue
        if marker == 0xD9:
            raise ValueError("no frame header")
        (length,) = struct.unpack_from(">H", data, i)
        if marker in _SOF:
            h, w = struct.unpack_from(">HH", data, i + 3)
            return int(w), int(h)
        if length < 2:
            raise ValueError("bad segment")
        i += length


@dataclass(frozen=True)
class Bitmap:
    """RGB bytes, row by row, of a known size: what libmtmd is given."""

    width: int
    height: int
    rgb: bytes


def decode_rgb(img: ImageInput, label: str) -> Bitmap:
    """Decode with Pillow and check it against the header; `ImageRefused` on any fault."""
    from PIL import Image, ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    try:
        with Image.open(io.BytesIO(img.data), formats=[_PILLOW_FORMAT[img.format]]) as im:
            if im.size != (img.width, img.height):
                raise ImageRefused(f"{label}: the {img.format.upper()} image decodes to a "
                                   "size its header does not declare.")
            im.seek(0)
            im.load()
            rgb = _to_rgb(im)
    except ImageRefused:
        raise
    except Exception:  # noqa: BLE001 - Pillow's errors are many; the client gets a sentence
        raise ImageRefused(f"{label}: the {img.format.upper()} image could not be decoded "
                           "(it is truncated or damaged).") from None
    if rgb.width * rgb.height > BITMAP_MAX_PIXELS:
        scale = (BITMAP_MAX_PIXELS / (rgb.width * rgb.height)) ** 0.5
        size = (max(1, int(rgb.width * scale)), max(1, int(rgb.height * scale)))
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    return Bitmap(rgb.width, rgb.height, rgb.tobytes())


def _to_rgb(im: Any) -> Any:
    from PIL import Image

    assert isinstance(im, Image.Image)
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        back = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(back, rgba).convert("RGB")
    return im.convert("RGB")
