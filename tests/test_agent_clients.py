"""Connecting other coding agents (`docs/agent.md`, "Clients"): the merge of each
client's own settings file (pure, byte tables), and `POST /api/connect/<client>` on a
real server writing Claude Code's, Codex's and opencode's files under a scratch HOME,
with a backup, and leaving a file it will not rewrite byte for byte as it was."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path

import pytest
from _app_routes import flagged
from conftest import start_server

from bmoe.agent import clients

T = clients.Target(base_url="http://127.0.0.1:8765", model="tiny.gguf", n_ctx=4096, key=None)
KEYED = clients.Target(base_url="http://127.0.0.1:8765", model="tiny.gguf", n_ctx=4096,
                       key="sk-local-0123")


# -- the merge (no I/O) ----------------------------------------------------------------------

def test_claude_settings_keep_everything_else() -> None:
    old = json.dumps({"permissions": {"allow": ["Bash(ls)"]},
                      "env": {"FOO": "1", "ANTHROPIC_MODEL": "old"}, "theme": "dark"}).encode()
    doc = json.loads(clients.merged("claude-settings", old, T))
    assert doc["permissions"] == {"allow": ["Bash(ls)"]} and doc["theme"] == "dark"
    assert doc["env"]["FOO"] == "1"
    assert doc["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8765"
    assert doc["env"]["ANTHROPIC_MODEL"] == "tiny.gguf"
    assert doc["env"]["ANTHROPIC_AUTH_TOKEN"] == "bmoe"
    assert json.loads(clients.merged("claude-settings", None, KEYED))["env"][
        "ANTHROPIC_AUTH_TOKEN"] == "sk-local-0123"


def test_codex_config_is_the_documented_provider_block() -> None:
    old = b'approval_policy = "on-request"\n\n[model_providers.other]\nname = "x"\n' \
          b'base_url = "https://x.invalid/v1"\n\n[profiles.fast]\nmodel = "o4"\n'
    doc = tomllib.loads(clients.merged("codex-toml", old, T).decode())
    assert doc["approval_policy"] == "on-request"
    assert doc["profiles"] == {"fast": {"model": "o4"}}
    assert doc["model_providers"]["other"]["base_url"] == "https://x.invalid/v1"
    assert doc["model_provider"] == "bmoe" and doc["model"] == "tiny.gguf"
    assert doc["model_context_window"] == 4096
    assert doc["model_providers"]["bmoe"] == {
        "name": "bmoe", "base_url": "http://127.0.0.1:8765/v1", "wire_api": "responses",
        "stream_idle_timeout_ms": 3600000}
    keyed = tomllib.loads(clients.merged("codex-toml", None, KEYED).decode())
    assert keyed["model_providers"]["bmoe"]["env_key"] == "BMOE_API_KEY"
    assert "sk-local" not in clients.merged("codex-toml", None, KEYED).decode()


def test_opencode_provider_is_openai_compatible() -> None:
    old = json.dumps({"$schema": "https://opencode.ai/config.json", "theme": "x",
                      "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible"}}}).encode()
    doc = json.loads(clients.merged("opencode-json", old, T))
    assert doc["theme"] == "x" and "ollama" in doc["provider"]
    p = doc["provider"]["bmoe"]
    assert p["npm"] == "@ai-sdk/openai-compatible"
    assert p["options"] == {"baseURL": "http://127.0.0.1:8765/v1"}
    assert p["models"] == {"tiny.gguf": {"name": "tiny.gguf"}}
    assert doc["model"] == doc["small_model"] == "bmoe/tiny.gguf"


@pytest.mark.parametrize("fmt,data", [
    ("claude-settings", b'{"env": {"A": 1},'),                 # does not parse
    ("claude-settings", b'// mine\n{"env": {}}'),              # JSONC is not rewritten
    ("claude-settings", b'{"env": "ANTHROPIC_BASE_URL=x"}'),   # env of the wrong shape
    ("claude-settings", b'[1, 2]'),
    ("codex-toml", b'model = "o3"\n[model_providers.bmoe\nname = "x"\n'),   # unclosed table
    ("codex-toml", b'model_providers = "none"\n'),
    ("codex-toml", b'name = "\xff"\n'),                        # not UTF-8
    ("opencode-json", b'{"provider": [] }'),
])
def test_a_file_it_cannot_read_whole_is_refused(fmt: str, data: bytes) -> None:
    with pytest.raises(clients.Unmergeable) as e:
        clients.merged(fmt, data, T)
    assert "Traceback" not in e.value.message and e.value.message.endswith(".")


def test_empty_file_is_an_empty_object() -> None:
    assert json.loads(clients.merged("claude-settings", b"\n", T))["env"]
    assert tomllib.loads(clients.merged("codex-toml", b"", T).decode())["model_provider"]


def test_settings_paths_follow_each_clients_variables(tmp_path: Path) -> None:
    by_id = {c["id"]: c for c in clients.catalog()}
    home = {"HOME": str(tmp_path)}
    assert clients.settings_path(by_id["claude-code"], home) == tmp_path / ".claude/settings.json"
    assert clients.settings_path(by_id["codex"], home) == tmp_path / ".codex/config.toml"
    assert clients.settings_path(by_id["opencode"], home) == \
        tmp_path / ".config/opencode/opencode.json"
    env = dict(home, CLAUDE_CONFIG_DIR="/c", CODEX_HOME="/x", XDG_CONFIG_HOME="/cfg")
    assert clients.settings_path(by_id["claude-code"], env) == Path("/c/settings.json")
    assert clients.settings_path(by_id["codex"], env) == Path("/x/config.toml")
    assert clients.settings_path(by_id["opencode"], env) == Path("/cfg/opencode/opencode.json")


def test_the_routes_are_local_only() -> None:
    assert {("POST", "/api/connect/{id}"), ("GET", "/api/clients")} <= flagged()


def test_connect_keeps_a_backup_and_the_files_mode(tmp_path: Path) -> None:
    entry = clients.find("claude-code")
    assert entry is not None
    cfg = tmp_path / ".claude" / "settings.json"
    cfg.parent.mkdir()
    cfg.write_text('{"theme": "dark"}')
    os.chmod(cfg, 0o640)
    out = clients.connect(entry, T, {"HOME": str(tmp_path)})
    assert out["changed"] and Path(out["backup"]).read_text() == '{"theme": "dark"}'
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o640
    again = clients.connect(entry, T, {"HOME": str(tmp_path)})
    assert not again["changed"] and again["backup"] is None      # nothing to do: no new backup
    assert len(list(cfg.parent.glob("settings.json.bmoe-backup-*"))) == 1


# -- the route, on a real server -------------------------------------------------------------

def test_connect_writes_each_clients_file(tmp_path: Path, tiny_moe: Path) -> None:
    home = tmp_path / "home"
    env = {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
           "CODEX_HOME": str(home / ".codex"), "XDG_CONFIG_HOME": str(home / ".config")}
    (home / ".codex").mkdir(parents=True)
    codex = home / ".codex" / "config.toml"
    codex.write_text('approval_policy = "never"\n')
    broken = home / ".config" / "opencode" / "opencode.json"
    broken.parent.mkdir(parents=True)
    broken_bytes = b'{\n  // my comment\n  "theme": "tokyonight",\n}\n'
    broken.write_bytes(broken_bytes)
    srv = start_server(tmp_path / "data", "-m", str(tiny_moe), "-c", "4096", env=env)
    try:
        assert srv.info()["state"] == "ready"
        port = srv.url.rsplit(":", 1)[1]
        status, _, listing = srv.request("GET", "/api/clients")
        assert status == 200
        assert [c["id"] for c in listing["clients"]] == ["claude-code", "codex", "opencode"]
        assert not any(c["connected"] for c in listing["clients"])

        status, _, out = srv.request("POST", "/api/connect/claude-code")
        assert status == 200, out
        claude = json.loads((home / ".claude" / "settings.json").read_text())
        assert claude["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
        assert claude["env"]["ANTHROPIC_MODEL"] == tiny_moe.name
        assert out["backup"] is None                                    # there was no file

        status, _, out = srv.request("POST", "/api/connect/codex")
        assert status == 200, out
        doc = tomllib.loads(codex.read_text())
        assert doc["approval_policy"] == "never"
        assert doc["model_providers"]["bmoe"]["base_url"] == f"http://127.0.0.1:{port}/v1"
        assert Path(out["backup"]).read_text() == 'approval_policy = "never"\n'

        status, _, out = srv.request("POST", "/api/connect/opencode")
        assert status == 409 and out["code"] == "conflict", out
        assert "left as it is" in out["error"]
        assert broken.read_bytes() == broken_bytes                      # byte-identical
        assert list(broken.parent.iterdir()) == [broken]                # no backup, no temp

        status, _, out = srv.request("POST", "/api/connect/nope")
        assert status == 404 and out["code"] == "not_found"
        status, _, agent = srv.request("GET", "/api/agent")
        assert [a["id"] for a in agent["agents"]] == ["bmoe", "claude-code", "codex", "opencode"]
        status, _, listing = srv.request("GET", "/api/clients")
        assert [c["connected"] for c in listing["clients"]] == [True, True, False]
    finally:
        srv.stop()


def test_connect_with_no_model_is_a_conflict(tmp_path: Path) -> None:
    home = tmp_path / "home"
    srv = start_server(tmp_path / "data", env={"HOME": str(home),
                                               "CLAUDE_CONFIG_DIR": str(home / ".claude")},
                       wait_ready=False)
    try:
        status, _, out = srv.request("POST", "/api/connect/claude-code")
        assert status == 409 and out["code"] == "conflict" and "model" in out["error"]
        assert not (home / ".claude").exists()
    finally:
        srv.stop()
