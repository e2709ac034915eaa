"""The plan's RPC helpers (`--rpc`): each one's memory, round trip and layers.

A helper is a `bmoe-server rpc-worker` on another machine (bmoe/engine/rpc.py). The plan
reaches each one the way a load does (TCP, the protocol's HELLO, its devices' memory),
times that exchange, and deals the model's last layers to the helpers by the memory they
report free, exactly as the load will (`rpc.split_by_memory`). A helper's compute rate
is not measured: the RPC protocol offers no way to time a matmul there without loading
layers onto it, so `token_ratio` stays 0 (unmeasured) and the rate text says so.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..engine import rpc

ROUND_TRIPS = 3     # HELLO exchanges timed per helper (the best one is kept)


def _timed_probe(endpoint: rpc.Endpoint) -> tuple[rpc.Helper, float]:
    best, helper = float("inf"), None
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter()
        helper = rpc.probe(endpoint, timeout=2.0)
        best = min(best, time.perf_counter() - t0)
    assert helper is not None
    return helper, best


def helper_rows(values: dict[str, Any], path: str | os.PathLike[str]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(devices rows, memory pools) for the helpers in values["rpc"]; ([], []) if none."""
    try:
        endpoints = rpc.parse_endpoints(str(values.get("rpc") or ""))
    except ValueError:
        return [], []
    reached: list[tuple[rpc.Helper, float]] = []
    rows: list[dict[str, Any]] = []
    for endpoint in endpoints:
        try:
            reached.append(_timed_probe(endpoint))
        except rpc.Unreachable as e:
            rows.append(_row(str(endpoint), 0, "unusable", "Unreachable", [],
                             f"The helper at {endpoint} did not answer: {e}.", 0.0))
    if not reached:
        return rows, []
    sizes = rpc.layer_bytes(path)
    split = rpc.split_by_memory([h for h, _ in reached], sizes)
    counts = iter(rpc._layers_per_device(split, len(sizes) - 1))
    first = len(sizes) - split.n_layers      # index of the first offloaded unit
    pools, out = [], []
    for helper, rtt in reached:
        for i, (free, total) in enumerate(helper.devices):
            n = next(counts, 0)
            held = sum(sizes[first:first + n])
            first += n
            name = f"{helper.endpoint}" + (f"#{i}" if len(helper.devices) > 1 else "")
            why = (f"Holds {n} of the model's {len(sizes) - 1} layers (and the output layer "
                   "if it is the last helper) in its own memory: the layers are dealt by "
                   f"the memory each helper reports free ({free >> 20} MiB here)."
                   if n else "Its free memory takes none of the model's layers.")
            out.append(_row(name, total, "used" if n else "unused",
                            f"{n} layers" if n else "No layers", ["layers"] if n else [],
                            why, rtt))
            if n:
                pools.append({"name": name, "label": f"Helper {name}",
                              "cap_bytes": int(free * rpc.HELPER_MEMORY_USE),
                              "lockable_cap_bytes": 0, "held_bytes": held,
                              "locked_bytes": 0,
                              "rows": [{"name": "layers", "label": f"{n} layers",
                                        "bytes": held, "locked": False, "in_turn": False}]})
    return out + rows, pools


def _row(name: str, total: int, status: str, badge: str, uses: list[str], why: str,
         rtt: float) -> dict[str, Any]:
    rate = (f"Round trip {rtt * 1000:.2f} ms (connect and handshake); compute rate not "
            "measured" if rtt else "Not measured")
    return {"name": name, "description": "an RPC helper (bmoe-server rpc-worker)",
            "cpu": False, "own_memory": True, "memory_total": total, "prompt_ratio": 0.0,
            "token_ratio": 0.0, "rate_text": rate, "round_trip_s": round(rtt, 6),
            "uses": uses, "status": status, "badge": badge, "why": why}
