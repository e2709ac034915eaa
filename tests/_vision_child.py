"""Drive tests/vision_worker.py: images read by the real libmtmd in a child process.

A crash ends the child, not the caller: `read` then returns a result with `crashed`
set (and the exit code), and the next call starts a fresh child.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from _child import WorkerChild

WORKER = Path(__file__).resolve().parent / "vision_worker.py"


@dataclass
class Read:
    ok: bool = False
    refused: str = ""
    crashed: bool = False
    timed_out: bool = False
    returncode: int | None = None


class VisionChild(WorkerChild):
    def __init__(self, model: Path, timeout_s: float = 60.0) -> None:
        super().__init__(WORKER, str(model), timeout_s=timeout_s)

    def read(self, url: str) -> Read:
        out = self.ask({"url": url})
        if out.crashed or out.timed_out:
            return Read(crashed=out.crashed, timed_out=out.timed_out, returncode=out.returncode)
        return Read(**out.answer)
