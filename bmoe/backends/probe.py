"""The child process ``registry.py`` asks: ``python -m bmoe.backends.probe load PATH`` loads
one backend library into ggml, ``... dlopen NAME`` one system library, ``... list`` the
backends ggml registers at start, and prints one JSON
line (``{"ok": true, "name": ...}`` or ``{"ok": false, "error": ...}``). A library that
ends the process ends only this one."""

from __future__ import annotations

import ctypes
import json
import sys

from . import registry


def main(argv: list[str]) -> int:
    if argv == ["list"]:          # what ggml registers at start in this build
        print(json.dumps({"ok": True, "name": ",".join(registry.registered())}))
        return 0
    if len(argv) != 2 or argv[0] not in ("load", "dlopen"):
        print(json.dumps({"ok": False, "error": "usage: probe load PATH | dlopen NAME"}))
        return 2
    what, target = argv
    try:
        if what == "dlopen":
            ctypes.CDLL(target)
            name = target
        else:
            name = registry.load_here(target)
    except OSError as e:
        print(json.dumps({"ok": False, "error": str(e) if what == "load" else
                          "the library is not on this system or does not load"}))
        return 1
    print(json.dumps({"ok": True, "name": name}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
