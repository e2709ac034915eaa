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

With read-ahead, `guess(routers, ...)` hands the C side the next layers' routers (in
bfloat16): a one-token graph's routing then arrives in `route` with the next layers'
guesses already made in C, in `guess_rows` (see `predict.Predictor.from_rows`).

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
import numpy as np

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
        lib.bmoe_evalcb_guess.restype = ctypes.c_int
        lib.bmoe_evalcb_guess.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                          ctypes.c_int32, ctypes.c_int32, ctypes.c_float,
                                          ctypes.c_void_p, ctypes.c_void_p]
        lib.bmoe_evalcb_guess_bias.restype = ctypes.c_int
        lib.bmoe_evalcb_guess_bias.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.bmoe_evalcb_guess_for.restype = ctypes.c_int
        lib.bmoe_evalcb_guess_for.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
        lib.bmoe_evalcb_slots.restype = ctypes.c_int
        lib.bmoe_evalcb_slots.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                          ctypes.c_int32, ctypes.c_void_p]
        lib.bmoe_evalcb_rewrite.restype = ctypes.c_int
        lib.bmoe_evalcb_rewrite.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
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
        self._guess_arrays: tuple[np.ndarray, ...] = ()
        self._slot_arrays: tuple[np.ndarray, ...] = ()
        self.guess_rows: np.ndarray | None = None     # [depth, 1 + k]: see `guess`
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
        out = (ctypes.c_int64 * 11)()
        if self.lib.bmoe_evalcb_read(self._state, address, out) != 0:
            raise NativeUnavailable("the native callback's state is not initialised")
        return {"op": out[0], "ne": [out[1], out[2]], "nb": [out[3], out[4]],
                "data": out[5], "src[0]": out[6], "src[1]": out[10], "type": out[8],
                "view_src": out[9], "name": ctypes.string_at(out[7])}

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

    def guess(self, routers: dict[int, np.ndarray], n_layer: int, n_expert: int, depth: int,
              k: int, gate: float, biases: dict[int, np.ndarray] | None = None) -> bool:
        """Guess layers l+1 .. l+depth in C at each one-token routing of layer l, from
        `routers` (layer -> float [n_expert, n_embd]; kept here in bfloat16, rounded to
        nearest) and their `biases` where they have them (layer -> float [n_expert],
        added to the logits in float32). From the next graph on, `guess_rows[d]` holds, when `route` is called for
        layer l, the guess of layer l+1+d: a count, then that many ids, the most probable
        first; a count of -1 means no guess was made here (no router, or no router input
        in the graph), -2 a layer past the last. False (nothing changed) if the routers'
        shapes differ or C refused them."""
        shapes = {w.shape for w in routers.values()}
        if len(shapes) != 1 or not (0 < depth <= n_layer and 0 < k <= n_expert):
            return False
        n_out, n_embd = shapes.pop()
        if n_out != n_expert:
            return False
        w = np.zeros((n_layer, n_expert, n_embd), dtype=np.uint16)
        has = np.zeros(n_layer, dtype=np.uint8)
        for layer, r in routers.items():
            if 0 <= layer < n_layer:
                w[layer] = to_bf16(r)
                has[layer] = 1
        rows = np.full((depth, 1 + k), -2, dtype=np.int32)
        logits = np.zeros(n_expert, dtype=np.float32)
        bias = None
        if biases and any(0 <= layer < n_layer for layer in biases):
            if any(b.shape != (n_expert,) for b in biases.values()):
                return False
            bias = np.zeros((n_layer, n_expert), dtype=np.float32)
            for layer, b in biases.items():
                if 0 <= layer < n_layer:
                    bias[layer] = b
        if self.lib.bmoe_evalcb_guess(self._state, w.ctypes.data, has.ctypes.data, n_layer,
                                      n_expert, n_embd, depth, k, float(gate),
                                      rows.ctypes.data, logits.ctypes.data) != 0:
            return False
        if bias is not None and self.lib.bmoe_evalcb_guess_bias(self._state,
                                                                bias.ctypes.data) != 0:
            self.lib.bmoe_evalcb_guess(self._state, None, 0, 0, 0, 0, 0, 0, 0.0, None, None)
            return False
        # alive as long as C points at them
        self._guess_arrays = (w, has, logits) + ((bias,) if bias is not None else ())
        self.guess_rows = rows
        return True

    def guess_for(self, layer: int, h: np.ndarray) -> np.ndarray:
        """`guess_rows` for router input `h` (float32 [n_embd]) at layer `layer`, made the
        way the callback makes them (for tests)."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        if self.guess_rows is None or self.lib.bmoe_evalcb_guess_for(
                self._state, layer, h.ctypes.data) != 0:
            raise RuntimeError("guessing is not on")
        return self.guess_rows.copy()

    def slots(self, perm: np.ndarray | None) -> bool:
        """Hand the C side the expert slots' permutations (int64 [n_layer, n_expert],
        C-contiguous, updated in place by the streamer and kept alive here), for
        `rewrite`; None forgets them. False if C refused the shape."""
        if perm is None:
            self._slot_arrays = ()
            return self.lib.bmoe_evalcb_slots(self._state, None, 0, 0, None) == 0
        if perm.dtype.str != "<i8" or perm.ndim != 2 or not perm.flags.c_contiguous:
            return False
        scratch = np.zeros(perm.shape[1], dtype=np.float32)
        if self.lib.bmoe_evalcb_slots(self._state, perm.ctypes.data, perm.shape[0],
                                      perm.shape[1], scratch.ctypes.data) != 0:
            return False
        self._slot_arrays = (perm, scratch)
        return True

    def rewrite(self, node: int, layer: int) -> int:
        """Rewrite the routing node `node` of `layer` from experts to slots, and permute
        the router's probabilities to match (the streamer's `_slot_rewrite`, in C): 0, or
        a negative code (see `bmoe_evalcb_rewrite` in evalcb.c)."""
        return int(self.lib.bmoe_evalcb_rewrite(self._state, node, layer))

    def stats(self) -> dict[str, Any]:
        """asks (every node's ask phase, answered in C), bind_calls and route_calls (the
        calls into Python), binding (whether MUL_MAT_ID asks still go to Python),
        resident_routes and resident_hits (routings counted in C), resident, guessed (next
        layers guessed in C from their router) and guess_missing (not guessed in C)."""
        out = (ctypes.c_uint64 * 9)()
        self.lib.bmoe_evalcb_stats(self._state, out)
        return {"asks": out[0], "bind_calls": out[1], "route_calls": out[2],
                "binding": bool(out[3]), "resident_routes": out[4], "resident_hits": out[5],
                "resident": bool(out[6]), "guessed": out[7], "guess_missing": out[8]}


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32."""
    return (b.astype(np.uint32) << 16).view(np.float32)
