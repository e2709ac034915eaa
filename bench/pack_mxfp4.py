"""The read lanes' MXFP4 permutation against a plain copy of the same bytes.

    python bench/pack_mxfp4.py [--row 2880] [--cold-mib 1024] [--hot-mib 4]

A streamed MXFP4 expert is permuted into llama.cpp's repacked layout by the read lane
right after it lands (`readlanes.pack_mxfp4`, in place). The baseline, measured in the
same run: a copy of the same number of bytes from another buffer (`numpy.copyto`), which
moves what the in-place permutation must move at least (every byte read once and written
once). Two sizes: `--cold-mib` (default 1 GiB: the caches evicted before each pass, as a
slice the disk just wrote) and `--hot-mib` (default 4 MiB: in the core's caches). Rows of
`--row` values (default 2,880: gpt-oss-120b's width, 1,530 bytes a row). Printed: the
best of the passes' GiB/s each and the permutation ÷ copy. One core.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bmoe.engine.experts.repack import row_bytes  # noqa: E402
from bmoe.native import readlanes  # noqa: E402

GIB = float(1 << 30)


def best_rate(fn: Callable[[], None], nbytes: int, passes: int,
              evict: np.ndarray | None) -> float:
    best = float("inf")
    for _ in range(passes):
        if evict is not None:
            evict += 1                   # 256 MiB written: the last pass's lines are gone
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GIB


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", type=int, default=2880, help="values a row (a multiple of 32)")
    p.add_argument("--cold-mib", type=int, default=1024)
    p.add_argument("--hot-mib", type=int, default=4)
    args = p.parse_args(argv)
    if readlanes is None:
        print("the native read lanes are not built here (python setup.py build_ext --inplace)")
        return 1
    rb = row_bytes(args.row)
    group = 8 * rb
    evict = np.ones(256 << 20, dtype=np.uint8)
    print(f"rows of {args.row} values ({rb} bytes), one core")
    for label, mib, passes, cold in (("cold", args.cold_mib, 3, True),
                                     ("hot", args.hot_mib, 20, False)):
        n = (mib << 20) // group * group
        a = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        b = np.empty_like(a)
        ev = evict if cold else None
        copy = best_rate(lambda a=a, b=b: np.copyto(b, a), n, passes, ev)
        pack = best_rate(lambda a=a: readlanes.pack_mxfp4(a, rb), n, passes, ev)
        print(f"{label:4s} {n / (1 << 20):8.0f} MiB: copy {copy:5.1f} GiB/s, permutation "
              f"{pack:5.1f} GiB/s, permutation / copy {pack / copy:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
