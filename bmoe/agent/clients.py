"""Other coding agents (`docs/agent.md`, "Clients"): the catalog, and connecting one.

Theory of operation
-------------------
The catalog (`bmoe/models/catalog/clients.json`, beside the model catalog) names each
client, the program that runs it and where its own settings file lives. Connecting a
client rewrites that file so the client uses this server: the settings are read, the
few keys this server owns are merged in (everything else is kept as it was), the old
file is copied to a backup beside it, and the new one is written atomically
(`store.write_bytes`: temp file, fsync, rename). The merge is pure (`merged`: bytes
in, bytes out) and refuses a file it cannot read whole — JSON that does not parse, a
TOML table left unclosed, a value of the wrong shape — with `Unmergeable`; the route
answers that as `409 conflict` and the file is not touched.

Claude Code reads `settings.json`'s `env`; Codex CLI reads `config.toml`'s
`model_provider` and `[model_providers.<id>]`; opencode reads `opencode.json`'s
`provider` and `model`. TOML is read with `tomllib` and written with `tomli-w` (which
does not keep comments: the backup does).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from . import store

CATALOG = Path(__file__).resolve().parent.parent / "models" / "catalog" / "clients.json"
PROVIDER_ID = "bmoe"                    # the provider entry this server owns in each file
LONG_TIMEOUT_MS = "3600000"             # a first prefill on a slow machine (README)
SETTINGS_MAX_BYTES = 4 * 2**20          # a settings file larger than this is not read
NEW_FILE_MODE = 0o600                   # settings may hold the server's key


class Unmergeable(Exception):
    """A settings file this server will not rewrite; `message` is for people."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Target:
    """What a client is pointed at: this server."""

    base_url: str            # e.g. http://127.0.0.1:8765 (no /v1)
    model: str               # the loaded model's name
    n_ctx: int               # its context, in tokens
    key: str | None          # the server's key, when it has one


# -- the catalog ---------------------------------------------------------------------

def catalog() -> list[dict[str, Any]]:
    with open(CATALOG, encoding="utf-8") as f:
        return list(json.load(f)["clients"])


def find(client_id: str) -> dict[str, Any] | None:
    return next((c for c in catalog() if c["id"] == client_id), None)


def settings_path(entry: dict[str, Any], env: dict[str, str] | None = None) -> Path:
    """The client's settings file: the first candidate whose variable is set."""
    env = dict(os.environ) if env is None else env
    for cand in entry["settings"]:
        if cand.startswith("$"):
            var, _, rest = cand[1:].partition("/")
            if env.get(var):
                return Path(env[var]) / rest
            continue
        home = env.get("HOME") or str(Path.home())
        return Path(cand.replace("~", home, 1))
    raise ValueError(f"the catalog gives {entry['id']} no settings file")


