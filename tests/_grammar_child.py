"""Drive tests/grammar_worker.py: grammars compiled by the real llama.cpp in a child.

A crash of llama.cpp ends the child, not the caller: `compile` then returns a result
with `crashed` set (and the signal), and the next call starts a fresh child.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from _child import WorkerChild

WORKER = Path(__file__).resolve().parent / "grammar_worker.py"


@dataclass
class Compiled:
    built: bool = False      # llama.cpp made a sampler of it
    steps: int = 0           # sampling steps that found an allowed token
    ms: float = 0.0          # build plus the steps, in the child
    crashed: bool = False    # the child died (its exit code in `returncode`)
    timed_out: bool = False
    returncode: int | None = None


class GrammarChild(WorkerChild):
    def __init__(self, model: Path, *, stack_bytes: int | None = None,
                 timeout_s: float = 60.0) -> None:
        env = {"BMOE_WORKER_STACK": str(stack_bytes)} if stack_bytes is not None else None
        super().__init__(WORKER, str(model), env=env, timeout_s=timeout_s)

    @property
    def n_vocab(self) -> int:
        self.started()
        return int(self.hello["n_vocab"])

    @property
    def call_open(self) -> int:
        self.started()
        return int(self.hello["call_open"])

    def compile(self, grammar: str, *, triggers: list[int] | None = None,
                steps: int = 1) -> Compiled:
        out = self.ask({"grammar": grammar, "triggers": triggers, "steps": steps})
        if out.crashed or out.timed_out:
            return Compiled(crashed=out.crashed, timed_out=out.timed_out,
                            returncode=out.returncode)
        return Compiled(**out.answer)

    def __enter__(self) -> GrammarChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
