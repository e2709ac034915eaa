"""`n` choices of one prompt (`/v1/chat/completions`, `/v1/completions`).

Theory of operation
-------------------
The server has one session, so n choices are n turns run one after another (by
`serving.serve`), each with its own encoder (its choice's `index`). Choice i samples
with the request's seed plus i (a random seed stays random), so choice 0 is what
`n: 1` answers and a seeded request repeats. A `Tally` shared by the encoders counts
the usage: the prompt once, every choice's completion tokens. A stream is one SSE
body: each choice's chunks in turn, and only the last encoder ends it (usage,
`[DONE]`); an error ends it at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...engine.sampling import SEED_RANDOM, Sampling
from ...engine.turn import TurnRequest
from ...http.errors import invalid_request
from ...runtime.turnevents import Finished

N_CHOICES_MAX = 16               # the turn line's waiting places


class Tally:
    """What the choices of one request share: the usage and whether one failed."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.failed = False

    def count(self, fin: Finished) -> None:
        if not self.prompt_tokens:
            self.prompt_tokens, self.cached_tokens = fin.n_prompt, fin.n_cached
        self.completion_tokens += fin.n_output

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def read_n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= N_CHOICES_MAX:
        raise invalid_request(f"`n` must be an integer from 1 to {N_CHOICES_MAX}.")
    return n


def seeded(req: TurnRequest, n: int, sampling: Sampling) -> list[TurnRequest]:
    """n copies of `req`, choice i sampling with the seed plus i."""
    if sampling.seed == SEED_RANDOM:
        return [replace(req, sampling=sampling) for _ in range(n)]
    return [replace(req, sampling=sampling.with_seed((sampling.seed + i) % SEED_RANDOM))
            for i in range(n)]
