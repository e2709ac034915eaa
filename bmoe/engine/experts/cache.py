"""Which experts are resident, and which to give back: one global cache, no I/O.

The cache holds *units* (layer, expert) and counts bytes against a budget. Bookkeeping
is a few numpy arrays indexed [layer, expert] (resident, last use, use frequency, ever
loaded, pinned), never a Python object per expert: a lookup is one fancy index, choosing
victims one pass in C over the units (`bmoe.native.cachepick`, which also does `reuse`'s
learning and scoring; numpy where it is not built) with their scores kept between choices
(a layer's row is scored again only when that layer is admitted or the table is remade).

`admit(layer, ids)` is called when the router of `layer` has chosen `ids` (every expert
some token of the batch routes to) and before the layer's expert matmuls run. It returns
the misses to read and the victims to release. The units of the current call are never
victims, so a layer's set is always whole; if that set alone exceeds the budget (a long
prefill batch routes to every expert of a layer) the cache overshoots for that layer and
sheds the excess at the next call. `admit_spec(layer, ids)` is a read-ahead's admission:
it never takes the units of the last `admit` (their layer may be computing), nor pinned
ones (a read still in flight), and it does not count as a hit or a miss.

Policies (`policy`):

* ``reuse`` (the default) evicts the unit least likely to be routed again within the next
  `_HORIZON` (4) visits of its layer, a chance it learns from the routing it has seen.
  Each unit has two features: `gap`, how many visits of its layer have passed since it
  was last routed, counted to its layer's next visit (1 .. 4, and 5 for 5 or more or
  never), and its level log2(count + 1), with `count` its use count decayed by
  `_COUNT_DECAY` per visit of its layer (about the last 256 tokens); its bucket is the
  level rounded (0 .. 7). At every `admit` the units of the layer update a table of
  hazards, [gap, bucket] -> routed / seen (a cell seen little leans on the overall rate,
  one pseudo-count); a unit's chance of use within `_HORIZON` visits is 1 - prod(1 - h)
  over the gaps it will pass through, interpolated between the two buckets around its
  level. The table is [6, 8]: learning is one bincount over the layer's row, scoring a
  few operations over the units (the chances per cell are remade once per token). Where
  read-ahead has guessed a unit, its guessed probability counts if higher. On recorded
  routing it reads fewer bytes than `next-use` and LRU at every size tried, still
  1.5-2.0x the offline optimum (Belady): docs/benchmarks.md has the table, and why no
  policy that sees only the past gets near.
* ``next-use`` evicts the unit whose next use is expected furthest away. Every token asks
  the layers in order, so a unit of layer l cannot be needed before the router of layer l
  runs again: `d` layers from now (1 for the next layer, n_layer for the layer just
  asked). With `p` the unit's estimated chance of being routed in a token (an
  exponentially decayed frequency, `decay` per token of its layer), its expected next use
  is `d + n_layer * (1/p - 1)` layers away.
* ``lru`` evicts the least recently used unit.
* ``lfu`` evicts the unit with the lowest decayed frequency (`decay` per token of its
  layer).

`NoCache` is `cache-mb 0`: every routed expert is read every time, into the same place;
what the layer used last time and does not use now is released, so the memory held is
about one token cycle. A prompt batch routes a layer to most of its experts: then the
other layers' sets are released too, as far as needed to hold no more than one token
cycle or that layer's set, whichever is larger (without that, a prefill left every layer
holding all of its experts: the whole model).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

POLICIES = ("reuse", "next-use", "lru", "lfu")
DEFAULT_POLICY = "reuse"
_DECAY = 0.2            # next-use / lfu: weight of the newest token in the use frequency
_P_MIN = 1e-3           # the use chance of a unit never routed
# reuse: the learned hazard table
_GAPS = 6               # visits since the last use: 1 .. 4, and 5 for 5 or more (or never)
_BUCKETS = 8            # log2(decayed use count + 1): 0 .. 7
_HORIZON = 4            # the chance of use within this many visits of the unit's layer
_COUNT_DECAY = 1.0 / 256
_TABLE_MAX = float(1 << 24)   # table weight beyond which old evidence is halved
PICK_ENV = "BMOE_CACHE_PICK"  # "python": the bookkeeping in numpy (the C parts' reference)


def native_pick() -> ModuleType | None:
    """The cache's C parts (`bmoe.native.cachepick`: the victim choice, `reuse`'s learning
    and scoring), or None where it is not built or `BMOE_CACHE_PICK=python` asks for numpy
    (the same decisions, slower)."""
    if os.environ.get(PICK_ENV, "").strip().lower() == "python":
        return None
    try:
        return importlib.import_module("bmoe.native.cachepick")
    except ImportError:
        return None


@dataclass
class Admission:
    misses: np.ndarray                   # expert ids of `layer` to read
    victims: list[tuple[int, int]] = field(default_factory=list)   # (layer, expert) to release
    hits: int = 0
    rereads: int = 0                     # misses that had been loaded before


class ExpertCache:
    """A global cache over (layer, expert) with a byte budget."""

    def __init__(self, unit_bytes: np.ndarray, n_expert: int, budget: int,
                 policy: str = DEFAULT_POLICY, decay: float = _DECAY) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}")
        self.unit_bytes = np.asarray(unit_bytes, dtype=np.int64)      # per layer
        n_layer = len(self.unit_bytes)
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.budget = int(budget)
        self.policy = policy
        self.decay = float(decay)
        self.resident = np.zeros((n_layer, n_expert), dtype=bool)
        self.stamp = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.freq = np.zeros((n_layer, n_expert), dtype=np.float64)
        self.loaded = np.zeros((n_layer, n_expert), dtype=bool)
        self.pinned = np.zeros((n_layer, n_expert), dtype=bool)     # reads in flight
        self._saved_pin = np.zeros((n_layer, n_expert), dtype=bool)  # admit_own's
        self.spec_p = np.zeros((n_layer, n_expert), dtype=np.float64)  # read ahead, unused
        self.bytes_of = np.repeat(self.unit_bytes[:, None], n_expert, axis=1)
        self.resident_bytes = 0
        self._min_unit = int(self.unit_bytes[self.unit_bytes > 0].min(initial=1 << 62))
        self._layer_of = np.repeat(np.arange(n_layer), n_expert)
        # reuse: visits of each layer, the visit of each unit's last use, decayed counts,
        # and the hazard table (routed, seen)
        self.visits = np.zeros(n_layer, dtype=np.int64)
        self.last_visit = np.full((n_layer, n_expert), -_GAPS, dtype=np.int64)
        self.count = np.zeros((n_layer, n_expert), dtype=np.float64)
        self.level = np.zeros((n_layer, n_expert), dtype=np.float64)  # log2(count + 1)
        self.bucket = np.zeros((n_layer, n_expert), dtype=np.int64)     # level, rounded
        self.hazard = np.zeros((2, _GAPS, _BUCKETS))   # [not routed, routed][gap, bucket]
        self._seen_total = 0.0
        self._within: np.ndarray | None = None    # the table's chances, once per token
        self._learned = 0                         # admits since `_within` was made
        # each unit's chance (`reuse_chance`), kept between victim choices: a unit's row
        # changes only when its layer is admitted (its gaps and levels) or the table is
        # remade, so only those rows are scored again
        self._chance = np.zeros((n_layer, n_expert), dtype=np.float64)
        self._stale = np.ones(n_layer, dtype=np.uint8)   # rows of `_chance` to score again
        self._pick = native_pick()
        # `reuse` with the C parts: an admission is one C call over these same arrays
        # (cachepick.Book), except when the table of chances is due to be remade
        self._book: Any = None
        self._miss_buf = np.zeros(n_expert, dtype=np.int64)
        if self._pick is not None and policy == "reuse" and n_layer and n_expert:
            self._book = self._pick.Book(
                self.resident, self.stamp, self.loaded, self.pinned, self.spec_p,
                self.bytes_of, self.unit_bytes, self.visits, self.last_visit, self.count,
                self.level, self.bucket, self.hazard, self._chance, self._stale,
                self._miss_buf, _GAPS, _BUCKETS, _COUNT_DECAY, self.budget, self._min_unit)
        self.tick = 0
        self.demand_tick = 0          # the tick of the last admit(): its units are in use
        self.last_layer = -1
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.rereads = 0

    @property
    def hit_pct(self) -> float:
        n = self.hits + self.misses
        return round(100.0 * self.hits / n, 2) if n else 0.0

    def _book_ready(self, ids: np.ndarray, learns: int) -> bool:
        """Whether this admission can be the one C call: `reuse` in C, ids no more than
        a layer has, and the table of chances not due to be remade by it (`learns`: the
        admits it learns from, before it chooses victims)."""
        return (self._book is not None and len(ids) <= self.n_expert
                and self._within is not None and self._learned + learns < self.n_layer)

    def admit(self, layer: int, ids: np.ndarray) -> Admission:
        self.tick += 1
        self.demand_tick = self.tick
        self.last_layer = layer
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self._book_ready(ids, 1):
            m, hits, rereads, victims, freed = self._book.admit(
                layer, ids, self.tick, self._within, self.resident_bytes)
            self._count_learned()
            adm = Admission(misses=self._miss_buf[:m].copy(), victims=victims, hits=hits,
                            rereads=rereads)
            self.resident_bytes += int(self.unit_bytes[layer]) * m - freed
            self.evictions += len(victims)
            self.hits += hits
            self.misses += m
            self.rereads += rereads
            return adm
        row = self.resident[layer]
        hit = row[ids]
        misses = ids[~hit]
        self.stamp[layer, ids] = self.tick
        if self.policy == "reuse":
            self._learn(layer, ids)
        else:
            self.freq[layer] *= 1.0 - self.decay
            self.freq[layer, ids] += self.decay
        self.spec_p[layer] = 0.0
        adm = Admission(misses=misses, hits=int(hit.sum()),
                        rereads=int(self.loaded[layer, misses].sum()))
        self._take(layer, misses, adm, protect_from=self.tick)
        self.hits += adm.hits
        self.misses += len(misses)
        self.rereads += adm.rereads
        return adm

    def admit_own(self, layer: int, ids: np.ndarray, share: int, spec: bool = False
                  ) -> Admission:
        """`admit` (with `spec`, `admit_spec`) whose victims are all of `layer` once it
        holds `share` units or more: its misses take over its own units' room, and the
        layer keeps its count (expert slots: a miss is read into a victim's slot in place,
        no pages moved). Below its share, room comes from the layers above theirs where
        they have it; else, or where the layer has too few units it may evict, the plain
        admission (victims anywhere). The other layers are pinned for the call (the C
        choice and numpy's both read the arrays as they are at the call)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self._pick is not None:
            mode = self._pick.own_pin(self.resident, self.pinned, self._saved_pin, layer,
                                      ids, share, self.n_expert)
        else:
            mode = self._own_pin(layer, ids, share)
        if mode == 0:
            return self.admit_spec(layer, ids) if spec else self.admit(layer, ids)
        real = self.resident_bytes
        if mode == 1:                  # the cache counted full: as many victims as misses
            self.resident_bytes = self.budget
        try:
            return self.admit_spec(layer, ids) if spec else self.admit(layer, ids)
        finally:
            np.copyto(self.pinned, self._saved_pin)
            if mode == 1:
                self.resident_bytes = real + (self.resident_bytes - self.budget)

    def admit_keeping(self, layer: int, ids: np.ndarray, keep: np.ndarray,
                      spec: bool = False) -> Admission:
        """`admit` (with `spec`, `admit_spec`) that takes no victim from the layers `keep`
        marks (a bool per layer; `layer` itself aside), where the other layers can make all
        the room its misses need; else the plain admission.

        A prompt's batches ask every layer for most of its experts in turn, layer after
        layer and batch after batch: a loop. On a loop longer than the cache, evicting the
        least recently (or least likely soon) used keeps only what is asked last, and every
        unit is read again at every pass; keeping a fixed part (here the first layers)
        makes that part a hit at every pass, as the offline optimum on a loop does. The
        kept layers are also the next prompt's first: it starts computing at once."""
        rows = np.asarray(keep, dtype=bool).copy()
        rows[layer] = False
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if rows.any() and (self.resident[rows] & ~self.pinned[rows]).any():
            miss = ~self.resident[layer, ids]
            if spec:
                miss &= ~self.pinned[layer, ids]
            over = self.resident_bytes + int(self.unit_bytes[layer]) * int(miss.sum()) \
                - self.budget
            room = True
            if over > 0:
                ok = self.resident & ~self.pinned
                if spec:                 # the last demand's units stay too
                    ok &= self.stamp < self.demand_tick
                ok[rows] = False
                ok[layer, ids] = False
                room = int(self.bytes_of[ok].sum()) >= over
            if room:
                np.copyto(self._saved_pin, self.pinned)
                self.pinned[rows] = True
                try:
                    return self.admit_spec(layer, ids) if spec else self.admit(layer, ids)
                finally:
                    np.copyto(self.pinned, self._saved_pin)
        return self.admit_spec(layer, ids) if spec else self.admit(layer, ids)

    def _own_pin(self, layer: int, ids: np.ndarray, share: int) -> int:
        """What `admit_own` does before its admission, in numpy (`cachepick.own_pin` is the
        same in C): `pinned` saved, then 1 (the layer holds its share and can evict as
        many units as `ids` miss: every other layer pinned), 2 (the layers above their
        share can: every other layer pinned) or 0 (nothing pinned)."""
        row = self.resident[layer]
        n_in = int(row.sum())
        hits = int(row[ids].sum())
        free = n_in - int((row & self.pinned[layer]).sum()) - hits   # evictable here
        np.copyto(self._saved_pin, self.pinned)
        if n_in >= share and free >= len(ids) - hits:
            self.pinned[:] = True
            self.pinned[layer] = self._saved_pin[layer]
            return 1
        over = self.resident.sum(axis=1) > share
        over[layer] = False
        if over.any() and int((self.resident[over] & ~self.pinned[over]).sum()) >= len(
                ids) - hits:
            self.pinned[~over] = True
            return 2
        return 0

    def admit_spec(self, layer: int, ids: np.ndarray, chance: float = 0.5) -> Admission:
        """Read-ahead of `ids` for `layer`: the ones not resident become misses, if room can
        be made without touching the last admit's units or pinned ones. Until `layer` is
        asked for, the next-use policy counts them as used with `chance`."""
        self.tick += 1
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self._book_ready(ids, 0):
            m, victims, freed = self._book.admit_spec(
                layer, ids, self.tick, self.demand_tick, chance, self._within,
                self.resident_bytes)
            self.resident_bytes += int(self.unit_bytes[layer]) * m - freed
            self.evictions += len(victims)
            return Admission(misses=self._miss_buf[:m].copy(), victims=victims)
        misses = ids[~self.resident[layer, ids] & ~self.pinned[layer, ids]]
        adm = Admission(misses=misses)
        if not len(misses):
            return adm
        need = int(self.unit_bytes[layer]) * len(misses)
        ok = None
        if self.resident_bytes + need > self.budget:
            # what may be evicted (the misses are not among it)
            if self._pick is not None:
                free = self._pick.evictable_bytes(self.resident, self.pinned, self.stamp,
                                                  self.demand_tick, self.bytes_of)
            else:
                ok = self._evictable(self.demand_tick)
                free = int(self.bytes_of.ravel()[ok].sum())
            if self.resident_bytes + need - free > self.budget:
                # not room for all: keep the first ones (the caller orders by confidence)
                room = self.budget - self.resident_bytes + free
                n = max(0, room // max(1, int(self.unit_bytes[layer])))
                misses = adm.misses = misses[:n]
                if not len(misses):
                    return adm
        self.stamp[layer, misses] = self.tick
        self.spec_p[layer, misses] = chance
        self._take(layer, misses, adm, protect_from=self.demand_tick, ok=ok)
        return adm

    def _take(self, layer: int, misses: np.ndarray, adm: Admission, protect_from: int,
              ok: np.ndarray | None = None) -> None:
        need = int(self.unit_bytes[layer]) * len(misses)
        over = self.resident_bytes + need - self.budget
        if over > 0:
            adm.victims = self._victims(over, protect_from, ok)
        self.resident[layer, misses] = True
        self.loaded[layer, misses] = True
        self.resident_bytes += need

    def _gap(self, rows: slice | int) -> np.ndarray:
        """Visits of their layer since the units' last use, counted to the next visit."""
        visits = self.visits[rows]
        if np.ndim(visits):
            visits = visits[:, None]
        return np.minimum(visits + 1 - self.last_visit[rows], _GAPS - 1)

    @property
    def hazard_hit(self) -> np.ndarray:
        """reuse: [gap, bucket] -> units seen there that were routed."""
        return self.hazard[1]

    @property
    def hazard_seen(self) -> np.ndarray:
        """reuse: [gap, bucket] -> units seen there."""
        return self.hazard[0] + self.hazard[1]

    def _learn(self, layer: int, ids: np.ndarray) -> None:
        """reuse: the layer's units tell the table whether their gap and bucket got routed
        (this runs at every admit: one C call, or a dozen numpy calls over the row)."""
        if self._pick is not None:
            self._pick.learn(np.ascontiguousarray(ids, dtype=np.int64), int(self.visits[layer]),
                             self.last_visit[layer], self.count[layer], self.level[layer],
                             self.bucket[layer], self.hazard, _GAPS, _BUCKETS, _COUNT_DECAY)
            self.visits[layer] += 1
            self._learned_one(layer)
            return
        cell = self._gap(layer) * _BUCKETS + self.bucket[layer]
        cell[ids] += _GAPS * _BUCKETS                       # the routed half of the table
        self.hazard.ravel()[:] += np.bincount(cell, minlength=2 * _GAPS * _BUCKETS)
        self.visits[layer] += 1
        self.last_visit[layer, ids] = self.visits[layer]
        count = self.count[layer]
        count *= 1.0 - _COUNT_DECAY
        count[ids] += 1.0
        level = np.minimum(np.log2(count + 1.0), _BUCKETS - 1)
        self.level[layer] = level
        self.bucket[layer] = (level + 0.5).astype(np.int64)
        self._learned_one(layer)

    def _learned_one(self, layer: int) -> None:
        self._stale[layer] = 1
        self._count_learned()

    def _count_learned(self) -> None:
        self._seen_total += self.n_expert
        if self._seen_total > _TABLE_MAX:           # a long session: old evidence halves
            self.hazard *= 0.5
            self._seen_total *= 0.5
        self._learned += 1

    def _within_table(self) -> np.ndarray:
        """[gap, bucket] -> the chance of use within `_HORIZON` visits: 1 - prod(1 - h)
        over gaps g .. g+H-1 (the last gap's hazard repeats past the end). Remade once
        every n_layer admits (a token); the table moves slowly."""
        if self._within is None or self._learned >= self.n_layer:
            # a cell seen little leans on the rate of all cells (one pseudo-count)
            hit, seen = self.hazard_hit, self.hazard_seen
            rate = (hit.sum() + 0.5) / (self._seen_total + 1.0)
            h = (hit + rate) / (seen + 1.0)
            log_miss = np.log(np.maximum(1.0 - h, 1e-12))
            cum = np.vstack([np.zeros((1, _BUCKETS)), np.cumsum(log_miss, axis=0)])
            g = np.arange(_GAPS)
            end = np.minimum(g + _HORIZON, _GAPS)
            beyond = (g + _HORIZON - end)[:, None] * log_miss[_GAPS - 1]
            within = 1.0 - np.exp(cum[end] - cum[g] + beyond)
            # one more bucket, a copy of the last: the interpolation's upper neighbour
            self._within = np.hstack([within, within[:, -1:]])
            self._learned = 0
            self._stale[:] = 1
        return self._within

    def reuse_chance(self) -> np.ndarray:
        """reuse: [n_layer, n_expert], each unit's chance of being routed within the next
        `_HORIZON` visits of its layer, from the learned table (the cache's own array,
        kept between calls: read it, do not write to it)."""
        within = self._within_table()
        stale = np.flatnonzero(self._stale)
        if len(stale) > 2:
            self._score_rows(slice(None), within)
        else:
            for layer in stale.tolist():
                self._score_rows(layer, within)
        self._stale[:] = 0
        return self._chance

    def _score_rows(self, rows: slice | int, within: np.ndarray) -> None:
        if self._pick is not None:
            self._pick.score(self._chance, self.last_visit, self.level, self.visits, within,
                             -1 if isinstance(rows, slice) else rows, _GAPS, _BUCKETS)
            return
        gap = self._gap(rows)
        # between two buckets' centres the chance is interpolated, so that units of one
        # cell are still ranked by their counts
        level = self.level[rows]
        lo = level.astype(np.int64)
        below = within[gap, lo]
        self._chance[rows] = below + (within[gap, lo + 1] - below) * (level - lo)

    def _keep_score(self) -> np.ndarray:
        """Higher is kept longer (flat, [n_layer * n_expert])."""
        if self.policy == "reuse":
            return np.maximum(self.reuse_chance(), self.spec_p).ravel()
        if self.policy == "lru":
            return self.stamp.ravel().astype(np.float64)
        p = np.maximum(np.maximum(self.freq, self.spec_p).ravel(), _P_MIN)
        if self.policy == "lfu":
            return p
        n = self.n_layer
        dist = (self._layer_of - self.last_layer - 1) % n + 1
        return -(dist + n * (1.0 / p - 1.0))

    def _evictable(self, protect_from: int) -> np.ndarray:
        return (self.resident & ~self.pinned & (self.stamp < protect_from)).ravel()

    def _victims(self, over: int, protect_from: int, ok: np.ndarray | None = None
                 ) -> list[tuple[int, int]]:
        """The resident units kept least (not protected) freeing >= `over` bytes (`ok`:
        the evictable mask, when the caller has it). Ranked by the policy's keep score,
        ties by last use (the older first), then by unit; at most k = over / the smallest
        unit are looked at. In C where it is built (one pass over the units with a heap of
        k), else the same choice in numpy."""
        k = -(-over // self._min_unit)
        if self._pick is not None:
            if self.policy == "reuse":
                keep, extra = self.reuse_chance(), self.spec_p
            elif self.policy == "lru":
                keep, extra = None, None
            else:
                keep, extra = self._keep_score(), None
            chosen, freed = self._pick.victims(keep, extra, self.resident, self.pinned,
                                               self.stamp, protect_from, self.bytes_of,
                                               over, k)
        else:
            chosen, freed = self._victims_numpy(over, protect_from, ok, k)
        if not chosen:
            return []
        self.resident.ravel()[chosen] = False
        self.resident_bytes -= freed
        self.evictions += len(chosen)
        n_expert = self.n_expert
        return [divmod(i, n_expert) for i in chosen]

    def _victims_numpy(self, over: int, protect_from: int, ok: np.ndarray | None, k: int
                       ) -> tuple[list[int], int]:
        # scored first, as the C pass is, even with nothing to evict: scoring may remake
        # `reuse`'s table of chances, and when it is remade decides later choices
        keep = self._keep_score()
        cand = np.flatnonzero(self._evictable(protect_from) if ok is None else ok)
        if not len(cand):
            return [], 0
        score = keep[cand]                     # ranked among the candidates only
        stamp = self.stamp.ravel()[cand]
        if k < len(cand):      # the k least kept, and every unit tied with the k-th
            edge = np.partition(score, k - 1)[k - 1]
            near = score <= edge
            cand, score, stamp = cand[near], score[near], stamp[near]
        order = cand[np.lexsort((cand, stamp, score))][:k]
        sizes = self.bytes_of.ravel()[order]
        cut = int(np.searchsorted(np.cumsum(sizes), over)) + 1
        return order[:cut].tolist(), int(sizes[:cut].sum())

    def fill(self) -> None:
        """Everything resident (load-all)."""
        self.resident[:] = True
        self.loaded[:] = True
        self.resident_bytes = int(self.bytes_of.sum())


class NoCache:
    """`cache-mb 0`: read every routed expert every time, into the same slots; hold at
    most max(`bound` bytes, the current layer's set)."""

    def __init__(self, n_layer: int, unit_bytes: np.ndarray, bound: int = 0) -> None:
        self.unit_bytes = np.asarray(unit_bytes, dtype=np.int64)
        self.last: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(n_layer)]
        self.bound = int(bound)
        self.resident_bytes = 0
        self.misses = 0

    def admit(self, layer: int, ids: np.ndarray) -> Admission:
        ids = np.asarray(ids, dtype=np.int64)
        stale = np.setdiff1d(self.last[layer], ids, assume_unique=True)
        self.resident_bytes += int(self.unit_bytes[layer]) * (len(ids) - len(self.last[layer]))
        self.last[layer] = ids
        self.misses += len(ids)
        victims = [(layer, int(e)) for e in stale]
        limit = max(self.bound, int(self.unit_bytes[layer]) * len(ids))
        others = sorted((i for i in range(len(self.last)) if i != layer and len(self.last[i])),
                        key=lambda i: -int(self.unit_bytes[i]) * len(self.last[i]))
        for other in others:         # the largest sets first: a batch's layers
            if self.resident_bytes <= limit:
                break
            victims += [(other, int(e)) for e in self.last[other]]
            self.forget(other)
        return Admission(misses=ids, victims=victims)

    def forget(self, layer: int) -> None:
        """The last reads of `layer` failed: nothing of it is held."""
        self.resident_bytes -= int(self.unit_bytes[layer]) * len(self.last[layer])
        self.last[layer] = np.zeros(0, dtype=np.int64)
