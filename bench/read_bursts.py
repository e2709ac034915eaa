"""What a streamed layer's burst of reads gets from the disk, by the pages it reads into.

    sudo .venv/bin/python bench/read_bursts.py MODEL.gguf
    sudo .venv/bin/python bench/read_bursts.py MODEL.gguf --size-mib 4 --bursts 1,3,6

A decode step's misses of one layer are a burst: a few slice reads queued at once on the
engine's read lanes (`bmoe.native.readlanes`, O_DIRECT), waited for, then the next
layer's. This times such bursts (random offsets in MODEL, `--size-mib` each, four lanes)
into two kinds of buffers, page for page the same size:

* **plain pages**: 4 KiB pages committed one by one, as the expert cache's slices are
  (a miss takes a victim's pages, which were faulted in the same way);
* **huge pages**: pages carved from transparent huge pages (`memory.PageSupply`, what
  `huge-pages` gives a slice), physically contiguous, the buffers the bench's disk
  probe reads into (`_common.direct_read_rate`, "the disk's rate" in stream_vs_mmap.py).

It prints MiB/s and ms per burst for each, and plain / huge (the baseline, measured in
the same run). On a virtual disk a read into scattered 4 KiB pages is a long list of
segments, and the rate the engine can reach into its cache's pages is the plain-pages
one, not the probe's. Without transparent huge pages (or root) the huge-page row is
plain pages too, and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bmoe.engine.experts.memory import AnonBuffer, PageSupply  # noqa: E402
from bmoe.engine.experts.reader import ExpertReader, NativeLaneQueue, Read  # noqa: E402

MIB = 1 << 20


def bursts(path: Path, size: int, burst: int, rounds: int, huge: PageSupply | None,
           lanes: int, seed: int) -> float:
    """Seconds per burst of `burst` reads of `size` bytes (the best of 3 passes)."""
    reader = ExpertReader(str(path), lanes, True)
    queue = reader.start_queue()
    if not isinstance(queue, NativeLaneQueue) or not reader.odirect:
        reader.close()
        raise SystemExit("needs the C read lanes and O_DIRECT on this file system "
                         "(pip install -e . builds bmoe.native.readlanes)")
    bufs = [AnonBuffer(0, size) for _ in range(burst)]
    for b in bufs:
        if huge is not None:
            huge.commit(b)
        else:
            b.view[:] = b"\1" * len(b.view)       # every page committed, one by one
    rng = np.random.default_rng(seed)
    span = (path.stat().st_size - size) // 4096
    best = float("inf")
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(rounds):
                groups = [queue.submit([Read(int(rng.integers(0, span)) * 4096, size, b, 0)],
                                       0) for b in bufs]
                if not queue.wait(groups, 60) or any(g.error for g in groups):
                    raise SystemExit("a read failed or did not finish in 60 s")
            best = min(best, (time.perf_counter() - t0) / rounds)
    finally:
        reader.close(bufs)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="a large file to read from (a model's GGUF)")
    ap.add_argument("--size-mib", type=float, default=1.0, help="each read's size")
    ap.add_argument("--bursts", default="1,2,4,6,12,24", help="reads per burst")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--mib-per-pass", type=int, default=240,
                    help="MiB read per pass of each burst size")
    args = ap.parse_args(argv)
    size = max(4096, int(args.size_mib * MIB) // 4096 * 4096)
    if args.model.stat().st_size < 4 * size * 24:
        raise SystemExit(f"{args.model} is too small for random reads of this size")
    supply = PageSupply()
    if not supply.enabled:
        print(f"huge pages: none here ({supply.note}); both rows read into plain pages")
    print(f"{size / MIB:g} MiB reads over {args.lanes} lanes, O_DIRECT, best of 3 passes")
    print(f"{'burst':>5s} {'plain MiB/s':>11s} {'ms/burst':>8s} {'huge MiB/s':>10s} "
          f"{'ms/burst':>8s} {'plain/huge':>10s}")
    try:
        for n, burst in enumerate(int(x) for x in args.bursts.split(",")):
            rounds = max(4, int(args.mib_per_pass * MIB / size) // burst)
            huge_s = bursts(args.model, size, burst, rounds, supply, args.lanes, seed=n)
            plain_s = bursts(args.model, size, burst, rounds, None, args.lanes, seed=n)
            rate = burst * size / MIB
            print(f"{burst:5d} {rate / plain_s:11.0f} {plain_s * 1e3:8.2f} "
                  f"{rate / huge_s:10.0f} {huge_s * 1e3:8.2f} {huge_s / plain_s:10.2f}",
                  flush=True)
    finally:
        supply.close()
    print("(plain/huge: plain pages' rate against huge pages', measured in the same run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
