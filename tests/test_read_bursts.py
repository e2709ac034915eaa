"""bench/read_bursts.py end to end on a small file: real bursts through the C read lanes,
into plain pages and into huge pages (or plain pages twice where the kernel has none),
each row's rates positive and its ratio the two rates' quotient."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("read_bursts", ROOT / "bench" / "read_bursts.py")
assert _spec is not None and _spec.loader is not None
read_bursts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(read_bursts)


def test_bursts_are_timed_into_both_kinds_of_pages(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
                     .tobytes())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        os.close(fd)
    except OSError:
        pytest.skip("no O_DIRECT on the test's file system")
    assert read_bursts.main([str(path), "--size-mib", "0.0625", "--bursts", "1,3",
                             "--mib-per-pass", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 3], out
    for _, plain, plain_ms, huge, _, ratio in rows:
        assert int(plain) > 0 and int(huge) > 0 and float(plain_ms) > 0
        assert float(ratio) == pytest.approx(int(plain) / int(huge), abs=0.01)
    assert "plain/huge" in out
    with pytest.raises(SystemExit, match="too small"):
        read_bursts.main([str(path), "--size-mib", "1"])
