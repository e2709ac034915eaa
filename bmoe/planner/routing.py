"""Routing records: which experts a model's decoded tokens routed to, kept per model file.

Theory of operation
-------------------
Every streamed run of a model appends the routing of its decoded tokens (one row of
``n_expert_used`` ids per MoE layer per token, captured by the streamer) to one file per
model under ``<data>/routing/``; the newest ``KEEP_TOKENS`` tokens are kept. The planner
replays that routing through an LRU of the engine's shape (one unit per layer and expert)
to read the hit rate a cache of any size would earn on this model: the hit curve.

The file: a first line ``BMOE-ROUTING 1``, a JSON line (``model``, ``size``, ``n_layer``,
``n_expert``, ``n_expert_used``, ``tokens``), then ``tokens × n_layer × n_expert_used``
little-endian uint16 ids. A record is read as hostile: a wrong magic, a header that is
not that object, a shape that does not match the model, a body of the wrong length or an
id out of range, and the record is ignored with a warning (never an exception).

Beside it, ``<key>.cost.json`` keeps what decode measured after each complete turn, by
configuration (``cost_key``), for the next plan of the same configuration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomicfile
from ..engine.experts.cache import POLICIES, ExpertCache

log = logging.getLogger(__name__)

MAGIC = b"BMOE-ROUTING 1\n"
HEADER_CAP = 4096            # bytes of the JSON line
KEEP_TOKENS = 4096           # newest tokens kept per model
SIMULATE_TOKENS = 1024       # newest tokens replayed for a hit rate
MIN_TOKENS = 16              # fewer than this is no curve
COST_CAP = 64 * 1024         # bytes of a cost file
COST_KEEP = 32               # configurations kept per model


@dataclass
class RoutingRecord:
    model: str
    size: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    ids: np.ndarray              # [tokens, n_layer, n_expert_used] uint16

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


def model_key(path: str | os.PathLike[str], size: int) -> str:
    """The record's file stem: the model's name and a hash of where it is and its size."""
    real = os.path.realpath(path)
    digest = hashlib.sha256(f"{real}\0{size}".encode("utf-8", "surrogatepass")).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).name)[:80]
    return f"{stem}.{digest[:16]}"


def record_path(folder: Path, path: str | os.PathLike[str], size: int) -> Path:
    return folder / f"{model_key(path, size)}.routing"


def cost_path(folder: Path, path: str | os.PathLike[str], size: int) -> Path:
    return folder / f"{model_key(path, size)}.cost.json"


# --- reading and writing ----------------------------------------------------------------

def read_record(file: Path, *, size: int, n_layer: int, n_expert: int,
                n_expert_used: int) -> tuple[RoutingRecord | None, str]:
    """The record, or None and a warning (empty when there simply is none)."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, _warn(file, f"cannot be read ({e.strerror or 'input/output error'})")
    if not raw.startswith(MAGIC):
        return None, _warn(file, "is not a routing record")
    end = raw.find(b"\n", len(MAGIC), len(MAGIC) + HEADER_CAP)
    if end < 0:
        return None, _warn(file, "has no header line")
    try:
        head = json.loads(raw[len(MAGIC):end])
    except ValueError:
        return None, _warn(file, "has a header that is not JSON")
    problem = _check_header(head, size, n_layer, n_expert, n_expert_used)
    if problem:
        return None, _warn(file, problem)
    body = raw[end + 1:]
    tokens = head["tokens"]
    if len(body) != tokens * n_layer * n_expert_used * 2:
        return None, _warn(file, f"is truncated or padded: {len(body)} bytes of routing for "
                           f"{tokens} tokens")
    ids = np.frombuffer(body, dtype="<u2").reshape(tokens, n_layer, n_expert_used)
    if ids.size and int(ids.max()) >= n_expert:
        return None, _warn(file, "names an expert the model does not have")
    return RoutingRecord(str(head["model"]), size, n_layer, n_expert, n_expert_used,
                         ids.astype(np.uint16)), ""


def _check_header(head: Any, size: int, n_layer: int, n_expert: int,
                  n_expert_used: int) -> str:
    if not isinstance(head, dict):
        return "has a header that is not an object"
    want = {"size": size, "n_layer": n_layer, "n_expert": n_expert,
            "n_expert_used": n_expert_used}
    for key, value in want.items():
        got = head.get(key)
        if not isinstance(got, int) or isinstance(got, bool) or got != value:
            return f"was made for another model ({key} {got!r}, this one {value})"
    tokens = head.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= KEEP_TOKENS:
        return "claims an impossible number of tokens"
    if not isinstance(head.get("model"), str):
        return "names no model"
    return ""


