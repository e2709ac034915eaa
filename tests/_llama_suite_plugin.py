"""A pytest plugin for llama.cpp's server tests run against bmoe-server (`_llama_suite`).

The suite's session fixture starts every preset once to fetch its model files and ends the
whole session at the first preset that does not start. Here a preset that does not start
is reported on stderr and skipped over, so each of its cases fails on its own (the same
start, the same refusal) and the other presets' cases run. Nothing else is changed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def pytest_configure(config: Any) -> None:
    sys.path.insert(0, str(Path(config.rootpath)))
    import utils  # the suite's own helpers (its rootdir is on the path)

    def load_all() -> None:
        for name, method in list(vars(utils.ServerPreset).items()):
            if name == "load_all" or not isinstance(method, staticmethod):
                continue
            server = method.__func__()
            server.offline = False
            try:
                server.start()
            except Exception as e:  # noqa: BLE001 - reported, and its cases fail alone
                print(f"llama-suite: preset {name} does not start: {e}", file=sys.stderr)
            finally:
                server.stop()

    utils.ServerPreset.load_all = staticmethod(load_all)
