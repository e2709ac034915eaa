"""The expert reader's lanes in C (`bmoe/native/readlanes.c`, `reader.NativeLaneQueue`).

Real files, real direct and buffered reads, real page moves: every read's bytes are
compared with the file's. The spec a caller hands to `submit` is fuzzed against a buffer
with inaccessible guard pages on both sides, so a read or a page move that ever left its
buffer would kill this process instead of passing.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmoe.engine.experts import reader as reader_mod
from bmoe.engine.experts.memory import AnonBuffer, page_ceil, page_floor
from bmoe.engine.experts.reader import ExpertReader, NativeLaneQueue, Read, ReadError

PAGE = mmap.PAGESIZE
readlanes = reader_mod.native_lanes()
pytestmark = pytest.mark.skipif(
    readlanes is None and os.environ.get(reader_mod.LANES_ENV, "") == "python",
    reason="BMOE_LANES=python turns the C lanes off")


@pytest.fixture(autouse=True)
def _built() -> None:
    assert readlanes is not None, "bmoe.native.readlanes is not built (pip install -e .)"


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(7).integers(0, 256, 3 * (1 << 20) + 1234,
                                             dtype=np.uint8).tobytes()
    p = tmp_path / "experts.bin"
    p.write_bytes(data)
    return p, data


def queue_of(path: Path, direct: bool, lanes: int = 4) -> tuple[ExpertReader, NativeLaneQueue]:
    r = ExpertReader(str(path), lanes, direct)
    q = r.start_queue()
    assert isinstance(q, NativeLaneQueue)
    return r, q


def slices() -> list[tuple[int, int]]:
    """(file offset, length): unaligned starts and ends, a whole-page one, the file's end."""
    return [(5000, 70000), (1 << 20, 4096), (123457, 300001), (2 << 20, 1 << 20),
            (3 * (1 << 20) + 1, 1233)]


@pytest.mark.parametrize("direct", [True, False])
def test_reads_land_in_place(data_file: tuple[Path, bytes], direct: bool) -> None:
    path, data = data_file
    reader, q = queue_of(path, direct)
    bufs = [AnonBuffer(off, n) for off, n in slices()]
    try:
        groups = [q.submit([Read(off, n, b, 0)], prio)
                  for prio, ((off, n), b) in enumerate(zip(slices(), bufs, strict=True))]
        assert q.wait(groups, 30)
        for (off, n), b, g in zip(slices(), bufs, groups, strict=True):
            assert g.finished() and g.error is None
            assert bytes(b.view[b.phase:b.phase + n]) == data[off:off + n]
            assert g.nbytes >= n
            if not reader.odirect:
                assert g.nbytes == n
        assert q.busy_s > 0
        assert reader.odirect is direct or "refused" in reader.fallback_reason
    finally:
        reader.close(bufs)


