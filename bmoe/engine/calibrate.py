"""Load-time calibration: the first answer measures the lossless knobs on this model.

The planner picks the compute thread count from a matmul probe and cannot know whether
overlapping reads with compute pays on this model, this disk and this load. Both change
only speed, never a token, so the engine can try them on real decoding: a plan that has
not measured them sets ``trial-threads`` (a second thread count) and ``trial-overlap``;
the session then decodes the first answer in alternating windows, one arm per window:

    arm 0: (threads, overlap)           the plan's own choice
    arm 1: (trial-threads, overlap)     when trial-threads differs
    arm 2: (threads, not overlap)       when trial-overlap and read-ahead runs

Each window is ``WINDOW_TOKENS`` decode steps; the first step after a switch warms the
new threads and the lanes and is not counted. Once every arm has ``WINDOWS_PER_ARM``
windows, the arm with the lowest median decode time wins, is applied for the rest of
the session, and the verdict is kept (``Trial.verdict``) for the planner: the server
writes it beside the model's routing record, and the next plan of that model reads the
two knobs from it instead of trying them again.

Pure bookkeeping: the session applies an arm (``llama_set_n_threads``, the streamer's
``overlap``) and reports each step's seconds; this module decides.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

WINDOW_TOKENS = 4          # decode steps per window, the first of them not counted
WINDOWS_PER_ARM = 3        # windows each arm decodes before the verdict
MIN_GAIN = 0.05            # another arm must be this much faster to replace the plan's


@dataclass(frozen=True)
class Arm:
    threads: int
    overlap: bool


@dataclass
class Trial:
    arms: list[Arm]
    times: list[list[float]] = field(default_factory=list)
    step: int = 0                       # decode steps seen so far
    verdict: dict[str, Any] | None = None
    kept: bool = False                  # the server wrote the verdict down

    def __post_init__(self) -> None:
        self.times = [[] for _ in self.arms]

    @classmethod
    def from_values(cls, values: dict[str, Any], *, can_overlap: bool) -> Trial | None:
        """The trial a load's values ask for, or None (nothing to try)."""
        threads = int(values.get("threads") or 1)
        overlap = bool(values.get("overlap"))
        arms = [Arm(threads, overlap)]
        other = int(values.get("trial-threads") or 0)
        if other > 0 and other != threads:
            arms.append(Arm(other, overlap))
        if values.get("trial-overlap") and can_overlap:
            arms.append(Arm(threads, not overlap))
        return cls(arms) if len(arms) > 1 else None

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def arm(self) -> Arm:
        """The arm the next decode step runs under (the winner once decided)."""
        if self.verdict is not None:
            return Arm(int(self.verdict["threads"]), bool(self.verdict["overlap"]))
        return self.arms[(self.step // WINDOW_TOKENS) % len(self.arms)]

    def record(self, seconds: float) -> None:
        """One decode step took `seconds` under ``arm()``."""
        if self.verdict is not None:
            return
        index = (self.step // WINDOW_TOKENS) % len(self.arms)
        if self.step % WINDOW_TOKENS:           # the first step of a window warms up
            self.times[index].append(seconds)
        self.step += 1
        rounds = self.step // (WINDOW_TOKENS * len(self.arms))
        if rounds >= WINDOWS_PER_ARM:
            self._decide()

    def _decide(self) -> None:
        medians = [statistics.median(t) for t in self.times]
        best = min(range(len(self.arms)), key=medians.__getitem__)
        if medians[best] > medians[0] * (1.0 - MIN_GAIN):
            best = 0                             # not clearly faster: keep the plan's
        win = self.arms[best]
        self.verdict = {
            "threads": win.threads, "overlap": win.overlap,
            "arms": [{"threads": a.threads, "overlap": a.overlap,
                      "s_per_token": round(m, 5), "tokens": len(t)}
                     for a, m, t in zip(self.arms, medians, self.times, strict=True)],
        }
