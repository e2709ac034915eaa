"""The release feed: one JSON document, signed with Ed25519, read only when a person asks.

What the feed URL answers is an envelope::

    {"feed": "<the feed, as JSON text>", "signature": "<base64 of the Ed25519 signature>"}

The signature is over the UTF-8 bytes of ``feed`` exactly as sent, so nothing is
re-serialised before the check. Only once it verifies is ``feed`` parsed (``Feed``): its
version, when it was published, the notes, the backend packs of every target and the
installers. A document that does not verify, or verifies and is not a feed, is a
``FeedError`` and nothing from it is used.

The public key is the release's: ``FEED_PUBLIC_KEY`` below (base64 of the 32 raw bytes),
with the feed's address ``FEED_URL``. A build made without them (this source tree) answers
``503 no_feed_key`` where it would read the feed. For testing, ``--feed-key-file`` names
another public key and ``--feed-url`` another https address (docs/backends.md).
"""

from __future__ import annotations

import base64
import binascii
import json
import platform
import re
from typing import Annotated, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from packaging.version import InvalidVersion, Version
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr,
                      ValidationError)

from .errors import FeedError

# The release's feed key (base64 of an Ed25519 public key's 32 raw bytes) and address.
# A release build writes both; empty here, so this build answers 503 no_feed_key.
FEED_PUBLIC_KEY = ""
FEED_URL = ""

FEED_LIMIT = 4 << 20            # the most of a feed document read

_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
_LIBRARY = re.compile(r"^[A-Za-z0-9._+-]+(/[A-Za-z0-9._+-]+)*$")


def _id(v: str) -> str:
    if not _ID.match(v):
        raise ValueError("an id is lower-case letters, digits, '.', '_' and '-'")
    return v


def _https(v: str) -> str:
    if not v.startswith("https://") or any(c.isspace() for c in v):
        raise ValueError("a link must be an https URL")
    return v


def _sha(v: str) -> str:
    if not _SHA256.match(v):
        raise ValueError("a SHA-256 is 64 lower-case hex digits")
    return v


def _file(v: str) -> str:
    if not _FILE.match(v):
        raise ValueError("a file name is letters, digits, '.', '_', '+' and '-'")
    return v


def _library(v: str) -> str:
    if not _LIBRARY.match(v) or any(part in (".", "..") for part in v.split("/")):
        raise ValueError("a library is a relative path inside the pack")
    return v


def _driver(v: str) -> str:
    if not _FILE.match(v):
        raise ValueError("a driver library is named by its file name only")
    return v


def _version(v: str) -> str:
    try:
        Version(v)
    except InvalidVersion:
        raise ValueError("a version is a release number such as 0.4.0") from None
    return v


Id = Annotated[StrictStr, AfterValidator(_id)]
Url = Annotated[StrictStr, AfterValidator(_https)]
Sha = Annotated[StrictStr, AfterValidator(_sha)]
Size = Annotated[StrictInt, Field(gt=0)]


class Pack(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Id
    title: StrictStr
    target: StrictStr
    version: Annotated[StrictStr, AfterValidator(_version)]
    url: Url
    sha256: Sha
    size: Size
    # The system libraries the pack's backend drives (libvulkan.so.1, ...): it applies
    # here when one of them loads. None named: it needs nothing beyond this system.
    drivers: list[Annotated[StrictStr, AfterValidator(_driver)]] = []
    # The backend libraries to load at start, inside the pack; none named: every
    # libggml-*.so (ggml-*.dll, libggml-*.dylib) at the pack's top.
    libraries: list[Annotated[StrictStr, AfterValidator(_library)]] = []


class Installer(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: Url
    sha256: Sha
    size: Size
    file: Annotated[StrictStr, AfterValidator(_file)]


class Feed(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: Annotated[StrictStr, AfterValidator(_version)]
    published: StrictStr
    notes: StrictStr = ""
    packs: list[Pack] = []
    installers: dict[StrictStr, Installer] = {}

    def packs_for(self, target: str) -> list[Pack]:
        return [p for p in self.packs if p.target == target]

    def pack(self, target: str, pack_id: str) -> Pack | None:
        return next((p for p in self.packs_for(target) if p.id == pack_id), None)


def target() -> str:
    """This build's OS and architecture as the feed names targets: ``linux-x64``,
    ``macos-arm64``, ``windows-x64``, ..."""
    system = {"darwin": "macos"}.get(platform.system().lower(), platform.system().lower())
    machine = platform.machine().lower()
    machine = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64"}.get(machine, machine)
    return f"{system}-{machine}"


def parse_key(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from base64 of its 32 raw bytes or from a PEM block.
    ValueError with a sentence when it is neither."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = load_pem_public_key(text.encode("ascii", "replace"))
        except ValueError:
            raise ValueError("the PEM block is not a public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the key is not an Ed25519 key")
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the key is neither base64 nor a PEM block") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, this one is {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def built_in_key() -> Ed25519PublicKey | None:
    return parse_key(FEED_PUBLIC_KEY) if FEED_PUBLIC_KEY else None


def _why(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "the document"
    reason = str(first.get("ctx", {}).get("error", "")) or {
        "missing": "is missing", "string_type": "must be a string",
        "int_type": "must be an integer", "list_type": "must be an array",
        "dict_type": "must be an object", "model_type": "must be an object",
        "greater_than": "must be above 0"}.get(first.get("type", ""), "has the wrong value")
    return f"{where}: {reason}"


def verify(document: bytes, key: Ed25519PublicKey) -> tuple[Feed, bytes]:
    """The feed in ``document`` once its signature verifies under ``key``: (the feed, the
    document itself, to keep). FeedError saying why otherwise."""
    try:
        envelope: Any = json.loads(document)
    except (ValueError, UnicodeDecodeError):
        raise FeedError("The feed is not JSON.") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("feed"), str) \
            or not isinstance(envelope.get("signature"), str):
        raise FeedError("The feed is not a signed feed: it must be an object with `feed` "
                        "(text) and `signature` (base64).")
    try:
        signature = base64.b64decode(envelope["signature"], validate=True)
    except (binascii.Error, ValueError):
        raise FeedError("The feed's signature is not base64.") from None
    body = envelope["feed"].encode("utf-8", "surrogatepass")
    try:
        key.verify(signature, body)
    except InvalidSignature:
        raise FeedError("The feed's signature does not verify with this build's key: it was "
                        "changed after it was signed, or signed by someone else. Nothing "
                        "from it is used.") from None
    try:
        feed = Feed.model_validate(json.loads(body))
    except ValueError as e:
        why = _why(e) if isinstance(e, ValidationError) else "it is not JSON"
        raise FeedError(f"The signed feed could not be read ({why}).") from None
    return feed, document


def newer(version: str, than: str) -> bool:
    """Whether release ``version`` is newer than ``than`` (a version that does not parse
    is never newer)."""
    try:
        return Version(version) > Version(than)
    except InvalidVersion:
        return False
