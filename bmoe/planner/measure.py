"""One measurement: probe the model, the compute, the storage and the memory, then plan.

``measure(...)`` is blocking (a second or two of reads and matmuls) and is run in a
worker thread by the server and inline by the CLI. ``progress(step, label, index,
count)`` is called as each stage begins: the ``plan_progress`` events.

The matmul probe runs llama.cpp's CPU backend, whose OpenMP build gives every thread
that starts a graph a team of worker threads that lives as long as the process. A
second team (the probe's, beside the decoding thread's) makes more OpenMP threads than
cores, and then (most likely through libgomp's throttled spinning) a decode's hundreds of
barriers each sleep and wake, measured here at 0.019 s/token against 0.012 on a 2-core machine. So a
caller that decodes on another thread passes ``compute_on``, which runs the probe there
(the server: on its engine thread).
"""

from __future__ import annotations

import os
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable

from .helpers import helper_rows
from .plan import Plan, PlanInputs, make_plan
from .probes import (
    ComputeFacts,
    ModelFacts,
    StorageFacts,
    model_facts,
    probe_compute,
    probe_memory,
    probe_storage,
)
from .routing import (cost_path, read_costs, read_record, read_trial, record_path,
                      trial_path)

Progress = Callable[[str, str, int, int], None]

STEPS = (("model", "Reading the model's header"),
         ("compute", "Measuring the matmul speed"),
         ("storage", "Measuring the storage speed"),
         ("memory", "Reading the memory this process may hold"),
         ("rules", "Deciding the settings"))


class PlanError(Exception):
    """Nothing to plan (no model, or a file that is not one); the message is a sentence."""


def measure(path: str | os.PathLike[str], values: dict[str, Any], user_keys: list[str], *,
            routing_dir: Path | None, loaded_held: int = 0, loaded_model: str = "",
            progress: Progress | None = None,
            cancel: threading.Event | None = None,
            cached: tuple[ComputeFacts, StorageFacts] | None = None,
            compute_on: Callable[[Callable[[], ComputeFacts]], ComputeFacts] | None = None
            ) -> Plan:
    def step(i: int) -> None:
        if progress is not None:
            progress(STEPS[i][0], STEPS[i][1], i, len(STEPS))

    step(0)
    facts = model_facts(path)
    _check_model(facts)
    step(1)
    if cached:
        compute = cached[0]
    elif compute_on is not None:
        compute = compute_on(partial(probe_compute, facts, cancel=cancel))
    else:
        compute = probe_compute(facts, cancel=cancel)
    step(2)
    storage = cached[1] if cached else probe_storage(
        facts, cancel=cancel, huge_pages=bool(values.get("huge-pages", False)))
    step(3)
    memory = probe_memory(loaded_held)
    step(4)
    record: Any = None
    warning, costs = "", dict[str, Any]()
    if routing_dir is not None:
        record, warning, costs = read_history(routing_dir, facts)
    trial = None
    if routing_dir is not None:
        trial, trial_warning = read_trial(trial_path(routing_dir, facts.path, facts.size))
        warning = warning or trial_warning
    plan = make_plan(PlanInputs(facts, memory, storage, compute, dict(values),
                                list(user_keys), record, warning, costs, loaded_model, trial))
    plan.helpers, plan.helper_pools = helper_rows(values, path)
    return plan


def _check_model(facts: ModelFacts) -> None:
    p = facts.probe
    if not p.readable:
        why = p.reason or "its header could not be read"
        raise PlanError(f"{facts.name} cannot be planned for: {why}.")
    if p.role != "model":
        raise PlanError(f"{facts.name} is not a model to chat with, so there is nothing to "
                        "plan.")


def read_history(folder: Path, facts: ModelFacts) -> tuple[Any, str, dict[str, Any]]:
    """The model's routing record (or a warning) and its measured decode costs."""
    p = facts.probe
    record, warning = None, ""
    if p.is_moe and p.n_moe_layer and p.n_expert_used:
        record, warning = read_record(record_path(folder, facts.path, facts.size),
                                      size=facts.size, n_layer=p.n_moe_layer,
                                      n_expert=p.n_expert, n_expert_used=p.n_expert_used)
    costs, cost_warning = read_costs(cost_path(folder, facts.path, facts.size))
    return record, warning or cost_warning, costs
