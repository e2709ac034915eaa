"""Drive tests/vision_worker.py: images read by the real libmtmd in a child process.

A crash ends the child, not the caller: `read` then returns a result with `crashed`
set (and the exit code), and the next call starts a fresh child.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "vision_worker.py"


@dataclass
class Read:
    ok: bool = False
    refused: str = ""
    crashed: bool = False
    timed_out: bool = False
    returncode: int | None = None


class VisionChild:
    def __init__(self, model: Path, timeout_s: float = 60.0) -> None:
        self.model, self.timeout_s = model, timeout_s
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(self.model)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["ready"]
        return proc

    def read(self, url: str) -> Read:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"url": url}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.close()
            return Read(timed_out=True)
        line = proc.stdout.readline()
        if not line:
            return self._dead()
        return Read(**json.loads(line))

    def _dead(self) -> Read:
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = self.proc.poll()
        self.close()
        return Read(crashed=True, returncode=code)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
