"""Test servers never outlive their test run: ``BMOE_PARENT_PID`` (set by conftest for
every server a test starts) stops a server once that process has ended, as
``--parent-pid`` does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bmoe.server.main import parent_from_env


def test_the_variable_names_a_running_process_or_nothing() -> None:
    assert parent_from_env(str(os.getpid())) == os.getpid()
    assert parent_from_env("") is None and parent_from_env("1") is None
    assert parent_from_env("abc") is None and parent_from_env("-5") is None
    assert parent_from_env("4194304999") is None


def test_a_server_ends_with_the_process_the_variable_names(tmp_path: Path) -> None:
    watched = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, BMOE_PARENT_PID=str(watched.pid), PYTHONUNBUFFERED="1")
    srv = subprocess.Popen([sys.executable, "-m", "bmoe.server", "--port", "0",
                            "--data-dir", str(tmp_path), "--no-auto"],
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert srv.stdout is not None and "listening on" in srv.stdout.readline()
        time.sleep(1.5)
        assert srv.poll() is None, "the server stopped while its parent still ran"
        watched.kill()
        watched.wait()
        assert srv.wait(timeout=15) == 0
    finally:
        watched.kill()
        if srv.poll() is None:
            srv.kill()
            srv.wait()
        if srv.stdout is not None:
            srv.stdout.close()
