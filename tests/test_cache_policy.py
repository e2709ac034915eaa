"""The expert cache's `reuse` policy, without I/O: its learned table against hand-computed
values, its choices against LRU's, and the units it may never take (pinned reads, the
layer in use)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmoe.engine.experts.cache import DEFAULT_POLICY, POLICIES, ExpertCache


def test_reuse_is_the_default() -> None:
    assert DEFAULT_POLICY == "reuse" and "reuse" in POLICIES
    assert ExpertCache(np.array([1]), n_expert=2, budget=2).policy == "reuse"


def test_reuse_table_and_chances_by_hand() -> None:
    # one layer, two experts; expert 0 routed at three visits in a row, expert 1 never
    c = ExpertCache(np.array([1]), n_expert=2, budget=2, policy="reuse")
    for _ in range(3):
        c.admit(0, np.array([0]))
    # visit 1: both never used (gap 5, bucket 0), expert 0 routed: (5, 0) 1 of 2.
    # Expert 0's decayed count is then 1 (bucket rint(log2 2) = 1), then 1 + 255/256
    # (bucket rint(log2 2.996) = 2): at visit 2 it is routed from (1, 1), at visit 3 from
    # (1, 2); expert 1 adds an unrouted (5, 0) each time: 1 of 4.
    assert c.hazard_hit[5, 0] == 1 and c.hazard_seen[5, 0] == 4
    assert c.hazard_hit[1, 1] == c.hazard_seen[1, 1] == 1
    assert c.hazard_hit[1, 2] == c.hazard_seen[1, 2] == 1
    assert c.hazard_seen.sum() == 6 and c.hazard_hit.sum() == 3
    assert c.count[0, 0] == pytest.approx(1 + (1 + 255 / 256) * 255 / 256)
    assert c.bucket[0].tolist() == [2, 0]
    # one pseudo-count at the overall rate (3 + 0.5) / (6 + 1) = 0.5 in every cell:
    # h(5, 0) = 1.5 / 5 = 0.3, h(1, 1) = h(1, 2) = 1.5 / 2 = 0.75, unseen cells 0.5
    chance = c.reuse_chance()
    # expert 0: level log2(3.988) between buckets 1 and 2, both 1 - (1 - 0.75) * 0.5^3
    # over gaps 1..4
    assert chance[0, 0] == pytest.approx(1 - 0.25 * 0.5 ** 3)
    # expert 1: gap 5 (5 or more) for all 4 visits -> 1 - (1 - 0.3)^4
    assert chance[0, 1] == pytest.approx(1 - 0.7 ** 4)


def periodic_and_fresh(policy: str) -> ExpertCache:
    """Expert 0 of one layer routed every third visit; between, experts never seen again."""
    c = ExpertCache(np.array([1]), n_expert=16, budget=3, policy=policy)
    for i in range(12):
        c.admit(0, np.array([0 if i % 3 == 0 else i]))
    return c


def test_reuse_keeps_the_periodic_expert_that_lru_gives_up() -> None:
    reuse, lru = periodic_and_fresh("reuse"), periodic_and_fresh("lru")
    assert reuse.resident[0, [0, 10, 11]].all() and lru.resident[0, [0, 10, 11]].all()
    chance = reuse.reuse_chance()
    assert chance[0, 0] > 0.5 > 0.3 > max(chance[0, 10], chance[0, 11])
    assert lru.admit(0, np.array([13])).victims == [(0, 0)]     # the least recent
    victims = reuse.admit(0, np.array([13])).victims
    assert len(victims) == 1 and victims[0] in [(0, 10), (0, 11)]
    assert reuse.resident[0, 0]


def test_reuse_keeps_every_layers_every_token_experts() -> None:
    # two layers asked in turn; in each, expert 0 is routed every token and expert 1 once
    c = ExpertCache(np.array([1, 1]), n_expert=4, budget=4, policy="reuse")
    for _ in range(4):
        c.admit(0, np.array([0]))
        c.admit(1, np.array([0]))
    c.admit(0, np.array([0, 1]))
    c.admit(1, np.array([0, 1]))
    adm = c.admit(0, np.array([0, 2]))      # 5 units for 4: one must go
    assert len(adm.victims) == 1 and adm.victims[0] in [(0, 1), (1, 1)]   # a one-off
    assert c.resident[1, 0] and c.resident[0, 0]


def test_reuse_never_takes_pinned_units_or_the_layer_in_use() -> None:
    rng = np.random.default_rng(7)
    n_layer, n_expert, k = 4, 16, 3
    c = ExpertCache(np.full(n_layer, 2), n_expert=n_expert, budget=2 * 20, policy="reuse")
    for t in range(200):
        for layer in range(n_layer):
            if rng.random() < 0.3:             # a read ahead still in flight somewhere
                c.pinned[:] = False
                pin = rng.integers(0, n_layer), rng.integers(0, n_expert)
                if c.resident[pin]:
                    c.pinned[pin] = True
            ids = np.unique(rng.choice(n_expert, size=k, replace=False,
                                       p=np.arange(1, n_expert + 1) / (n_expert * 8.5)))
            adm = c.admit(layer, ids)
            for v in adm.victims:
                assert not c.pinned[v], f"token {t}: pinned unit {v} evicted"
                assert v[0] != layer or v[1] not in ids
                assert not c.resident[v]
            assert c.resident[layer, ids].all()
            assert c.resident_bytes == 2 * int(c.resident.sum()) <= c.budget
    assert c.evictions > 100


def test_reuse_read_ahead_spares_the_layer_in_use_and_reads_in_flight() -> None:
    c = ExpertCache(np.array([1, 1]), n_expert=4, budget=4, policy="reuse")
    c.admit(1, np.array([2, 3]))
    c.admit(0, np.array([0, 1]))             # layer 0 is computing
    c.pinned[1, 2] = True                    # a read of (1,2) still in flight
    adm = c.admit_spec(1, np.array([0, 1]), chance=0.9)
    assert adm.victims == [(1, 3)] and adm.misses.tolist() == [0]   # room for one only
    assert c.resident[0, [0, 1]].all() and c.resident[1, 2]
    # the guess counts as its chance of use until layer 1 is asked
    assert c._keep_score().reshape(2, 4)[1, 0] >= 0.9


def test_reuse_sheds_a_prefill_overshoot_at_the_next_call() -> None:
    c = ExpertCache(np.array([1, 1]), n_expert=8, budget=6, policy="reuse")
    c.admit(0, np.arange(8))                 # a long prompt routes to every expert
    assert c.resident_bytes == 8             # the layer's set is never split
    adm = c.admit(1, np.array([0]))
    assert len(adm.victims) == 3 and all(layer == 0 for layer, _ in adm.victims)
    assert c.resident_bytes == 6


def test_reuse_ranks_units_of_one_cell_by_their_counts() -> None:
    c = ExpertCache(np.array([1]), n_expert=4, budget=4, policy="reuse")
    for i in range(16):                       # expert 1 routed 15 times, expert 0 11 times
        c.admit(0, np.array([e for e in (0, 1) if i >= (5, 1)[e]], dtype=np.int64))
    assert c.bucket[0, 0] == c.bucket[0, 1] == 4      # one cell of the table (gap 1)
    # a table by hand: the hazard of bucket b is b / 10 at every gap, seen 10^6 times
    c.hazard[1] = np.arange(8)[None, :] / 10 * 1e6
    c.hazard[0] = 1e6 - c.hazard[1]
    c._seen_total = float(c.hazard.sum())
    c._within = None
    chance = c.reuse_chance()
    for e in (0, 1):
        level = np.log2(c.count[0, e] + 1)            # 3.56 and 3.96: between 3 and 4
        w = level - 3
        within3, within4 = 1 - 0.7 ** 4, 1 - 0.6 ** 4
        assert chance[0, e] == pytest.approx(within3 * (1 - w) + within4 * w, rel=1e-5)
    assert chance[0, 1] > chance[0, 0]                # the more used one kept longer


def test_reuse_chances_kept_between_calls_equal_a_fresh_scoring() -> None:
    """`reuse_chance` scores again only the rows that changed since the last call (the
    layers admitted, or all when the table is remade): it must equal scoring every unit
    from scratch, whatever the order of admits, read-aheads and victim choices."""
    rng = np.random.default_rng(7)
    n_layer, n_expert = 6, 32
    c = ExpertCache(np.full(n_layer, 1), n_expert=n_expert, budget=60, policy="reuse")
    for step in range(400):
        layer = step % n_layer
        c.admit(layer, np.unique(rng.integers(0, n_expert, 4)))
        if rng.random() < 0.5:
            c.admit_spec((layer + 1) % n_layer, np.unique(rng.integers(0, n_expert, 3)))
        if step % 7 == 0:
            kept = c.reuse_chance().copy()
            fresh = ExpertCache.__new__(ExpertCache)
            fresh.__dict__.update({k: (v.copy() if isinstance(v, np.ndarray) else v)
                                   for k, v in c.__dict__.items()})
            fresh._stale = np.ones(n_layer, dtype=np.uint8)
            fresh._chance = np.full((n_layer, n_expert), np.nan)
            np.testing.assert_array_equal(kept, fresh.reuse_chance())
    assert c.evictions > 100            # the victims were chosen from these chances


@pytest.mark.parametrize("policy", POLICIES)
def test_the_c_victim_choice_is_the_numpy_one(policy: str, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """`bmoe.native.cachepick` (the victims in one pass with a heap; `reuse`'s learning
    and scoring) makes the same choices as the numpy reference (`BMOE_CACHE_PICK=python`):
    two caches fed the same admits, read-aheads, pins and units of unequal sizes (so a
    choice frees more than it must) agree on every victim, in order, on every byte count,
    and on what `reuse` learned."""
    from bmoe.engine.experts.cache import PICK_ENV, native_pick
    assert native_pick() is not None, "the extension bmoe.native.cachepick is not built"
    rng = np.random.default_rng(11)
    n_layer, n_expert = 5, 24
    sizes = np.array([3, 1, 2, 5, 1])
    native = ExpertCache(sizes, n_expert=n_expert, budget=90, policy=policy)
    monkeypatch.setenv(PICK_ENV, "python")
    ref = ExpertCache(sizes, n_expert=n_expert, budget=90, policy=policy)
    assert native._pick is not None and ref._pick is None
    calls: Counter[str] = Counter()
    if policy == "reuse":     # the admissions in one C call (cachepick.Book), counted
        book = native._book
        assert book is not None and ref._book is None
        class Counted:
            def admit(self, *a: object) -> object:
                calls["admit"] += 1
                return book.admit(*a)
            def admit_spec(self, *a: object) -> object:
                calls["admit_spec"] += 1
                return book.admit_spec(*a)
        native._book = Counted()
    victims = 0
    for step in range(600):
        layer = step % n_layer
        ids = np.unique(rng.integers(0, n_expert, int(rng.integers(1, 7))))
        a, b = native.admit(layer, ids), ref.admit(layer, ids)
        assert a.victims == b.victims and a.misses.tolist() == b.misses.tolist()
        victims += len(a.victims)
        if rng.random() < 0.6:
            spec = np.unique(rng.integers(0, n_expert, 3))
            nxt = (layer + 1) % n_layer
            a, b = native.admit_spec(nxt, spec), ref.admit_spec(nxt, spec)
            assert a.victims == b.victims and a.misses.tolist() == b.misses.tolist()
            pin = spec[:1]
            native.pinned[nxt, pin] = ref.pinned[nxt, pin] = True
        if step % 5 == 0:
            native.pinned[:] = ref.pinned[:] = False
        assert native.resident_bytes == ref.resident_bytes
        np.testing.assert_array_equal(native.resident, ref.resident)
    assert victims > 200 and native.evictions == ref.evictions
    assert native.hits == ref.hits and native.misses == ref.misses
    assert native.rereads == ref.rereads
    if policy == "reuse":    # the learning and scoring in C left the numpy state
        # most admissions took the one call; the rest (the table due) the parts
        assert calls["admit"] > 450 and calls["admit_spec"] > 250, calls
        for name in ("visits", "last_visit", "count", "bucket", "hazard"):
            np.testing.assert_array_equal(getattr(native, name), getattr(ref, name), name)
        np.testing.assert_allclose(native.level, ref.level, rtol=1e-15)   # libm's log2
        np.testing.assert_allclose(native.reuse_chance(), ref.reuse_chance(), rtol=1e-14)


def _pick_reference(keep: np.ndarray | None, extra: np.ndarray | None, resident: np.ndarray,
                    pinned: np.ndarray, stamp: np.ndarray, protect_from: int,
                    nbytes: np.ndarray, over: int, k: int) -> tuple[list[int], int]:
    """The C pass's contract, written plainly: the evictable units ranked by (score, stamp,
    unit), at most k of them, taken until `over` bytes are free."""
    units = [i for i in range(len(resident))
             if resident[i] and not pinned[i] and stamp[i] < protect_from]
    def score(i: int) -> float:
        s = float(stamp[i]) if keep is None else float(keep[i])
        return max(s, float(extra[i])) if extra is not None else s
    ranked = sorted(units, key=lambda i: (score(i), int(stamp[i]), i))[:max(0, k)]
    chosen, freed = [], 0
    for i in ranked:
        if freed >= over:
            break
        chosen.append(i)
        freed += int(nbytes[i])
    return chosen, freed


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_c_pass_keeps_its_contract(data: st.DataObject) -> None:
    """`cachepick.victims` and `evictable_bytes` on arbitrary unit arrays (ties, all
    pinned, nothing to free, k beyond the units) against a plain Python reading of the
    contract."""
    from bmoe.engine.experts.cache import native_pick
    pick = native_pick()
    assert pick is not None, "the extension bmoe.native.cachepick is not built"
    n = data.draw(st.integers(0, 40))
    bools = st.lists(st.booleans(), min_size=n, max_size=n)
    resident = np.array(data.draw(bools), dtype=bool)
    pinned = np.array(data.draw(bools), dtype=bool)
    stamp = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)),
                     dtype=np.int64)
    nbytes = np.array(data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)),
                      dtype=np.int64)
    scores = st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n, max_size=n)
    keep = (None if data.draw(st.booleans())
            else np.array(data.draw(scores), dtype=np.float64))
    extra = None if data.draw(st.booleans()) else np.array(data.draw(scores), dtype=np.float64)
    protect_from = data.draw(st.integers(0, 7))
    over = data.draw(st.integers(-2, 60))
    k = data.draw(st.integers(0, n + 3))
    got = pick.victims(keep, extra, resident, pinned, stamp, protect_from, nbytes, over, k)
    assert got == _pick_reference(keep, extra, resident, pinned, stamp, protect_from, nbytes,
                                  over, k)
    ok = resident & ~pinned & (stamp < protect_from)
    assert pick.evictable_bytes(resident, pinned, stamp, protect_from, nbytes) == \
        int(nbytes[ok].sum())


def test_the_c_pass_refuses_arrays_of_other_sizes() -> None:
    from bmoe.engine.experts.cache import native_pick
    pick = native_pick()
    assert pick is not None
    r = np.ones(4, dtype=bool)
    i64 = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="stamp holds 24 bytes, not 32"):
        pick.victims(None, None, r, r, i64[:3], 1, i64, 1, 1)
    with pytest.raises(ValueError, match="keep holds"):
        pick.victims(np.zeros(4, dtype=np.float32), None, r, r, i64, 1, i64, 1, 1)
    with pytest.raises(ValueError, match="nbytes holds"):
        pick.evictable_bytes(r, r, i64, 1, i64[:2])
    c = ExpertCache(np.array([1]), n_expert=4, budget=4)
    with pytest.raises(ValueError, match="expert 9 outside 0..3"):
        pick.learn(np.array([9]), 0, c.last_visit[0], c.count[0], c.level[0], c.bucket[0],
                   c.hazard, 6, 8, 1 / 256)
    with pytest.raises(ValueError, match="hazard holds"):
        pick.learn(np.array([1]), 0, c.last_visit[0], c.count[0], c.level[0], c.bucket[0],
                   c.hazard[0], 6, 8, 1 / 256)
    with pytest.raises(ValueError, match="unexpected sizes"):
        pick.score(c._chance, c.last_visit, c.level, c.visits, np.zeros((6, 9)), 3, 6, 8)
    frozen = np.zeros((1, 4))
    frozen.setflags(write=False)
    with pytest.raises((TypeError, BufferError)):      # a read-only array is not written
        pick.score(frozen, c.last_visit, c.level, c.visits, np.zeros((6, 9)), 0, 6, 8)


def test_the_c_admissions_refuse_what_they_cannot_index() -> None:
    """`cachepick.Book` (a `reuse` cache's admissions in one call) checks the layer, every
    id, the table's shape and its arrays' sizes before it writes anything."""
    c = ExpertCache(np.array([2, 2]), n_expert=4, budget=6)
    book = c._book
    assert book is not None, "the extension bmoe.native.cachepick is not built"
    within = np.zeros((6, 9))
    before = {k: v.copy() for k, v in c.__dict__.items() if isinstance(v, np.ndarray)}
    with pytest.raises(ValueError, match="layer 2 outside 0..1"):
        book.admit(2, np.array([1]), 1, within, 0)
    with pytest.raises(ValueError, match="expert 4 outside 0..3"):
        book.admit(0, np.array([1, 4]), 1, within, 0)
    with pytest.raises(ValueError, match="expert -1 outside 0..3"):
        book.admit_spec(1, np.array([-1]), 1, 1, 0.5, within, 0)
    with pytest.raises(ValueError, match="more than the layer's experts"):
        book.admit(0, np.zeros(5, dtype=np.int64), 1, within, 0)
    with pytest.raises(ValueError, match="within holds"):
        book.admit(0, np.array([1]), 1, np.zeros((6, 8)), 0)
    for k, v in before.items():          # nothing was written by a refused call
        np.testing.assert_array_equal(getattr(c, k), v, k)
    with pytest.raises(ValueError, match="stamp holds"):
        type(book)(c.resident, c.stamp[:1], c.loaded, c.pinned, c.spec_p, c.bytes_of,
                   c.unit_bytes, c.visits, c.last_visit, c.count, c.level, c.bucket, c.hazard,
                   c._chance, c._stale, c._miss_buf, 6, 8, 1 / 256, 6, 2)
    frozen = c.stamp.copy()
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        type(book)(c.resident, frozen, c.loaded, c.pinned, c.spec_p, c.bytes_of,
                   c.unit_bytes, c.visits, c.last_visit, c.count, c.level, c.bucket, c.hazard,
                   c._chance, c._stale, c._miss_buf, 6, 8, 1 / 256, 6, 2)


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_the_one_call_admissions_are_the_numpy_ones(data: st.DataObject) -> None:
    """`reuse` with its admissions in one C call (`cachepick.Book`) against the numpy
    reference, on drawn shapes, unit sizes and budgets (down to one that a layer's set
    overshoots), drawn admits, read-aheads with their chances, pins and unpins: the same
    misses, victims in order, hits and re-reads at every step, the same state after."""
    n_layer = data.draw(st.integers(2, 6), "layers")
    n_expert = data.draw(st.integers(2, 20), "experts")
    sizes = np.array(data.draw(st.lists(st.integers(1, 5), min_size=n_layer,
                                        max_size=n_layer), "sizes"))
    budget = data.draw(st.integers(1, int(sizes.sum()) * n_expert), "budget")
    native = ExpertCache(sizes, n_expert=n_expert, budget=budget)
    ref = ExpertCache(sizes, n_expert=n_expert, budget=budget)
    ref._pick = ref._book = None          # all numpy, as BMOE_CACHE_PICK=python makes it
    assert native._book is not None, "the extension bmoe.native.cachepick is not built"
    ids_of = st.lists(st.integers(0, n_expert - 1), min_size=1, max_size=n_expert,
                      unique=True).map(lambda v: np.array(v, dtype=np.int64))
    for step in range(data.draw(st.integers(1, 40), "steps")):
        layer = step % n_layer
        op = data.draw(st.sampled_from(["admit", "admit", "spec", "pin", "unpin"]))
        if op == "admit":
            ids = data.draw(ids_of)
            a, b = native.admit(layer, ids), ref.admit(layer, ids)
            assert (a.hits, a.rereads) == (b.hits, b.rereads)
        elif op == "spec":
            ids = data.draw(ids_of)
            chance = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
            a, b = native.admit_spec(layer, ids, chance), ref.admit_spec(layer, ids, chance)
        else:
            e = data.draw(st.integers(0, n_expert - 1))
            native.pinned[layer, e] = ref.pinned[layer, e] = op == "pin"
            continue
        assert a.misses.tolist() == b.misses.tolist()
        assert a.victims == b.victims
        assert native.resident_bytes == ref.resident_bytes
    for name in ("resident", "loaded", "stamp", "spec_p", "visits", "last_visit", "count",
                 "bucket", "hazard"):
        np.testing.assert_array_equal(getattr(native, name), getattr(ref, name), name)
    assert (native.hits, native.misses, native.evictions, native.rereads) == \
        (ref.hits, ref.misses, ref.evictions, ref.rereads)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 11), min_size=1,
                                                      max_size=3, unique=True),
                          st.booleans()), min_size=1, max_size=80),
       st.sampled_from(["c", "python"]))
def test_own_layer_admissions_keep_each_layer_at_its_share(
        steps: list[tuple[int, list[int], bool]], pick: str) -> None:
    """`admit_own` (expert slots): once a layer holds its share, a token's misses evict
    only that layer's units, as many as they are (the miss is read into the victim's
    room); below it, room comes from the layers above theirs; the budget always holds,
    the units just admitted stay, and the C choice and numpy's agree on this too."""
    import os

    from bmoe.engine.experts.cache import PICK_ENV
    n_layer, n_expert, share = 4, 12, 4
    old = os.environ.get(PICK_ENV)
    os.environ[PICK_ENV] = pick
    try:
        c = ExpertCache(np.full(n_layer, 3), n_expert=n_expert, budget=3 * share * n_layer,
                        policy="reuse")
    finally:
        if old is None:
            os.environ.pop(PICK_ENV, None)
        else:
            os.environ[PICK_ENV] = old
    for layer, ids, spec in steps:
        before = c.resident.sum(axis=1)
        a = np.array(ids, dtype=np.int64)
        hits = int(c.resident[layer, a].sum())
        adm = c.admit_own(layer, a, share, spec)
        after = c.resident.sum(axis=1)
        assert c.resident_bytes == 3 * int(after.sum()) <= c.budget
        if not spec:
            assert c.resident[layer, a].all()          # what was asked for is in
        # at its share, with as many units it may evict as misses (none pinned here)
        if before[layer] >= share and before[layer] - hits >= len(a) - hits and len(
                adm.misses):
            assert all(vl == layer for vl, _ in adm.victims)
            assert after[layer] == before[layer]       # each miss took a victim's room
        elif len(adm.victims):
            over = [vl for vl in range(n_layer) if vl != layer and before[vl] > share]
            if sum(int(before[vl]) for vl in over) >= len(a):
                assert all(vl in over for vl, _ in adm.victims)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_own_pin_in_c_is_numpys(data: st.DataObject) -> None:
    """`cachepick.own_pin` decides and pins what `ExpertCache._own_pin` does in numpy:
    the same mode, the same layers pinned, the pins as they were saved."""
    from bmoe.engine.experts.cache import native_pick
    pick = native_pick()
    assert pick is not None, "the C cache parts are built with the package"
    n_layer, n_expert = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 12))
    bools = st.lists(st.booleans(), min_size=n_layer * n_expert, max_size=n_layer * n_expert)
    resident = np.array(data.draw(bools), dtype=bool).reshape(n_layer, n_expert)
    pinned = np.array(data.draw(bools), dtype=bool).reshape(n_layer, n_expert)
    layer = data.draw(st.integers(0, n_layer - 1))
    ids = np.array(data.draw(st.lists(st.integers(0, n_expert - 1), min_size=1,
                                      max_size=n_expert, unique=True)), dtype=np.int64)
    share = data.draw(st.integers(0, n_expert))
    c = ExpertCache(np.full(n_layer, 3), n_expert=n_expert, budget=1 << 20, policy="lru")
    c.resident[:] = resident
    c.pinned[:] = pinned
    want = c._own_pin(layer, ids, share)
    want_pins, saved = c.pinned.copy(), c._saved_pin.copy()
    c.pinned[:] = pinned
    c._saved_pin[:] = False
    got = pick.own_pin(c.resident, c.pinned, c._saved_pin, layer, ids, share, n_expert)
    assert got == want
    assert (c.pinned == want_pins).all() and (c._saved_pin == saved).all()
    assert (saved == pinned).all()
    with pytest.raises(ValueError):
        pick.own_pin(c.resident, c.pinned, c._saved_pin, n_layer, ids, share, n_expert)
    with pytest.raises(ValueError):
        pick.own_pin(c.resident, c.pinned, c._saved_pin, layer, ids + n_expert, share,
                     n_expert)


