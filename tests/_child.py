"""A worker process that runs the real llama.cpp on requests, one JSON line each way.

Fuzz tests hand llama.cpp input that may crash it; a crash must end a child, never the
test run. ``WorkerChild.ask`` writes one request line and reads the answer line; a child
that died (llama.cpp aborted, the kernel killed it) answers ``Outcome(crashed=True, ...)``
and a child that did not answer in time is killed and answers ``timed_out``; the next
request starts a fresh child. The worker's first line is its hello (a JSON object).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    answer: dict[str, Any] = field(default_factory=dict)   # the worker's answer line
    crashed: bool = False       # the child died (its exit code in `returncode`)
    timed_out: bool = False
    returncode: int | None = None


class WorkerChild:
    def __init__(self, worker: Path, *args: str, env: dict[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.argv = [sys.executable, str(worker), *args]
        # a child may be meant to die: ggml's abort would first run gdb for a backtrace,
        # which takes minutes on a loaded machine
        self.env = {**os.environ, "GGML_NO_BACKTRACE": "1", **(env or {})}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.hello: dict[str, Any] = {}

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=self.env)
        assert proc.stdout is not None
        self.hello = json.loads(proc.stdout.readline())
        return proc

    def started(self) -> subprocess.Popen[str]:
        """The running child (started now if there is none)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        return self.proc

    def ask(self, request: dict[str, Any]) -> Outcome:
        proc = self.started()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _, _ = select.select([proc.stdout], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                return Outcome(timed_out=True)
            line = proc.stdout.readline()
            if not line:
                return self._dead()
            if line.startswith("{"):
                return Outcome(answer=json.loads(line))
            # Anything else is llama.cpp dying loudly (ggml's abort prints a backtrace
            # through gdb on stdout): read on to the end of the stream.

    def _dead(self) -> Outcome:
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = self.proc.poll()
        self.close()
        return Outcome(crashed=True, returncode=code)

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
