"""Drive tests/grammar_worker.py: grammars compiled by the real llama.cpp in a child.

A crash of llama.cpp ends the child, not the caller: `compile` then returns a result
with `crashed` set (and the signal), and the next call starts a fresh child.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "grammar_worker.py"


@dataclass
class Compiled:
    built: bool = False      # llama.cpp made a sampler of it
    steps: int = 0           # sampling steps that found an allowed token
    ms: float = 0.0          # build plus the steps, in the child
    crashed: bool = False    # the child died (its exit code in `returncode`)
    timed_out: bool = False
    returncode: int | None = None


class GrammarChild:
    def __init__(self, model: Path, *, stack_bytes: int | None = None,
                 timeout_s: float = 60.0) -> None:
        self.model, self.timeout_s = model, timeout_s
        self.env = dict(os.environ)
        if stack_bytes is not None:
            self.env["BMOE_WORKER_STACK"] = str(stack_bytes)
        self.proc: subprocess.Popen[str] | None = None
        self.n_vocab = 0
        self.call_open: int | None = None

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(self.model)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=self.env)
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        self.n_vocab = hello["n_vocab"]
        self.call_open = hello["call_open"]
        return proc

    def compile(self, grammar: str, *, triggers: list[int] | None = None,
                steps: int = 1) -> Compiled:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"grammar": grammar, "triggers": triggers,
                                         "steps": steps}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        deadline = time.monotonic() + self.timeout_s
        while True:
            wait_s = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([proc.stdout], [], [], wait_s)
            if not ready:
                self.close()
                return Compiled(timed_out=True)
            line = proc.stdout.readline()
            if not line:
                return self._dead()
            if line.startswith("{"):
                return Compiled(**json.loads(line))
            # Anything else is llama.cpp dying loudly (ggml's abort prints a backtrace
            # through gdb on stdout): read on to the end of the stream.

    def _dead(self) -> Compiled:
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = self.proc.poll()
        self.close()
        return Compiled(crashed=True, returncode=code)

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

    def __enter__(self) -> GrammarChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