def prompt_loop(keep: np.ndarray | None, passes: int, policy: str = "reuse"
                ) -> tuple[ExpertCache, list[int]]:
    """A prompt's batches on 6 layers of 8 experts with room for 4 layers: every layer
    asks for all of its experts, layer after layer, `passes` times, the next layer read
    ahead (`admit_spec`) before each layer is asked; the misses per pass."""
    n_layer, n_expert = 6, 8
    c = ExpertCache(np.full(n_layer, 2), n_expert=n_expert, budget=2 * n_expert * 4,
                    policy=policy)
    every = np.arange(n_expert, dtype=np.int64)
    misses = []
    for _ in range(passes):
        m = 0
        for layer in range(n_layer):
            nxt = (layer + 1) % n_layer
            adm = (c.admit_keeping(layer, every, keep) if keep is not None
                   else c.admit(layer, every))
            m += len(adm.misses)
            assert c.resident[layer].all() and c.resident_bytes <= c.budget
            spec = (c.admit_keeping(nxt, every, keep, spec=True) if keep is not None
                    else c.admit_spec(nxt, every))
            m += len(spec.misses)
            assert not any(vl == layer for vl, _ in spec.victims)   # the layer computing
            assert c.resident_bytes <= c.budget
        misses.append(m)
    return c, misses


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prompt_loop_keeps_its_first_layers(policy: str) -> None:
    """A prompt's batches loop over the layers. With the first two layers kept (room for
    four layers, two in use) every pass after the first reads only the other four
    layers, whatever the policy, and the kept ones are cached when the next prompt
    starts. Without, LRU and LFU read every expert at every pass (what they keep is what
    the loop asks for last) and `reuse` does so at the second pass, before it has
    learned the loop."""
    keep = np.zeros(6, dtype=bool)
    keep[:2] = True
    c, kept = prompt_loop(keep, 4, policy)
    assert kept == [48, 32, 32, 32]            # 6 (then 4) layers x 8 experts
    assert c.resident[:2].all()
    _, plain = prompt_loop(None, 4, policy)
    if policy in ("lru", "lfu"):
        assert plain[1:] == [48, 48, 48]
    if policy == "reuse":
        assert plain[1] == 48


def test_keeping_gives_way_when_the_rest_cannot_make_room() -> None:
    """Where the layers not kept cannot free what the misses need, the admission is the
    plain one (the budget holds; the kept layers give way) rather than an overshoot."""
    c = ExpertCache(np.full(3, 1), n_expert=4, budget=8, policy="lru")
    every = np.arange(4, dtype=np.int64)
    c.admit(0, every)
    c.admit(1, every)
    keep = np.array([True, False, False])
    c.pinned[1] = True                     # layer 1's reads still in flight
    adm = c.admit_keeping(2, every, keep)
    assert len(adm.misses) == 4 and sorted(adm.victims) == [(0, e) for e in range(4)]
    assert c.resident_bytes <= c.budget and not c.pinned[0].any()
    # with room elsewhere the kept layer is not touched, and the pins are as they were
    c2 = ExpertCache(np.full(3, 1), n_expert=4, budget=8, policy="lru")
    c2.admit(0, every)
    c2.admit(1, every)
    adm = c2.admit_keeping(2, every, keep)
    assert sorted(adm.victims) == [(1, e) for e in range(4)]
    assert c2.resident[0].all() and not c2.pinned.any()
