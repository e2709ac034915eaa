"""The native graph callback (`bmoe/native/evalcb.c`): loading it, checking it, wiring it.

`NativeCallback(route, bind)` loads the extension module `bmoe.native.evalcb` (built
with the package by setup.py), takes its C functions through `ctypes.CDLL(its file)`,
hands it the ggml_tensor offsets of the checked mirror (`ggml.check_layout`,
`ggml.native_layout`) and then checks the C side itself: it reads the layout probe's
tensors back through `bmoe_evalcb_read` with those offsets. Any failure is
`NativeUnavailable` with a sentence saying why, and the streamer runs its Python callback
instead (`load_info["eval_callback"]` says which one runs).

`route(node, layer, k, n, row, data) -> bool` is called once per MoE layer and graph
(unless `resident(True, ...)` said every expert is in memory for good: then a routing is
only counted in C) with the layer's routing (I32 [k, n], rows `row` bytes apart, at `data`); `bind(node) ->
int` for each MUL_MAT_ID node's ask phase while tensors remain to rebind, returning how
many still do. Both are ctypes callbacks: they run on the engine thread (the one in
llama_decode), under the GIL, and must not raise.

`BMOE_EVAL_CALLBACK=python` in the environment forces the Python callback (for
comparisons).
"""

from __future__ import annotations

import ctypes
import importlib
import os
from collections.abc import Callable
from typing import Any

import llama_cpp as lc

from . import ggml

ENV = "BMOE_EVAL_CALLBACK"

ROUTE = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
BIND = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)


class NativeUnavailable(Exception):
    """The native callback cannot run here; the message says why."""


def forced_python() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "python"


def _library() -> ctypes.CDLL:
    try:
        evalcb = importlib.import_module("bmoe.native.evalcb")
    except ImportError as e:
        raise NativeUnavailable(f"the extension bmoe.native.evalcb is not built ({e})") from e
    path = getattr(evalcb, "__file__", None)
    if not path:
        raise NativeUnavailable("the extension bmoe.native.evalcb has no file")
    try:
        lib = ctypes.CDLL(path)
        lib.bmoe_evalcb_size.restype = ctypes.c_size_t
        lib.bmoe_evalcb_size.argtypes = []
        lib.bmoe_evalcb_init.restype = ctypes.c_int
        lib.bmoe_evalcb_init.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                                         ctypes.c_int32, ROUTE, BIND, ctypes.c_int32]
        lib.bmoe_evalcb_read.restype = ctypes.c_int
        lib.bmoe_evalcb_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_int64)]
        lib.bmoe_evalcb_forward.restype = None
        lib.bmoe_evalcb_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.bmoe_evalcb_resident.restype = ctypes.c_int
        lib.bmoe_evalcb_resident.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                             ctypes.c_int32]
        lib.bmoe_evalcb_local.restype = ctypes.c_int
        lib.bmoe_evalcb_local.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.bmoe_evalcb_record.restype = ctypes.c_int
        lib.bmoe_evalcb_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                           ctypes.c_int32]
        lib.bmoe_evalcb_stats.restype = None
        lib.bmoe_evalcb_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
        lib.bmoe_evalcb  # noqa: B018 - the callback itself must be there
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"the extension bmoe.native.evalcb does not load ({e})") from e
    return lib


class NativeCallback:
    """One streamer's native callback: its state (owned here) and the two Python entries."""

    def __init__(self, route: Callable[[int, int, int, int, int, int], bool],
                 bind: Callable[[int], int], *, binding: bool = True,
                 layout: list[int] | None = None) -> None:
        lib = _library()
        self.lib = lib
        # keep the ctypes callbacks alive as long as the state that points at them
        self._route = ROUTE(route)
        self._bind = BIND(bind)
        self._forward: Any = None
        self._rows: Any = None
        self._state = ctypes.create_string_buffer(lib.bmoe_evalcb_size())
        lay = ggml.native_layout() if layout is None else layout
        arr = (ctypes.c_int64 * len(lay))(*lay)
        if lib.bmoe_evalcb_init(self._state, arr, len(lay), self._route, self._bind,
                                int(binding)) != 0:
            raise NativeUnavailable("the native callback refused the ggml_tensor layout "
                                    f"{lay} (an offset outside the tensor or misaligned)")
        problems = ggml._field_problems(ggml._probe_lib(), self.read)
        if problems:
            raise NativeUnavailable("the native callback reads the layout probe wrongly: "
                                    + "; ".join(problems))
        address = ctypes.cast(lib.bmoe_evalcb, ctypes.c_void_p).value
        if not address:
            raise NativeUnavailable("the native callback has no address")
        self.fn = lc.ggml_backend_sched_eval_callback(address)

    @property
    def user_data(self) -> int:
        return ctypes.addressof(self._state)

    def read(self, address: int) -> ggml.Fields:
        """The fields of the tensor at `address` as the C side reads them."""
        out = (ctypes.c_int64 * 8)()
        if self.lib.bmoe_evalcb_read(self._state, address, out) != 0:
            raise NativeUnavailable("the native callback's state is not initialised")
        return {"op": out[0], "ne": [out[1], out[2]], "nb": [out[3], out[4]],
                "data": out[5], "src[0]": out[6], "name": ctypes.string_at(out[7])}

    def forward(self, fn: Any | None) -> None:
        """Send every node to `fn` (a `ggml_backend_sched_eval_callback`: the streamer's
        Python callback) from the next graph on, or with None answer in C again. For
        comparing the two within one context (bench/evalcb_cost.py); call it between
        decodes, on the engine thread."""
        self._forward = fn
        self.lib.bmoe_evalcb_forward(self._state, ctypes.cast(fn, ctypes.c_void_p) if fn else None)

    def resident(self, on: bool, n_layer: int = 0, n_expert: int = 0) -> bool:
        """Every expert is resident for good (on) or not any more (off): with it on, a
        routing with ids in range is only counted in C (`resident_routes`,
        `resident_hits`: the distinct experts it used). False if C refused."""
        return self.lib.bmoe_evalcb_resident(self._state, int(on), n_layer, n_expert) == 0

    def local_layers(self, n: int) -> bool:
        """Layers `n` and after are held by RPC helpers: their routing is not asked for."""
        return self.lib.bmoe_evalcb_local(self._state, n) == 0

    def record(self, rows: Any | None) -> bool:
        """While resident, write each one-token graph's routing into `rows` (an int32
        numpy array [n_layer, n_expert_used], C-contiguous, kept alive here); None stops.
        False if C refused the shape."""
        if rows is None:
            self._rows = None
            return self.lib.bmoe_evalcb_record(self._state, None, 0, 0) == 0
        if rows.dtype.str != "<i4" or rows.ndim != 2 or not rows.flags.c_contiguous:
            return False
        self._rows = rows
        return self.lib.bmoe_evalcb_record(self._state, rows.ctypes.data, rows.shape[0],
                                           rows.shape[1]) == 0

    def stats(self) -> dict[str, Any]:
        """asks (every node's ask phase, answered in C), bind_calls and route_calls (the
        calls into Python), binding (whether MUL_MAT_ID asks still go to Python),
        resident_routes and resident_hits (routings counted in C), resident."""
        out = (ctypes.c_uint64 * 7)()
        self.lib.bmoe_evalcb_stats(self._state, out)
        return {"asks": out[0], "bind_calls": out[1], "route_calls": out[2],
                "binding": bool(out[3]), "resident_routes": out[4], "resident_hits": out[5],
                "resident": bool(out[6])}
