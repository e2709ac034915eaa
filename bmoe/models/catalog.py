"""The catalog: the entries shipped with the package and the ones a person added.

A catalog entry is what a download takes: an id, a title, and its files in order, each a
bare file name, an https URL, a size (0 when unknown) and, where known, its SHA-256.
``catalog/models.json`` ships with the package and is read once; an entry with a file
that fails the rules below is left out, with the reason in the server's log. The added
entries (``POST /api/hf/add``, ``POST /api/models/url``) live in ``added-models.json``
beside the settings, written atomically, and never replace a shipped id.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .atomic import write_atomically
from .probe import split_parts

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent / "catalog" / "models.json"
ADDED_FILE = "added-models.json"
ADDED_VERSION = 1

# A file name a client may make the server write: letters, digits, . _ - +, not hidden.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]*$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
ENTRY_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[0-9A-Z]+)*|[BF]F?16|F32|MXFP4|NVFP4|TQ\d_\d)(?![A-Za-z0-9])",
    re.I)


def is_bare_name(name: str) -> bool:
    """A file name with no separator, no drive colon, not ``.`` or ``..``."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\:\0")


def is_safe_name(name: str) -> bool:
    return bool(SAFE_NAME.match(name)) and ".." not in name and len(name) <= 255


def quant_of(name: str) -> str:
    stem = name[:-5] if name.lower().endswith(".gguf") else name
    parts = split_parts(name)
    if parts is not None:
        stem = parts[0]
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else ""


@dataclass
class CatalogFile:
    name: str
    bytes: int
    url: str
    sha256: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bytes": self.bytes, "url": self.url}
        if self.sha256:
            out["sha256"] = self.sha256
        return out


@dataclass
class Entry:
    id: str
    title: str
    files: list[CatalogFile]
    quant: str = ""
    blurb: str = ""
    chat_format: str = ""       # the engine's name of its chat format ("gpt_oss")
    chat_format_name: str = ""  # ... as people read it ("GPT-OSS Harmony")
    added: bool = False
    repo: str = ""
    revision: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "title": self.title, "quant": self.quant,
            "file": self.files[0].name if self.files else "", "bytes": self.bytes,
            "files": [f.to_json() for f in self.files], "blurb": self.blurb}
        if self.chat_format:
            out["chat_format"] = self.chat_format
            out["chat_format_name"] = self.chat_format_name or self.chat_format
        if self.added:
            out["added"] = True
            if self.repo:
                out["repo"] = self.repo
                out["revision"] = self.revision
        return out


def url_problem(url: Any, http_origin: str = "") -> str:
    """Why ``url`` may not be a catalog file's URL ("" when it may)."""
    if not isinstance(url, str) or not url:
        return "it has no URL"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError:
        return "its URL is not a URL"
    if parts.username is not None or parts.password is not None:
        return "its URL carries a user name or password"
    if not parts.hostname:
        return "its URL names no host"
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "its URL holds a blank or a control character"
    if parts.scheme == "https":
        return ""
    if parts.scheme == "http" and http_origin and url.startswith(http_origin.rstrip("/") + "/"):
        return ""
    return "its URL is not https"


def file_problem(f: Any, http_origin: str = "") -> str:
    if not isinstance(f, dict):
        return "a file is not an object"
    name = f.get("name")
    if not isinstance(name, str) or not is_bare_name(name):
        return f"the file name {name!r} is not a bare file name"
    size = f.get("bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"{name}: its size is not a number of bytes"
    sha = f.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not SHA256.match(sha)):
        return f"{name}: its sha256 is not 64 lowercase hex digits"
    problem = url_problem(f.get("url"), http_origin)
    return f"{name}: {problem}" if problem else ""


def entry_from_json(d: Any, *, added: bool, http_origin: str = "") -> tuple[Entry | None, str]:
    """An entry from its JSON, or None and the reason it is left out."""
    if not isinstance(d, dict):
        return None, "an entry is not an object"
    eid = d.get("id")
    if not isinstance(eid, str) or not eid:
        return None, "an entry has no id"
    if not added and not ENTRY_ID.match(eid):
        return None, f"{eid!r}: the id is not lowercase letters, digits, . _ -"
    files = d.get("files")
    if not isinstance(files, list) or not files:
        return None, f"{eid}: it names no file"
    for f in files:
        problem = file_problem(f, http_origin)
        if problem:
            return None, f"{eid}: {problem}"
    names = [f["name"] for f in files]
    if len(set(names)) != len(names):
        return None, f"{eid}: it names a file twice"
    title = d.get("title") if isinstance(d.get("title"), str) else eid
    entry = Entry(
        id=eid, title=title or eid,
        files=[CatalogFile(f["name"], int(f.get("bytes", 0)), f["url"], f.get("sha256") or "")
               for f in files],
        quant=_text(d, "quant") or quant_of(names[0]), blurb=_text(d, "blurb"),
        chat_format=_text(d, "chat_format"), chat_format_name=_text(d, "chat_format_name"),
        added=added,
        repo=_text(d, "repo"), revision=_text(d, "revision"))
    return entry, ""


def _text(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    return v if isinstance(v, str) else ""


def load_shipped(path: Path = SHIPPED, http_origin: str = "") -> list[Entry]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("catalog: %s could not be read (%s); no shipped entries", path, e)
        return []
    raw = data.get("models", []) if isinstance(data, dict) else []
    out: list[Entry] = []
    for d in raw if isinstance(raw, list) else []:
        entry, why = entry_from_json(d, added=False, http_origin=http_origin)
        if entry is None:
            log.warning("catalog: left out an entry: %s", why)
        elif any(e.id == entry.id for e in out):
            log.warning("catalog: left out a second entry with the id %s", entry.id)
        else:
            out.append(entry)
    return out


class AddedEntries:
    """``added-models.json``: read at start, written atomically after each change."""

    def __init__(self, data_dir: Path, http_origin: str = "") -> None:
        self.path = Path(data_dir) / ADDED_FILE
        self.entries: list[Entry] = []
        self._load(http_origin)

    def _load(self, http_origin: str) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("catalog: %s could not be read (%s); starting with no added models",
                        self.path, e)
            return
        raw = data.get("models", []) if isinstance(data, dict) else []
        for d in raw if isinstance(raw, list) else []:
            entry, why = entry_from_json(d, added=True, http_origin=http_origin)
            if entry is None:
                log.warning("catalog: left out an added entry: %s", why)
            else:
                self.entries.append(entry)

    def get(self, eid: str) -> Entry | None:
        return next((e for e in self.entries if e.id == eid), None)

    def put(self, entry: Entry) -> None:
        self.entries = [e for e in self.entries if e.id != entry.id] + [entry]
        self._save()

    def remove(self, eid: str) -> bool:
        before = len(self.entries)
        self.entries = [e for e in self.entries if e.id != eid]
        if len(self.entries) == before:
            return False
        self._save()
        return True

    def _save(self) -> None:
        doc = {"version": ADDED_VERSION,
               "models": [dict(e.to_json(), added=True) for e in self.entries]}
        write_atomically(self.path, json.dumps(doc, indent=2) + "\n")