def test_page_moves_hand_pages_over_and_are_counted(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    reader, q = queue_of(path, True)
    off, n = 8 * PAGE, 64 * PAGE
    src, dst = AnonBuffer(0, n), AnonBuffer(off, n)
    src.array[:] = 0xAB                                   # committed pages to hand on
    try:
        g = q.submit([Read(off, n, dst, 0, ((src.base, dst.base, n),))], 0)
        assert q.wait([g], 30) and g.error is None
        assert bytes(dst.view[:n]) == data[off:off + n]
        assert reader.moved_bytes == n
        assert not src.array.any()                        # left mapped and empty
    finally:
        reader.close([src, dst])


def test_a_direct_read_refused_midway_falls_back(data_file: tuple[Path, bytes]) -> None:
    """A buffer whose page phase is not the slice's: the direct read's memory is not
    aligned, the kernel refuses it (EINVAL), the lane reads it buffered from then on,
    and the reader says why."""
    path, data = data_file
    reader, q = queue_of(path, True)
    if not reader.odirect:
        pytest.skip("this file system refuses O_DIRECT")
    off, n = 3 * PAGE + 100, 50000
    b = AnonBuffer(off + 1, n + PAGE)                     # phase 101: the slice lands at 100
    try:
        g = q.submit([Read(off, n, b, 0)], 0)
        assert q.wait([g], 30) and g.error is None
        # the lane read the slice where the buffer holds file byte `off` (its phase is 101)
        assert bytes(b.view[b.phase:b.phase + n]) == data[off:off + n]
        assert reader.odirect is False and "refused" in reader.fallback_reason
        assert q.lanes.refused_errno == errno.EINVAL
        g2 = q.submit([Read(off + 1, n, b, 0)], 0)
        assert q.wait([g2], 30) and g2.error is None and g2.nbytes == n
    finally:
        reader.close([b])


@pytest.mark.parametrize("direct", [True, False])
def test_exact_reads_write_their_slices_and_nothing_around_them(
        data_file: tuple[Path, bytes], direct: bool) -> None:
    """With `exact` (expert slots: a slice's neighbours in memory are other experts than
    its neighbours in the file), a read writes its slice's bytes and not one byte of the
    partial pages around it; without it a direct read writes the page-aligned superset.
    Slices of every shape: whole pages inside, none, the file's end."""
    path, data = data_file
    reader, q = queue_of(path, direct)
    s, base_off = 3 * PAGE, 777       # slots of whole pages (as expert slots need), phase 777
    buf = AnonBuffer(base_off, 5 * s)
    try:
        for exact in (True, False):
            buf.array[:] = 0xEE
            q.lanes.exact = exact
            assert q.lanes.exact is exact
            # file slice e into slot `slot` (not its own): 2 -> 0, 0 -> 3, 4 -> 1
            moves = [(2, 0), (0, 3), (4, 1)]
            groups = [q.submit([Read(base_off + e * s, s, buf, slot * s)], 0)
                      for e, slot in moves]
            assert q.wait(groups, 30) and all(g.error is None for g in groups)
            got = bytes(buf.view[buf.phase:buf.phase + 5 * s])
            right = all(got[slot * s:(slot + 1) * s] == data[base_off + e * s:
                                                             base_off + (e + 1) * s]
                        for e, slot in moves)
            untouched = [got[i * s:(i + 1) * s] for i in (2, 4)]
            head = bytes(buf.view[:buf.phase])
            clean = all(u == b"\xee" * s for u in untouched) and head == b"\xee" * buf.phase
            if exact or not direct:
                assert right and clean
            else:                  # the supersets wrote their neighbours' bytes over them
                assert not right and not clean
        q.lanes.exact = True                      # odd slices: tiny, the file's end
        odd = [AnonBuffer(off, n) for off, n in slices()]
        groups = [q.submit([Read(off, n, b, 0)], 0)
                  for (off, n), b in zip(slices(), odd, strict=True)]
        assert q.wait(groups, 30)
        for (off, n), b, g in zip(slices(), odd, groups, strict=True):
            assert g.error is None
            assert bytes(b.view[b.phase:b.phase + n]) == data[off:off + n]
        os.truncate(path, 2 * s)                  # a file cut short: the reader's error
        g = q.submit([Read(base_off + 2 * s, s, buf, 0)], 0)
        assert q.wait([g], 30)
        assert isinstance(g.error, ReadError) and "ends early" in str(g.error)
        reader.close(odd)
    finally:
        reader.close([buf])


def test_a_file_cut_short_is_the_readers_error(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    reader, q = queue_of(path, True)
    off, n = 2 << 20, 1 << 20
    b = AnonBuffer(off, n)
    try:
        os.truncate(path, off + 1000)
        g = q.submit([Read(off, n, b, 0)], 0)
        assert q.wait([g], 30)
        assert isinstance(g.error, ReadError)
        assert str(path) in str(g.error) and "ends early" in str(g.error)
    finally:
        reader.close([b])


def test_promoted_reads_run_once_and_close_drops_the_queue(
        data_file: tuple[Path, bytes]) -> None:
    """One lane, thousands of one-page reads queued behind each other: a group promoted
    to priority 0 finishes and is read once; closing drops what was still queued (those
    groups fail, every group finishes, nothing hangs)."""
    path, data = data_file
    reader, q = queue_of(path, False, lanes=1)
    b = AnonBuffer(0, len(data))
    try:
        many = [q.submit([Read(i * PAGE, PAGE, b, i * PAGE)], 5, wake=False)
                for i in range(3 * (1 << 20) // PAGE)]
        many += [q.submit([Read(i * PAGE, PAGE, b, i * PAGE)], 5, wake=False)
                 for _ in range(20) for i in range(3 * (1 << 20) // PAGE)]
        late = q.submit([Read(1000, 5000, b, 1000), Read(9000, 300, b, 9000)], 9)
        q.wake()
        q.promote(late)
        assert q.wait([late], 30) and late.error is None and late.nbytes == 5300
        assert late.prio == 0
        assert bytes(b.view[1000:6000]) == data[1000:6000]
        q.close()
        assert all(g.finished() for g in many)
        dropped = [g for g in many if g.error is not None]
        assert dropped, "everything ran before the close: queue more"
        assert all("closed" in str(g.error) for g in dropped)
        after = q.submit([Read(0, 10, b, 0)], 0)
        assert after.finished() and "closed" in str(after.error)
    finally:
        reader.close([b])


def test_wait_times_out_and_takes_only_its_own_groups(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    reader, q = queue_of(path, False, lanes=1)
    other_reader, other = queue_of(path, False, lanes=1)
    b = AnonBuffer(0, len(data))
    try:
        big = q.submit([Read(i * PAGE, PAGE, b, i * PAGE) for i in range(len(data) // PAGE)],
                       3)
        assert q.wait([big], 0.0) is False or big.finished()
        assert q.wait([big], 30) is True and big.nbytes == len(data) // PAGE * PAGE
        with pytest.raises(TypeError):
            other.wait([big], 1)
        with pytest.raises(TypeError):
            q.lanes.wait([object()], 1)
        with pytest.raises(TypeError):
            q.lanes.promote(object())
    finally:
        other_reader.close()
        reader.close([b])


# -- the spec, fuzzed ----------------------------------------------------------------

class Guarded:
    """An anonymous buffer between two inaccessible pages; a second one to move from."""

    def __init__(self, pages: int) -> None:
        self.map = mmap.mmap(-1, (pages + 2) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(self.map, dtype=np.uint8)
        self.start = int(arr.ctypes.data)
        del arr
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for guard in (self.start, self.start + (pages + 1) * PAGE):
            assert libc.mprotect(guard, PAGE, 0) == 0
        self.lo = self.start + PAGE
        self.hi = self.lo + pages * PAGE


_GUARDED: dict[str, Any] = {}


def _error(kind: int, err: int, at: int) -> BaseException:
    return OSError(err, f"kind {kind} at {at}")


def _lanes(path: Path, direct: bool) -> Any:
    assert readlanes is not None
    key = f"{path}:{direct}"
    if key not in _GUARDED:
        fd = os.open(path, os.O_RDONLY)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT) if direct else -1
        _GUARDED[key] = readlanes.Lanes(dfd, fd, os.fstat(fd).st_size, 2, True, _error)
    return _GUARDED[key]


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("lanes") / "f.bin"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 64 * PAGE + 77,
                                                    dtype=np.uint8).tobytes())
    return p


BUF_PAGES = 16
_buf = Guarded(BUF_PAGES)
_src = Guarded(BUF_PAGES)

near = st.integers(-3 * PAGE, (BUF_PAGES + 3) * PAGE)
offsets = st.one_of(st.integers(-PAGE, 70 * PAGE), st.sampled_from([0, PAGE, 64 * PAGE]))
lengths = st.one_of(st.integers(-10, 20 * PAGE), st.sampled_from([PAGE, 2 * PAGE]))
move = st.tuples(st.integers(-PAGE, (BUF_PAGES + 1) * PAGE).map(lambda a: page_floor(abs(a))),
                 near.map(lambda a: page_floor(abs(a))),
                 st.integers(-PAGE, 4 * PAGE).map(lambda n: page_ceil(n) if n > 0 else n))
wild_read = st.tuples(offsets, lengths, near, st.lists(move, max_size=3))
# reads a caller would make: inside the file and the buffer, page moves inside both
good_move = st.tuples(st.integers(0, BUF_PAGES - 4).map(lambda i: i * PAGE),
                      st.integers(0, BUF_PAGES - 4).map(lambda i: i * PAGE),
                      st.integers(1, 4).map(lambda i: i * PAGE))
good_read = st.tuples(st.integers(0, 60 * PAGE), st.integers(1, 4 * PAGE),
                      st.integers(PAGE, 10 * PAGE), st.lists(good_move, max_size=2))
read = st.one_of(good_read, good_read, wild_read)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(reads=st.lists(read, min_size=0, max_size=4), direct=st.booleans(),
       prio=st.integers(-1, 3))
def test_fuzzed_specs_never_write_outside_their_buffer(fuzz_file: Path, reads: list[Any],
                                                       direct: bool, prio: int) -> None:
    lanes = _lanes(fuzz_file, direct)
    spec: list[int] = []
    for off, n, at, moves in reads:
        spec += [off, n, _buf.lo + at, _buf.lo, _buf.hi, len(moves)]
        for s, d, m in moves:
            spec += [_src.lo + s, _buf.lo + d, m]
    try:
        g = lanes.submit(spec, prio)
    except ValueError:
        return
    assert prio >= 0
    assert lanes.wait([g], 30)
    err = g.error
    assert err is None or isinstance(err, OSError)
    # every read accepted fit its buffer: compare its bytes with the file's
    data = fuzz_file.read_bytes()
    view = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (BUF_PAGES * PAGE))
                                  .from_address(_buf.lo)))
    if err is None:
        for off, n, at, _ in reads:
            assert _buf.lo <= _buf.lo + at and at + n <= BUF_PAGES * PAGE
            assert off + n <= len(data)
        last = reads[-1] if reads else None
        if last is not None and len(reads) == 1:
            off, n, at, _ = last
            assert bytes(view[at:at + n]) == data[off:off + n]


@pytest.mark.parametrize("spec", [
    [1, 2, 3], ["a", 1, 2, 3, 4, 0], [0, 10, 1, 1, 2, -1], [0, 10, 1, 1, 2, 5, 1, 2, 3],
    [0, 1 << 70, 0, 0, 0, 0], None, 7, [0.5, 1, 1, 1, 1, 0],
])
def test_a_malformed_spec_is_refused(fuzz_file: Path, spec: Any) -> None:
    lanes = _lanes(fuzz_file, False)
    with pytest.raises((ValueError, TypeError)):
        lanes.submit(spec, 0)


# -- the read planner against the streamer's Python one --------------------------------

class _Recorded(AnonBuffer):
    """An AnonBuffer whose freed ranges are recorded instead of freed."""

    freed: list[tuple[int, int]] = []

    def release_at(self, addr: int, length: int) -> None:
        _Recorded.freed.append((addr, length))


def _layers(rng: np.random.Generator, n_layer: int, n_expert: int) -> Any:
    """Random expert tensors: 1-3 per layer, slices of several sizes and page phases."""
    from types import SimpleNamespace
    by_layer, rows, starts, off = {}, [], [0], 12345
    for layer in range(n_layer):
        ts = []
        for _ in range(int(rng.integers(1, 4))):
            s = int(rng.choice([3 * PAGE + 123, 5 * PAGE, 2 * PAGE + 7, 7 * PAGE - 1]))
            t = SimpleNamespace(offset=off, slice_bytes=s, layer=layer)
            buf = _Recorded(off, n_expert * s)
            ts.append((t, buf))
            rows.append((off, s, buf.base, buf.phase, buf.size))
            off += n_expert * s + int(rng.integers(0, 3 * PAGE))
        by_layer[layer] = tuple(ts)
        starts.append(len(rows))
    return by_layer, np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64)


def _python_plan(by_layer: Any, layer: int, misses: list[int], victims: list[tuple[int, int]],
                 split: bool, fresh: list[tuple[int, int]] | None = None
                 ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """The streamer's Python planning as `plan` specs; with `fresh` (a list) its fresh
    pages' (address, length) are appended there and left out of the specs, as the C lanes
    take them (given before the reads are queued)."""
    from types import SimpleNamespace

    from bmoe.engine.experts.reader import FRESH
    from bmoe.engine.experts.streamer import ExpertStreamer
    st = SimpleNamespace(_by_layer=by_layer, _src_unit={}, _perm=None,
                         reader=SimpleNamespace(recycle=True,
                                                supply=None if fresh is None else object()))
    spare = ExpertStreamer._victim_pages(st, victims)         # type: ignore[arg-type]
    groups = [[e] for e in misses] if split else ([misses] if misses else [])
    specs, taken = [], []
    for ids in groups:
        reads = ExpertStreamer._reads_for(st, layer, np.array(ids), spare)  # type: ignore[arg-type]
        spec: list[int] = []
        units = []
        for r in reads:
            b = r.buffer
            moves = [m for m in r.moves if m[0] != FRESH]
            if fresh is not None:
                fresh += [(m[1], m[2]) for m in r.moves if m[0] == FRESH]
            spec += [r.offset, r.length, b.base + b.phase + r.at, b.base, b.base + b.size,
                     len(moves)]
            for m in moves:
                spec += m
                units.append(st._src_unit[m[0]])
        specs.append(spec)
        taken.append(units)
    for length, pages in spare.items():
        for buf, addr in pages:
            buf.release_at(addr, length)
    return specs, taken


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), split=st.booleans(), sort=st.booleans())
def test_the_c_planner_plans_the_python_reads(seed: int, split: bool, sort: bool) -> None:
    """`readlanes.plan` gives the reads, page moves, taken victims and freed pages the
    streamer's `_victim_pages` + `_reads_for` + `take_spare` give, in the same order:
    misses in runs or one by one, victims of every slice length (equal, larger, smaller)."""
    assert readlanes is not None
    rng = np.random.default_rng(seed)
    n_layer, n_expert = int(rng.integers(1, 5)), int(rng.integers(2, 12))
    by_layer, table, starts = _layers(rng, n_layer, n_expert)
    try:
        layer = int(rng.integers(0, n_layer))
        misses = [int(e) for e in rng.choice(n_expert, int(rng.integers(0, n_expert + 1)),
                                             replace=False)]
        if sort:
            misses.sort()
        units = [(lay, e) for lay in range(n_layer) for e in range(n_expert) if lay != layer]
        pick = rng.choice(len(units), min(len(units), int(rng.integers(0, 12))), replace=False) \
            if units else []
        victims = [units[int(i)] for i in pick]
        _Recorded.freed = []
        want_specs, want_taken = _python_plan(by_layer, layer, misses, victims, split)
        want_freed = _Recorded.freed
        specs, taken, freed = readlanes.plan(
            table, starts, layer, np.array(misses, dtype=np.int64),
            np.array(victims, dtype=np.int64).reshape(-1, 2), True, split, False)
        assert specs == want_specs
        assert [list(t) for t in taken] == want_taken
        assert [tuple(f) for f in freed] == want_freed
    finally:
        for ts in by_layer.values():
            for _, buf in ts:
                buf.close()


def test_the_planner_refuses_ids_and_tables_outside_the_model() -> None:
    assert readlanes is not None
    rng = np.random.default_rng(3)
    by_layer, table, starts = _layers(rng, 2, 4)
    none = np.zeros((0, 2), dtype=np.int64)
    try:
        for layer, misses, victims in [(2, [0], none), (-1, [0], none), (0, [4], none),
                                       (0, [-1], none), (0, [0], np.array([[5, 0]])),
                                       (0, [0], np.array([[1, 4]]))]:
            with pytest.raises(ValueError):
                readlanes.plan(table, starts, layer, np.array(misses, dtype=np.int64),
                               np.asarray(victims, dtype=np.int64), True, False, False)
        with pytest.raises(ValueError):
            readlanes.plan(table[:, :4].copy(), starts, 0, np.array([0]), none, True, False,
                           False)
        with pytest.raises(TypeError):
            readlanes.plan(table.astype(np.int32), starts, 0, np.array([0]), none, True,
                           False, False)
        bad = table.copy()
        bad[0, 2] += 1                                         # a buffer not page-aligned
        with pytest.raises(ValueError):
            readlanes.plan(bad, starts, 0, np.array([0]), none, True, False, False)
    finally:
        for ts in by_layer.values():
            for _, buf in ts:
                buf.close()


@pytest.mark.parametrize("give", ["none", "record", "supply"])
@pytest.mark.parametrize("split", [False, True])
def test_plan_submit_reads_the_planned_slices_over_the_victims_pages(
        tmp_path: Path, split: bool, give: str) -> None:
    """`Lanes.plan_submit` queues `plan`'s reads without a spec leaving C: the missed
    slices land in place with the file's bytes, read over the victims' committed pages
    (moved, not faulted in), and each group names the victims whose pages it took, as
    `plan` does for the same input. With `give`, the slices' pages no victim covers are
    handed to it first, the ranges the streamer's Python planning gives fresh pages (a
    recorder, or a real huge-page supply)."""
    from types import SimpleNamespace

    from bmoe.engine.experts.memory import PageSupply
    assert readlanes is not None
    rng = np.random.default_rng(5)
    n_expert, sizes = 6, [(3 * PAGE + 123, 5 * PAGE), (2 * PAGE + 7, 3 * PAGE + 123)]
    rows, starts, off, bufs = [], [0], 777, []
    by_layer: dict[int, Any] = {}
    for layer, layer_sizes in enumerate(sizes):
        for s in layer_sizes:
            buf = AnonBuffer(off, n_expert * s)
            bufs.append((off, s, buf))
            rows.append((off, s, buf.base, buf.phase, buf.size))
            by_layer.setdefault(layer, []).append(
                (SimpleNamespace(offset=off, slice_bytes=s, layer=layer), buf))
            off += n_expert * s + 1000
        starts.append(len(rows))
    data = rng.integers(0, 256, off, dtype=np.uint8).tobytes()
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    table, starts_a = np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64)
    reader, q = queue_of(path, True)
    none = np.zeros((0, 2), dtype=np.int64)
    try:
        # layer 1's experts 0..3 resident first: the victims-to-be
        groups, taken = q.lanes.plan_submit(table, starts_a, 1, np.arange(4, dtype=np.int64),
                                            none, True, False, 0, True)
        assert len(groups) == 1 and taken == [[]] and q.wait(groups, 30)
        victims = np.array([[1, 0], [1, 2], [1, 3]], dtype=np.int64)
        misses = np.array([1, 4], dtype=np.int64)      # one victim more than misses
        _, want_taken, want_released = readlanes.plan(table, starts_a, 0, misses, victims,
                                                      True, split, False)
        assert want_released, "the case leaves some victims' pages over"
        want_fresh: list[tuple[int, int]] = []
        _python_plan(by_layer, 0, misses.tolist(), [tuple(v) for v in victims.tolist()],
                     split, want_fresh)
        moved = reader.moved_bytes
        given: list[tuple[int, int]] = []
        kept: list[tuple[int, int]] = []
        supply = PageSupply(park_limit=64 * PAGE) if give == "supply" else None

        def record(addr: int, n: int) -> bool:
            given.append((addr, n))
            return supply.give(addr, n) if supply is not None else False

        def keep(addr: int, n: int) -> None:
            kept.append((addr, n))
            if supply is not None:
                supply.take(addr, n)
        extra = () if give == "none" else (record, keep)
        groups, taken = q.lanes.plan_submit(table, starts_a, 0, misses, victims, True, split,
                                            3, True, *extra)
        assert given == ([] if give == "none" else want_fresh)
        # the pages no miss keeps go to `take` (before any `give`), or are freed
        assert kept == ([] if give == "none" else [tuple(r) for r in want_released])
        if supply is not None:        # what it kept went out again to the fresh ranges
            assert supply.reused_bytes > 0 and supply.parked_bytes == max(
                0, sum(n for _, n in want_released) - supply.reused_bytes)
        assert want_fresh, "the case gives some slices fresh pages"
        assert len(groups) == (len(misses) if split else 1)
        assert [list(t) for t in taken] == [list(t) for t in want_taken]
        assert sum(len(t) for t in taken) > 0
        assert q.wait(groups, 30) and all(g.error is None for g in groups)
        assert all(g.prio == 3 for g in groups)
        for o, s, buf in bufs[:2]:            # layer 0's tensors
            for e in misses.tolist():
                got = bytes(buf.view[buf.phase + e * s:buf.phase + (e + 1) * s])
                assert got == data[o + e * s:o + (e + 1) * s], (o, e)
        assert reader.moved_bytes > moved
        assert sum(g.nbytes for g in groups) >= sum(s for _, s, _ in bufs[:2]) * len(misses)
        empty, _ = q.lanes.plan_submit(table, starts_a, 0, np.zeros(0, dtype=np.int64), none,
                                       True, split, 0, True)
        assert empty == []
        with pytest.raises(ValueError, match="no such layer"):
            q.lanes.plan_submit(table, starts_a, 2, misses, none, True, split, 0, True)
        with pytest.raises(ValueError, match="prio"):
            q.lanes.plan_submit(table, starts_a, 0, misses, none, True, split, -1, True)
        with pytest.raises(TypeError, match="callable"):
            q.lanes.plan_submit(table, starts_a, 0, misses, none, True, split, 0, True, 5)
        with pytest.raises(TypeError, match="callable"):
            q.lanes.plan_submit(table, starts_a, 0, misses, none, True, split, 0, True,
                                None, 5)

        def refuse(addr: int, n: int) -> bool:
            raise RuntimeError("no pages")
        with pytest.raises(RuntimeError, match="no pages"):   # nothing queued
            q.lanes.plan_submit(table, starts_a, 1, np.array([5]), none, True, split, 0,
                                True, refuse)
        q.wait(groups, 5)
        for _, s, buf in bufs[2:]:                           # layer 1's slice 5: never read
            assert not any(buf.view[buf.phase + 5 * s:buf.phase + 6 * s])
        if supply is not None:
            supply.close()
    finally:
        reader.close([b for _, _, b in bufs])


def test_fresh_pages_are_given_by_the_caller_before_a_c_lane_reads(
        data_file: tuple[Path, bytes]) -> None:
    """With the C lanes a read's `FRESH` moves are given from the reader's huge-page supply
    as the read is queued (the lane moves only victims' pages); the read then lands in
    them."""
    from bmoe.engine.experts.memory import PageSupply
    from bmoe.engine.experts.reader import FRESH
    path, data = data_file
    reader, q = queue_of(path, True)
    given: list[tuple[int, int]] = []

    class Recorder(PageSupply):
        def give(self, dst: int, length: int) -> bool:
            given.append((dst, length))
            return super().give(dst, length)
    reader.supply = Recorder()
    off, n = 123457, 300001
    buf = AnonBuffer(off, n)
    try:
        dst, length = buf.interior(0, n)
        g = q.submit([Read(off, n, buf, 0, ((FRESH, dst, length),))], 0)
        assert given == [(dst, length)]
        assert q.wait([g], 30) and g.error is None
        assert bytes(buf.view[buf.phase:buf.phase + n]) == data[off:off + n]
    finally:
        reader.supply.close()
        reader.close([buf])


# -- repacked MXFP4 slices (bmoe/engine/experts/repack.py) --------------------------------

def llama_cpp_repacked(src: np.ndarray, ne0: int, ne1: int, ne2: int) -> bytes:
    """`src` (MXFP4 bytes in the file's layout) as llama.cpp's own CPU_REPACK buffer
    rewrites them at a resident load: a tensor of that shape allocated in such a buffer,
    its bytes set through ggml_backend_tensor_set (the repack), read back."""
    import ctypes

    from bmoe.engine.experts import ggml
    from bmoe.engine.experts.repack import GGML_TYPE_MXFP4, RepackUnavailable, _lib, packer
    try:
        p = packer()
        p.kernels_for(GGML_TYPE_MXFP4, ne0, ne1, ne2)
    except RepackUnavailable as e:
        pytest.skip(f"no repacked MXFP4 kernels on this CPU: {e}")
    lib = _lib()
    ctx = lib.ggml_init(ggml._InitParams(1 << 12, None, True))
    buf = lib.ggml_backend_buft_alloc_buffer(p.buft, src.nbytes + 64)
    try:
        t = lib.ggml_new_tensor_3d(ctx, GGML_TYPE_MXFP4, ne0, ne1, ne2)
        assert lib.ggml_backend_tensor_alloc(buf, t, lib.ggml_backend_buffer_get_base(buf)) == 0
        lib.ggml_backend_tensor_set(t, src.ctypes.data, 0, src.nbytes)
        return ctypes.string_at(lib.ggml_backend_buffer_get_base(buf), src.nbytes)
    finally:
        lib.ggml_backend_buffer_free(buf)
        lib.ggml_free(ctx)


@pytest.mark.parametrize("shape", [(256, 64, 3), (2880, 16, 2), (32, 8, 1)])
def test_pack_mxfp4_is_llama_cpps_repack(shape: tuple[int, int, int]) -> None:
    """The streamer's permutation of MXFP4 rows is, byte for byte, what llama.cpp's
    CPU_REPACK buffer writes at a resident load (gpt-oss's 2,880-wide rows among them)."""
    from bmoe.engine.experts.repack import row_bytes
    ne0, ne1, ne2 = shape
    src = np.random.default_rng(ne0).integers(0, 256, row_bytes(ne0) * ne1 * ne2,
                                              dtype=np.uint8)
    mine = src.copy()
    assert readlanes is not None
    readlanes.pack_mxfp4(mine, row_bytes(ne0))
    assert mine.tobytes() == llama_cpp_repacked(src, ne0, ne1, ne2)
    assert not np.array_equal(mine, src)
    with pytest.raises(ValueError, match="whole groups of 8 rows"):
        readlanes.pack_mxfp4(mine[:-17], row_bytes(ne0))
    with pytest.raises(ValueError):
        readlanes.pack_mxfp4(mine, 16)


@pytest.mark.parametrize("direct", [True, False])
def test_the_lanes_repack_the_slices_of_their_packs(tmp_path: Path, direct: bool) -> None:
    """Slices read into a buffer the lanes were told to repack land permuted (the file's
    bytes, packed as pack_mxfp4 does); a buffer not among the packs lands as it is; a
    slice that is not whole groups of rows is the group's error, not a half-packed one;
    the packs are set once, before any read."""
    rows, rb = 16, 17 * 8                 # 16 rows of 256 elements: 2 groups per slice
    s = rows * rb
    data = np.random.default_rng(3).integers(0, 256, 8 * s + 999, dtype=np.uint8)
    path = tmp_path / "mxfp4.bin"
    path.write_bytes(data.tobytes())
    off = 999                             # the experts' first byte in the file
    reader, q = queue_of(path, direct)
    packed, plain = AnonBuffer(off, 8 * s), AnonBuffer(off, 8 * s)
    try:
        q.lanes.exact = True
        q.lanes.set_packs([(packed.base, packed.base + packed.size,
                            packed.base + packed.phase, rb)])
        assert q.lanes.packs == 1
        with pytest.raises(RuntimeError, match="set once"):
            q.lanes.set_packs([])
        groups = [q.submit([Read(off + 2 * s, 3 * s, packed, 2 * s),
                            Read(off + 6 * s, s, packed, 6 * s)], 0),
                  q.submit([Read(off + 2 * s, 3 * s, plain, 2 * s)], 0)]
        assert q.wait(groups, 30) and all(g.error is None for g in groups)
        want = data[off:off + 8 * s].copy()
        for e0, e1 in ((2, 5), (6, 7)):
            readlanes.pack_mxfp4(want[e0 * s:e1 * s], rb)
        got = np.frombuffer(bytes(packed.view[packed.phase:packed.phase + 8 * s]), np.uint8)
        for e in (2, 3, 4, 6):
            assert np.array_equal(got[e * s:(e + 1) * s], want[e * s:(e + 1) * s])
        assert not got[:2 * s].any() and not got[5 * s:6 * s].any()
        assert bytes(plain.view[plain.phase + 2 * s:plain.phase + 5 * s]) == \
            data[off + 2 * s:off + 5 * s].tobytes()
        bad = q.submit([Read(off + 7 * s, 3 * rb, packed, 7 * s)], 0)   # 3 rows
        assert q.wait([bad], 30)
        assert isinstance(bad.error, ReadError)
    finally:
        reader.close([packed, plain])


def test_a_layout_other_than_the_one_written_turns_repacking_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any read the streamer checks, through a real CPU_REPACK buffer, that this
    CPU's repacked MXFP4 layout is the one `pack_mxfp4` writes; a layout that differs
    (here: a permutation that writes nothing) is RepackUnavailable, never a wrong one."""
    from bmoe.engine.experts.repack import GGML_TYPE_MXFP4, Packer, RepackUnavailable
    try:
        Packer().kernels_for(GGML_TYPE_MXFP4, 2880, 2880, 4)
    except RepackUnavailable as e:
        pytest.skip(f"no repacked MXFP4 kernels on this CPU: {e}")
    assert readlanes is not None
    monkeypatch.setattr(readlanes, "pack_mxfp4", lambda _buf, _rows: None)
    with pytest.raises(RepackUnavailable, match="otherwise"):
        Packer().kernels_for(GGML_TYPE_MXFP4, 2880, 2880, 4)
    with pytest.raises(RepackUnavailable, match="whole groups of 8"):
        Packer().kernels_for(GGML_TYPE_MXFP4, 2880, 2881, 4)