def listing(env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each client with whether its program is installed and where its settings are."""
    out = []
    for c in catalog():
        path = settings_path(c, env)
        out.append({"id": c["id"], "name": c["name"], "program": c["program"],
                    "installed": shutil.which(c["program"]) is not None,
                    "settings": str(path), "connected": _connected(c, path)})
    return out


def _connected(entry: dict[str, Any], path: Path) -> bool:
    try:
        data = path.read_bytes()
        doc = _parse(entry["format"], data)
    except (OSError, Unmergeable):
        return False
    if entry["format"] == "claude-settings":
        return "ANTHROPIC_BASE_URL" in (doc.get("env") or {})
    if entry["format"] == "codex-toml":
        return bool(doc.get("model_provider") == PROVIDER_ID)
    return isinstance(doc.get("provider"), dict) and PROVIDER_ID in doc["provider"]


# -- the merge (no I/O) ------------------------------------------------------------------

def _parse(fmt: str, data: bytes) -> dict[str, Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unmergeable("The settings file is not UTF-8 text.") from None
    if not text.strip():
        return {}
    if fmt == "codex-toml":
        try:
            doc: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            raise Unmergeable("The settings file is not valid TOML (a table or a string "
                              "left unclosed?).") from None
    else:
        try:
            doc = json.loads(text)
        except ValueError:
            raise Unmergeable("The settings file is not valid JSON (comments or a trailing "
                              "comma are not read here).") from None
    if not isinstance(doc, dict):
        raise Unmergeable("The settings file does not hold an object at its top.")
    return doc


def _table(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.setdefault(key, {})
    if not isinstance(value, dict):
        raise Unmergeable(f"`{key}` in the settings file is not an object.")
    return value


def _claude(doc: dict[str, Any], t: Target) -> None:
    env = _table(doc, "env")
    env.update({"ANTHROPIC_BASE_URL": t.base_url,
                "ANTHROPIC_AUTH_TOKEN": t.key or "bmoe",
                "ANTHROPIC_MODEL": t.model,
                "CLAUDE_STREAM_IDLE_TIMEOUT_MS": LONG_TIMEOUT_MS,
                "API_TIMEOUT_MS": LONG_TIMEOUT_MS})


def _codex(doc: dict[str, Any], t: Target) -> None:
    providers = _table(doc, "model_providers")
    entry: dict[str, Any] = {"name": "bmoe", "base_url": t.base_url + "/v1",
                             "wire_api": "responses",
                             "stream_idle_timeout_ms": int(LONG_TIMEOUT_MS)}
    if t.key:
        entry["env_key"] = "BMOE_API_KEY"
    providers[PROVIDER_ID] = entry
    doc["model"] = t.model
    doc["model_provider"] = PROVIDER_ID
    doc["model_context_window"] = t.n_ctx


def _opencode(doc: dict[str, Any], t: Target) -> None:
    doc.setdefault("$schema", "https://opencode.ai/config.json")
    providers = _table(doc, "provider")
    options: dict[str, Any] = {"baseURL": t.base_url + "/v1"}
    if t.key:
        options["apiKey"] = t.key
    providers[PROVIDER_ID] = {"npm": "@ai-sdk/openai-compatible", "name": "bmoe",
                              "options": options, "models": {t.model: {"name": t.model}}}
    doc["model"] = doc["small_model"] = f"{PROVIDER_ID}/{t.model}"


MERGES = {"claude-settings": _claude, "codex-toml": _codex, "opencode-json": _opencode}


def merged(fmt: str, old: bytes | None, target: Target) -> bytes:
    """The settings file's new bytes: `old` (None when there is none) with this server in."""
    doc = _parse(fmt, old) if old is not None else {}
    MERGES[fmt](doc, target)
    if fmt == "codex-toml":
        return tomli_w.dumps(doc).encode("utf-8")
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


# -- writing (a worker thread) ---------------------------------------------------------------

def connect(entry: dict[str, Any], target: Target,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Merge this server into the client's settings file; `Unmergeable` leaves it as it was."""
    path = Path(os.path.realpath(settings_path(entry, env)))
    old, mode = _read_old(path)
    new = merged(entry["format"], old, target)
    backup = None
    if old is not None and new != old:
        backup = _backup_path(path)
        store.write_bytes(backup, old, mode=mode)
    if new != old:
        store.write_bytes(path, new, mode=mode)
    note = ("Set BMOE_API_KEY to the server's key before starting Codex."
            if target.key and entry["format"] == "codex-toml" else None)
    return {"client": entry["id"], "settings": str(path),
            "backup": str(backup) if backup else None, "changed": new != old, "note": note}


def _read_old(path: Path) -> tuple[bytes | None, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None, NEW_FILE_MODE
    except OSError:
        raise Unmergeable(f"{path} cannot be read.") from None
    if not path.is_file():
        raise Unmergeable(f"{path} is not a file.")
    if st.st_size > SETTINGS_MAX_BYTES:
        raise Unmergeable(f"{path} is larger than 4 MiB; it is not a settings file we know.")
    try:
        return path.read_bytes(), st.st_mode & 0o777
    except OSError:
        raise Unmergeable(f"{path} cannot be read.") from None


def _backup_path(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cand = path.with_name(f"{path.name}.bmoe-backup-{stamp}")
    n = 1
    while cand.exists():
        n += 1
        cand = path.with_name(f"{path.name}.bmoe-backup-{stamp}-{n}")
    return cand
