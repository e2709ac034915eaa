"""``/api/hf/inspect``'s verdict: a model's probe set against this machine, in words.

Pure: ``Machine`` holds the figures (read by ``machine_now``), ``verdict`` turns a probe,
the model's size and those figures into the codes a UI colours by and the sentences it
shows as they are. Sizes in the sentences are MiB, rounded down.

What this process may hold (``residency_budget``, by ``bmoe.machine``) and what a
streamed model keeps resident (``probe.stream_floor``) are the figures the planner
(``bmoe/planner``) decides a load in auto mode with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..machine import memory_total, probe_memory
from .probe import ModelProbe, stream_floor

MIB = 1 << 20


@dataclass
class Machine:
    residency_budget: int = 0       # what this process may hold, measured now (0: unread)
    budget_if_loaded: int = 0       # the same once the loaded model is unloaded
    loaded_model: str = ""
    loaded_held: int = 0            # what the loaded model's plan charged (0: no plan)
    memory_total: int = 0
    disk_free: int = 0
    present_bytes: int = 0          # of this model, already in the models folder, complete

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def residency_budget() -> int:
    """What this process may hold, by the one memory probe (MemAvailable, or the
    memory cgroup's headroom when tighter, the tightest limit up to the root)."""
    return probe_memory().budget


def machine_now(*, loaded_model: str, disk_free: int, present_bytes: int,
                loaded_held: int = 0) -> Machine:
    budget = residency_budget()
    total = memory_total()
    if_loaded = budget + loaded_held if budget else 0
    if total:
        if_loaded = min(if_loaded, total)
    return Machine(budget, if_loaded, loaded_model, loaded_held, total, disk_free,
                   present_bytes)


def mib(n: int) -> int:
    return n // MIB


_NOT_A_MODEL = {
    "projector": "a multimodal projector: it lets a model see images, and is loaded beside "
                 "that model, never on its own",
    "draft": "a draft head for speculative decoding: it speeds up another model and cannot "
             "answer on its own",
    "other": "not a language model: its header names no layers to chat with",
}


def verdict(probe: ModelProbe, size: int, m: Machine) -> dict[str, Any]:
    need = max(0, size - m.present_bytes)
    disk_ok = need <= m.disk_free
    disk = (f"needs {mib(need)} MiB of disk; the models folder has {mib(m.disk_free)} MiB free"
            if need else f"all {mib(size)} MiB are already in the models folder")
    out: dict[str, Any] = {"downloadable": disk_ok, "disk": disk}
    if not probe.readable:
        out.update(mode="not readable", fit="unknown",
                   headline="Unknown: the model's header could not be read",
                   memory=f"its header could not be read ({probe.reason or 'no reason given'}), "
                          "so what it needs here is unknown")
        return _disk_first(out, disk_ok, need, m)
    if probe.role != "model":
        what = _NOT_A_MODEL.get(probe.role, _NOT_A_MODEL["other"])
        out.update(downloadable=False, mode="not a model", fit="not_a_model",
                   headline="Not a model: it cannot be chatted with",
                   memory=f"this file is {what}")
        return out
    if probe.streamable:
        out.update(mode="streams", **_streams(probe, m))
    else:
        out.update(mode="plain mmap", **_plain(probe, size, m))
    return _disk_first(out, disk_ok, need, m)


def _disk_first(out: dict[str, Any], disk_ok: bool, need: int, m: Machine) -> dict[str, Any]:
    if not disk_ok:
        out["fit"] = "no_disk"
        out["headline"] = (f"Not enough disk: it needs {mib(need)} MiB and the models folder "
                           f"has {mib(m.disk_free)} MiB free")
    return out


def _budget_words(m: Machine) -> str:
    words = f"the {mib(m.budget_if_loaded)} MiB this process may hold"
    if m.loaded_model and m.loaded_held:
        words += (f" once {m.loaded_model} is unloaded ({mib(m.loaded_held)} MiB of it is "
                  "that model's)")
    elif m.loaded_model:
        words += f" (measured with {m.loaded_model} loaded)"
    return words


def _streams(p: ModelProbe, m: Machine) -> dict[str, str]:
    floor = stream_floor(p)
    head = (f"the experts stream from flash and {mib(p.dense_bytes)} MiB stays resident, plus "
            f"a cache of at least one token cycle ({mib(p.token_cycle_bytes)} MiB)")
    if not m.budget_if_loaded:
        return {"fit": "unknown",
                "headline": "Unknown: the memory free here could not be read",
                "memory": head + "; the memory this process may hold could not be read"}
    if floor <= m.budget_if_loaded:
        return {"fit": "fits", "headline": "Fits here: the experts stream from flash",
                "memory": head + f"; that fits in {_budget_words(m)}, and the plan sizes the "
                                 "cache from the rest"}
    return {"fit": "will_not_fit",
            "headline": f"Will not fit: {mib(floor)} MiB must stay resident and this "
                        f"process may hold {mib(m.budget_if_loaded)} MiB",
            "memory": head + f"; that is more than {_budget_words(m)}"}


def _plain(p: ModelProbe, size: int, m: Machine) -> dict[str, str]:
    why = (f"this build does not stream its experts ({p.refusal})" if p.is_moe
           else "a dense model has no experts to stream")
    whole = p.dense_bytes + p.expert_bytes or size
    if m.budget_if_loaded and whole <= m.budget_if_loaded:
        rest = f"all {mib(whole)} MiB fit in {_budget_words(m)}"
    elif m.budget_if_loaded:
        rest = (f"its {mib(whole)} MiB are more than {_budget_words(m)}, so what does not "
                "fit is read from flash again as tokens need it, which is slow")
    else:
        rest = f"its {mib(whole)} MiB are mapped whole; the memory free here could not be read"
    return {"fit": "no_streaming",
            "headline": "Runs whole from the file: " + ("this build does not stream its experts"
                                                        if p.is_moe else "a dense model"),
            "memory": f"{why}, so it runs on plain mmap: {rest}"}
