"""llama.cpp's backend, started once per process, and where its logs go.

`start()` initialises the backend and routes llama.cpp's logs (errors to stderr unless
`BMOE_LLAMA_LOG=0`, the rest dropped); `log_callback()` is that callback, which libmtmd
(`vision.py`) is given too so the projector logs the same way. The callback is kept
here for the life of the process: llama.cpp holds a pointer to it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import llama_cpp as lc

GGML_LOG_LEVEL_ERROR = 4  # ggml.h enum ggml_log_level

_log_callback_ref: Any = None
_backend_ready = False
_backend_lock = threading.Lock()


def start() -> None:
    """Initialise llama.cpp's backend and route its logs, once (any thread)."""
    global _log_callback_ref, _backend_ready
    with _backend_lock:
        if _backend_ready:
            return

        @lc.llama_log_callback
        def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            if level == GGML_LOG_LEVEL_ERROR and os.environ.get("BMOE_LLAMA_LOG", "1") != "0":
                os.write(2, b"llama.cpp: " + text)

        _log_callback_ref = _log
        lc.llama_log_set(_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def log_callback() -> Any:
    """The callback `start()` set, or None before it ran."""
    return _log_callback_ref