def _warn(file: Path, what: str) -> str:
    message = f"the routing record {file.name} {what}; it is ignored"
    log.warning("%s", message)
    return message


def append_record(file: Path, rows: list[np.ndarray], *, model: str, size: int,
                  n_layer: int, n_expert: int, n_expert_used: int) -> int:
    """Add decoded tokens' routing to the model's record; returns the tokens kept.

    Rows of another shape are skipped; a record that does not read is replaced.
    """
    new = [r for r in rows if getattr(r, "shape", None) == (n_layer, n_expert_used)]
    if not new:
        return 0
    old, _ = read_record(file, size=size, n_layer=n_layer, n_expert=n_expert,
                         n_expert_used=n_expert_used)
    fresh = np.clip(np.stack(new), 0, n_expert - 1).astype("<u2")
    ids = fresh if old is None else np.concatenate([old.ids.astype("<u2"), fresh])
    ids = ids[-KEEP_TOKENS:]
    head = {"model": model, "size": size, "n_layer": n_layer, "n_expert": n_expert,
            "n_expert_used": n_expert_used, "tokens": int(ids.shape[0])}
    _write_atomically(file, MAGIC + json.dumps(head).encode() + b"\n" + ids.tobytes())
    return int(ids.shape[0])


def _write_atomically(file: Path, data: bytes) -> None:
    atomicfile.write_bytes(file, data)


# --- the hit curve -------------------------------------------------------------------------

