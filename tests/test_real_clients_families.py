"""Claude Code and Codex, the real programs, complete a tool round against bmoe-server
serving a model in gpt-oss's format (Harmony) and one in GLM's (``<arg_key>`` /
``<arg_value>``), each with the family's own template from the pinned sdist.

Real clients send no grammar, so the model is the maker's scripted one
(`bmoe.modelmaker.scripted`): its greedy answer is the family's call of the client's own
tool (Claude Code's ``Read``, Codex's ``exec_command``) until the file's secret word is in
its context, and a closing sentence once it is. The closing sentence in the client's
output therefore says that the server parsed the call out of the family's markup, the
client ran its tool and sent the result back, and the template put it in front of the
model. The clients are installed from ``tests/clients`` (pinned, with its lock file) into
the test cache with npm, once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from _llama_templates import cache_dir, templates_dir
from bmoe.modelmaker import scripted
from bmoe.modelmaker.scripted import Script, make_scripted
from conftest import ServerProcess, start_server

CLIENTS = Path(__file__).resolve().parent / "clients"
SECRET = "zebra-quartz-42"
CLOSING = "The word is in the notes."
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>")
GLM = ("<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "<tool_call>",
       "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
       "</think>", "<tool_response>", "</tool_response>", "[gMASK]", "<sop>")


def _gpt_oss(tool: str, args: dict[str, str]) -> Script:
    return Script(
        template=(templates_dir() / "openai-gpt-oss-120b.jinja").read_text(),
        prompt_end="assistant", marker=SECRET, specials=HARMONY,
        first=("<|channel|>", f"commentary to=functions.{tool} ", "<|constrain|>", "json",
               "<|message|>", json.dumps(args), "<|call|>"),
        then=("<|channel|>", "final", "<|message|>", CLOSING, "<|return|>"),
        eos="<|return|>", eot="<|call|>", name="scripted gpt-oss")


def _glm(tool: str, args: dict[str, str]) -> Script:
    (key, value), = args.items()
    return Script(
        template=(templates_dir() / "GLM-4.6.jinja").read_text(),
        prompt_end="<|assistant|>", marker=SECRET, specials=GLM,
        first=("<tool_call>", f"{tool}\n", "<arg_key>", key, "</arg_key>\n", "<arg_value>",
               value, "</arg_value>\n", "</tool_call>", "<|observation|>"),
        then=(CLOSING, "<|user|>"),
        eos="<|endoftext|>", eot="<|user|>", eom="<|observation|>", name="scripted GLM")


FAMILIES = {"gpt_oss": _gpt_oss, "glm45": _glm}


@pytest.fixture(scope="session")
def agents() -> dict[str, Path]:
    """``claude`` and ``codex`` from tests/clients' lock file, installed once into the
    test cache (npm ci)."""
    lock = (CLIENTS / "package-lock.json").read_bytes()
    home = cache_dir() / "clients" / hashlib.sha256(lock).hexdigest()[:16]
    modules = home / "node_modules"
    found = {"claude": modules / "@anthropic-ai/claude-code-linux-x64/claude",
             "codex": modules / ".bin/codex"}
    if not all(p.exists() for p in found.values()):
        npm = shutil.which("npm")
        if npm is None:
            if os.environ.get("CI"):
                pytest.fail("npm is needed to install the real clients (scripts/test "
                            "documents Node.js >= 20 with npm)")
            pytest.skip("needs npm to install Claude Code and Codex")
        part = home.with_name(home.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(CLIENTS / name, part / name)
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                       cwd=part, check=True, timeout=900, stdout=subprocess.DEVNULL)
        shutil.rmtree(home, ignore_errors=True)
        os.replace(part, home)
    for name, path in found.items():
        version = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                                 timeout=60)
        assert version.returncode == 0, (name, version.stderr)
    return found


@pytest.fixture()
def workspace(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(f"{SECRET} is the word\n")
    return work


def _serve(tmp_path: Path, script: Script) -> Iterator[ServerProcess]:
    model = make_scripted(tmp_path / "scripted.gguf", script)
    srv = start_server(tmp_path / "data", "-m", str(model), "-c", "65536")
    try:
        yield srv
    finally:
        srv.stop()


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")}
    return subprocess.run(cmd, cwd=cwd, env={**full, **env}, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_claude_code_reads_a_file_through_the_familys_call(
        family: str, agents: dict[str, Path], workspace: Path, tmp_path: Path) -> None:
    notes = workspace / "notes.txt"
    script = FAMILIES[family]("Read", {"file_path": str(notes)})
    for srv in _serve(tmp_path, script):
        assert srv.info()["model"]["chat_format"] == family
        home = tmp_path / "home"
        home.mkdir()
        done = _run([str(agents["claude"]), "-p", "Read notes.txt and tell me the word",
                     "--model", "scripted", "--allowedTools", "Read",
                     "--output-format", "json"], workspace,
                    {"HOME": str(home), "ANTHROPIC_BASE_URL": srv.url.rstrip("/"),
                     "ANTHROPIC_API_KEY": "sk-local", "DISABLE_TELEMETRY": "1",
                     "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        result = json.loads(done.stdout)
        assert result["is_error"] is False, result
        assert result["num_turns"] == 2, result          # the call, then the answer
        assert result["result"] == CLOSING, result
        assert result["permission_denials"] == [], result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_codex_runs_a_command_through_the_familys_call(
        family: str, agents: dict[str, Path], workspace: Path, tmp_path: Path) -> None:
    script = FAMILIES[family]("exec_command", {"cmd": "cat notes.txt"})
    for srv in _serve(tmp_path, script):
        assert srv.info()["model"]["chat_format"] == family
        codex_home = tmp_path / "codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            'model = "scripted"\nmodel_provider = "bmoe"\n\n[model_providers.bmoe]\n'
            f'name = "bmoe"\nbase_url = "{srv.url.rstrip("/")}/v1"\nwire_api = "responses"\n')
        last = tmp_path / "last.txt"
        done = _run([str(agents["codex"]), "exec", "--skip-git-repo-check",
                     "--dangerously-bypass-approvals-and-sandbox",
                     "--output-last-message", str(last),
                     "Run cat notes.txt and tell me the word"], workspace,
                    {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(codex_home)})
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
        assert "cat notes.txt" in done.stdout + done.stderr      # the command it ran
        assert last.read_text().strip() == CLOSING, (done.stdout[-2000:], done.stderr[-2000:])


# -- the maker's script, and a vocabulary llama.cpp aborts on ----------------------------

def test_a_piece_twice_in_one_answer_is_refused() -> None:
    bad = Script(template="", prompt_end="<s>", marker="m", first=("a", "b", "a", "c"),
                 then=("x",))
    with pytest.raises(ValueError, match="followed by two different pieces"):
        scripted.transitions(bad)


def test_the_answers_part_only_where_they_differ() -> None:
    s = _gpt_oss("Read", {"file_path": "/x"})
    steps = scripted.transitions(s)
    assert steps[("assistant", None)] == "<|channel|>"          # both answers open so
    assert steps[("<|channel|>", False)].startswith("commentary to=functions.Read")
    assert steps[("<|channel|>", True)] == "final"
    assert steps[("<|message|>", False)] == '{"file_path": "/x"}'
    assert steps[("<|message|>", True)] == CLOSING


def test_a_vocabulary_with_a_token_twice_is_refused_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's loader asserts (and so ends the process) when two tokens share a text;
    the server refuses the file by name and keeps serving."""
    real = scripted._vocab

    def twice(script: Script) -> tuple[list[str], list[int], list[str], dict[str, int]]:
        tokens, types, merges, ids = real(script)
        tokens[-1] = tokens[ids["final"]]
        return tokens, types, merges, ids

    monkeypatch.setattr(scripted, "_vocab", twice)
    model = make_scripted(tmp_path / "twice.gguf", _gpt_oss("Read", {"file_path": "/x"}))
    srv = start_server(tmp_path / "data", "-m", str(model), wait_ready=False)
    try:
        info = srv.wait_state("ready", "error")
        assert info["state"] == "error", info
        assert "broken vocabulary" in info["error"] and "'final'" in info["error"], info
        assert srv.request("GET", "/api/info")[0] == 200             # still serving
    finally:
        srv.stop()
