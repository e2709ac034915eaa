"""`bmoe-cli --plan` and `bmoe-cli --auto`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def cli(*args: str, data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, BMOE_DATA_DIR=str(data)))


def test_plan_prints_the_plan_and_exits(tmp_path: Path, tiny_moe: Path) -> None:
    r = cli("-m", str(tiny_moe), "--plan", "-t", "1", data=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "The whole model fits in memory: it runs resident, " \
                                        "nothing streams."
    assert "kept Compute threads: 1 thread: your own setting" in r.stdout
    assert "predicted:" in r.stdout
    r = cli("-m", str(tiny_moe), "--plan", "--json", data=tmp_path)
    body = json.loads(r.stdout)
    assert body["regime"] == "resident" and body["decisions"]


def test_auto_plans_runs_and_compares(tmp_path: Path, tiny_moe: Path) -> None:
    r = cli("-m", str(tiny_moe), "--auto", "--moe-stream", "-p", "Tell me about the sea.",
            "-n", "24", "-t", "1", "-c", "2048", data=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Experts stream from storage" in r.stderr
    assert "plan: measured " in r.stderr and "predicted " in r.stderr
    assert list((tmp_path / "routing").glob("*.routing"))


def test_a_file_that_is_not_a_model_is_said(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    r = cli("-m", str(junk), "--plan", data=tmp_path)
    assert r.returncode == 1
    assert "cannot be planned for" in r.stderr and "Traceback" not in r.stderr
