"""Which experts are resident, and which to give back: one global LRU, no I/O.

The cache holds *units* (layer, expert) and counts bytes against a budget. Bookkeeping
is a few numpy arrays indexed [layer, expert] (resident, last use, ever loaded), never a
Python object per expert: a lookup is one fancy index, choosing victims one
`argpartition` over the stamps.

`admit(layer, ids)` is called when the router of `layer` has chosen `ids` (every expert
some token of the batch routes to) and before the layer's expert matmuls run. It returns
the misses to read and the victims to release. The units of the current call are never
victims, so a layer's set is always whole; if that set alone exceeds the budget (a long
prefill batch routes to every expert of a layer) the cache overshoots for that layer and
sheds the excess at the next call.

`NoCache` is `cache-mb 0`: every routed expert is read every time, into the same place;
what the layer used last time and does not use now is released, so the memory held is
about one token cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_NEVER = np.iinfo(np.int64).max   # the stamp of a unit that may not be evicted


@dataclass
class Admission:
    misses: np.ndarray                   # expert ids of `layer` to read
    victims: list[tuple[int, int]] = field(default_factory=list)   # (layer, expert) to release
    hits: int = 0
    rereads: int = 0                     # misses that had been loaded before


class ExpertCache:
    """Global LRU over (layer, expert) with a byte budget."""

    def __init__(self, unit_bytes: np.ndarray, n_expert: int, budget: int) -> None:
        self.unit_bytes = np.asarray(unit_bytes, dtype=np.int64)      # per layer
        n_layer = len(self.unit_bytes)
        self.n_expert = n_expert
        self.budget = int(budget)
        self.resident = np.zeros((n_layer, n_expert), dtype=bool)
        self.stamp = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.loaded = np.zeros((n_layer, n_expert), dtype=bool)
        self.bytes_of = np.repeat(self.unit_bytes[:, None], n_expert, axis=1)
        self.resident_bytes = 0
        self._min_unit = int(self.unit_bytes[self.unit_bytes > 0].min(initial=1 << 62))
        self.tick = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.rereads = 0

    @property
    def hit_pct(self) -> float:
        n = self.hits + self.misses
        return round(100.0 * self.hits / n, 2) if n else 0.0

    def admit(self, layer: int, ids: np.ndarray) -> Admission:
        self.tick += 1
        ids = np.asarray(ids, dtype=np.int64)
        row = self.resident[layer]
        hit = row[ids]
        misses = ids[~hit]
        self.stamp[layer, ids] = self.tick
        adm = Admission(misses=misses, hits=int(hit.sum()),
                        rereads=int(self.loaded[layer, misses].sum()))
        need = int(self.unit_bytes[layer]) * len(misses)
        over = self.resident_bytes + need - self.budget
        if over > 0:
            adm.victims = self._victims(over)
        row[misses] = True
        self.loaded[layer, misses] = True
        self.resident_bytes += need
        self.hits += adm.hits
        self.misses += len(misses)
        self.rereads += adm.rereads
        return adm

    def _victims(self, over: int) -> list[tuple[int, int]]:
        """The least recently used resident units (not this call's) freeing >= `over` bytes."""
        stamps = np.where(self.resident, self.stamp, _NEVER).ravel()
        stamps[stamps == self.tick] = _NEVER
        n_cand = int(np.count_nonzero(stamps != _NEVER))
        if n_cand == 0:
            return []
        k = min(n_cand, -(-over // self._min_unit))
        part = np.argpartition(stamps, k - 1)[:k] if k < stamps.size else np.arange(stamps.size)
        order = part[np.argsort(stamps[part], kind="stable")]
        sizes = self.bytes_of.ravel()[order]
        cut = int(np.searchsorted(np.cumsum(sizes), over)) + 1
        chosen = order[:cut]
        self.resident.ravel()[chosen] = False
        self.resident_bytes -= int(sizes[:cut].sum())
        self.evictions += len(chosen)
        n_expert = self.n_expert
        return [divmod(i, n_expert) for i in chosen.tolist()]

    def fill(self) -> None:
        """Everything resident (load-all)."""
        self.resident[:] = True
        self.loaded[:] = True
        self.resident_bytes = int(self.bytes_of.sum())


class NoCache:
    """`cache-mb 0`: read every routed expert every time, into the same slots."""

    def __init__(self, n_layer: int, unit_bytes: np.ndarray) -> None:
        self.unit_bytes = np.asarray(unit_bytes, dtype=np.int64)
        self.last: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(n_layer)]
        self.resident_bytes = 0
        self.misses = 0

    def admit(self, layer: int, ids: np.ndarray) -> Admission:
        ids = np.asarray(ids, dtype=np.int64)
        stale = np.setdiff1d(self.last[layer], ids, assume_unique=True)
        self.resident_bytes += int(self.unit_bytes[layer]) * (len(ids) - len(self.last[layer]))
        self.last[layer] = ids
        self.misses += len(ids)
        return Admission(misses=ids, victims=[(layer, int(e)) for e in stale])

    def forget(self, layer: int) -> None:
        """The last reads of `layer` failed: nothing of it is held."""
        self.resident_bytes -= int(self.unit_bytes[layer]) * len(self.last[layer])
        self.last[layer] = np.zeros(0, dtype=np.int64)