def lru_hit_rate(record: RoutingRecord, capacity_units: int) -> float:
    """The fraction of routed (layer, expert) lookups an LRU of ``capacity_units`` hits,
    over the newest tokens, after a warm-up of a quarter of them (at most 64)."""
    ids = record.ids[-SIMULATE_TOKENS:]
    if capacity_units <= 0 or ids.shape[0] < MIN_TOKENS:
        return 0.0
    warm = min(64, ids.shape[0] // 4)
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = lookups = 0
    for t, token in enumerate(ids.tolist()):
        for layer, experts in enumerate(token):
            for e in set(experts):
                unit = (layer, e)
                hit = unit in lru
                if hit:
                    lru.move_to_end(unit)
                else:
                    lru[unit] = None
                    if len(lru) > capacity_units:
                        lru.popitem(last=False)
                if t >= warm:
                    lookups += 1
                    hits += hit
    return hits / lookups if lookups else 0.0


POLICY_TOKENS = 256          # newest tokens replayed through the engine's own cache


def policy_hit_rate(record: RoutingRecord, capacity_units: int, policy: str) -> float:
    """The fraction of routed lookups the engine's own cache (`ExpertCache`, with the
    session's replacement policy: same admissions, same victims) hits at
    ``capacity_units``, over the newest POLICY_TOKENS tokens once the cache is full.
    The default policy learns reuse from the routing, so it hits more than an LRU of the
    same size (44 % against LRU's 41 % at the smallest cap of bench/plan_accuracy.py);
    LRU is kept for ``lru`` and as the fallback."""

    ids = record.ids[-POLICY_TOKENS:]
    if capacity_units <= 0 or ids.shape[0] < MIN_TOKENS:
        return 0.0
    if policy == "lru" or policy not in POLICIES:
        return lru_hit_rate(record, capacity_units)
    n_tok, n_layer, _ = ids.shape
    cache = ExpertCache(np.ones(n_layer, dtype=np.int64), record.n_expert, capacity_units,
                        policy)
    # counted from the token the cache is full at: the steady decode the plan prices
    # (a cache still filling misses everything it has not seen); the earlier warm-up
    # when the record ends before that leaves MIN_TOKENS
    full = n_tok
    counts: list[tuple[int, int]] = []
    for t in range(n_tok):
        hits = lookups = 0
        for layer in range(n_layer):
            routed = np.unique(ids[t, layer])
            adm = cache.admit(layer, routed)
            lookups += len(routed)
            hits += len(routed) - len(adm.misses)
        counts.append((hits, lookups))
        if full == n_tok and cache.resident_bytes >= 0.95 * capacity_units:
            full = t + 1
    warm = full if n_tok - full >= MIN_TOKENS else min(64, n_tok // 4)
    hits = sum(h for h, _ in counts[warm:])
    lookups = sum(n for _, n in counts[warm:])
    return hits / lookups if lookups else 0.0


def hit_curve(record: RoutingRecord, unit_bytes: int, budgets: list[int]) -> list[float]:
    return [lru_hit_rate(record, b // unit_bytes if unit_bytes else 0) for b in budgets]


DEFAULT_CURVE_EXPONENT = 0.35


def default_hit_rate(cache_bytes: int, expert_bytes: int, token_cycle: int) -> float:
    """The stated default curve without a record: the cache's share of the experts to
    the power 0.35 (skewed routing hits more often than the share: the 24-layer
    benchmark MoE hit 58-70 % with 25-33 % of its experts cached, share^0.32-0.39; the
    12-layer one of bench/plan_accuracy.py 43.5 % / 55.8 % / 66.8 % with 7 / 14 / 45 %,
    share^0.30-0.51), none below one token cycle."""
    if cache_bytes < token_cycle or expert_bytes <= 0:
        return 0.0
    share = min(1.0, cache_bytes / expert_bytes)
    return float(share ** DEFAULT_CURVE_EXPONENT)


# --- measured decode cost ------------------------------------------------------------------

def cost_key(values: dict[str, Any]) -> str:
    """The configuration a measured decode cost belongs to."""
    parts = [str(values.get(k)) for k in ("moe-stream", "cache-mb", "threads", "io-threads",
                                          "ctx-size", "dense-weights")]
    return "|".join(parts)


def _read_json(file: Path, cap: int, what: str) -> tuple[Any, str]:
    """A small JSON file kept beside the record: (data, ""), or (None, a warning; empty
    when the file is simply not there)."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, _warn(file, f"cannot be read ({e.strerror or 'input/output error'})")
    if len(raw) > cap:
        return None, _warn(file, f"is larger than {what} can be")
    try:
        data = json.loads(raw)
    except ValueError:
        return None, _warn(file, "is not JSON")
    return (data, "") if data is not None else (None, _warn(file, f"is not {what}"))


def read_costs(file: Path) -> tuple[dict[str, dict[str, float]], str]:
    data, warning = _read_json(file, COST_CAP, "a cost record")
    if data is None:
        return {}, warning
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        return {}, _warn(file, "is not a cost record")
    out: dict[str, dict[str, float]] = {}
    for key, row in data["configs"].items():
        if isinstance(key, str) and isinstance(row, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
                for v in row.values()):
            out[key] = {k: float(v) for k, v in row.items() if isinstance(k, str)}
    return out, ""


def write_cost(file: Path, key: str, row: dict[str, float]) -> None:
    costs, _ = read_costs(file)
    costs.pop(key, None)
    costs[key] = {**row, "at": time.time()}
    while len(costs) > COST_KEEP:
        costs.pop(next(iter(costs)))
    _write_atomically(file, json.dumps({"configs": costs}, indent=1).encode())


# --- the first answer's calibration (bmoe/engine/calibrate.py) ----------------------------

TRIAL_CAP = 16 * 1024        # bytes of a trial verdict file


def trial_path(folder: Path, path: str | os.PathLike[str], size: int) -> Path:
    return folder / f"{model_key(path, size)}.trial.json"


def read_trial(file: Path) -> tuple[dict[str, Any] | None, str]:
    """The kept calibration verdict: ``{threads, overlap, arms, threads_measured,
    overlap_measured}``, or None (and a warning when the file is there but unusable)."""
    data, warning = _read_json(file, TRIAL_CAP, "a calibration verdict")
    if data is None:
        return None, warning
    arms = data.get("arms") if isinstance(data, dict) else None
    if not isinstance(arms, list) or not arms or not all(
            isinstance(a, dict) and type(a.get("threads")) is int and a["threads"] > 0
            and isinstance(a.get("overlap"), bool)
            and isinstance(a.get("s_per_token"), (int, float)) for a in arms) \
            or type(data.get("threads")) is not int or data["threads"] <= 0 \
            or not isinstance(data.get("overlap"), bool):
        return None, _warn(file, "is not a calibration verdict")
    return {"threads": data["threads"], "overlap": data["overlap"], "arms": arms,
            "threads_measured": len({a["threads"] for a in arms}) > 1,
            "overlap_measured": len({a["overlap"] for a in arms}) > 1}, ""


def write_trial(file: Path, verdict: dict[str, Any]) -> None:
    _write_atomically(file, json.dumps({**verdict, "at": time.time()}, indent=1).encode())
