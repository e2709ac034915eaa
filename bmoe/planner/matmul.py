"""One decode-shaped matmul through llama.cpp's own CPU backend (ggml), timed.

A ggml context holds a weight matrix of the model's own type and bytes (rows of one of
its expert tensors, read from the file) and one F32 vector; the graph multiplies the
vector by each of ``SLICES`` row blocks of it and sums the results: what a decoded token
does with every weight it touches, in many nodes as a decode does (each node is a
barrier for the compute threads, which is what makes extra threads cost on a busy
machine). The plan is
made once per thread count (``ggml_graph_plan``) with a work buffer we own, so repeated
runs allocate nothing. Nothing here touches a llama.cpp model or context, so it may run
on any thread.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from functools import lru_cache
from pathlib import Path

import llama_cpp

from ..engine.experts.ggml import GgmlTensor, libggml

MIB = 1 << 20
GRAPH_EXTRA = 4 * MIB           # the context's room beside the tensors
SLICES = 32                     # matmul nodes in the graph (a decode has hundreds)


class MatmulUnavailable(Exception):
    """The matmul could not be built or run here; the message is a sentence."""


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool)]


@lru_cache(maxsize=1)
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    base = libggml()
    cpu = ctypes.CDLL(str(Path(os.path.dirname(llama_cpp.__file__)) / "lib" / "libggml-cpu.so"),
                      mode=ctypes.RTLD_GLOBAL)
    vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_free.restype, base.ggml_free.argtypes = None, [vp]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, i64, i64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.restype = None
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_graph_overhead.restype, base.ggml_graph_overhead.argtypes = sz, []
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = sz, [ctypes.c_int, i64]
    base.ggml_view_2d.restype = vp
    base.ggml_view_2d.argtypes = [vp, vp, i64, i64, sz, sz]
    base.ggml_add.restype, base.ggml_add.argtypes = vp, [vp, vp, vp]
    base.ggml_blck_size.restype, base.ggml_blck_size.argtypes = i64, [ctypes.c_int]
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_graph_plan.restype = _CPlan
    cpu.ggml_graph_plan.argtypes = [vp, ctypes.c_int, vp]
    cpu.ggml_graph_compute.restype = ctypes.c_int
    cpu.ggml_graph_compute.argtypes = [vp, ctypes.POINTER(_CPlan)]
    cpu.ggml_cpu_init()
    return base, cpu


class MatmulBench:
    """``weights`` (whole rows of ``ne0`` elements of ggml type ``qtype``) times a vector."""

    def __init__(self, qtype: int, ne0: int, weights: bytes) -> None:
        try:
            base, self._cpu = _libs()
        except (OSError, AttributeError) as e:
            raise MatmulUnavailable(f"llama.cpp's CPU library could not be used ({e})") \
                from None
        self._base = base
        row = base.ggml_row_size(qtype, ne0)
        if ne0 <= 0 or row <= 0 or ne0 % max(1, base.ggml_blck_size(qtype)):
            raise MatmulUnavailable("the tensor's rows do not fit its type")
        n_rows = len(weights) // row
        if n_rows < 1:
            raise MatmulUnavailable("there is less than one row of weights to multiply")
        self.weight_bytes = n_rows * row
        self.type_name = (base.ggml_type_name(qtype) or b"?").decode()
        size = self.weight_bytes + ne0 * 4 + n_rows * 4 + base.ggml_graph_overhead() \
            + GRAPH_EXTRA
        self._ctx = base.ggml_init(_InitParams(size, None, False))
        if not self._ctx:
            raise MatmulUnavailable("ggml could not allocate the matmul's memory")
        w = base.ggml_new_tensor_2d(self._ctx, qtype, ne0, n_rows)
        x = base.ggml_new_tensor_2d(self._ctx, 0, ne0, 1)        # GGML_TYPE_F32
        ctypes.memmove(GgmlTensor.from_address(w).data, weights, self.weight_bytes)
        xs = (ctypes.c_float * ne0).from_address(GgmlTensor.from_address(x).data)
        for i in range(ne0):
            xs[i] = 0.01 * ((i % 7) - 3)
        self._graph = base.ggml_new_graph(self._ctx)
        base.ggml_build_forward_expand(self._graph, self._sum_of_slices(w, x, ne0, n_rows, row))
        self._work: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def _sum_of_slices(self, w: int, x: int, ne0: int, n_rows: int, row: int) -> int:
        """The weights as SLICES matmuls summed: a decode's many small nodes, each a
        barrier for the compute threads, not one large one (which flatters threads)."""
        base = self._base
        slices = max(1, min(SLICES, n_rows))
        per = n_rows // slices
        acc = 0
        for i in range(slices):
            view = base.ggml_view_2d(self._ctx, w, ne0, per, row, i * per * row)
            mm = base.ggml_mul_mat(self._ctx, view, x)
            acc = mm if not acc else base.ggml_add(self._ctx, acc, mm)
        self.weight_bytes = slices * per * row
        return acc

    def run(self, n_threads: int) -> None:
        plan = self._cpu.ggml_graph_plan(self._graph, n_threads, None)
        if plan.work_size:
            buf = self._work.get(n_threads)
            if buf is None or len(buf) < plan.work_size:
                buf = self._work[n_threads] = ctypes.create_string_buffer(plan.work_size)
            plan.work_data = ctypes.addressof(buf)
        if self._cpu.ggml_graph_compute(self._graph, ctypes.byref(plan)) != 0:
            raise MatmulUnavailable("llama.cpp's matmul did not complete")

    def rate(self, n_threads: int, seconds: float) -> float:
        """Weight bytes per second at ``n_threads``: the median run over about ``seconds``
        (a decode's speed is read as its median token too; on a shared machine a mean is
        ruled by the few runs another program's burst stalled)."""
        self.run(n_threads)                      # warm: caches, pages, threads
        times: list[float] = []
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            self.run(n_threads)
            times.append(time.perf_counter() - t0)
            if time.perf_counter() - start >= seconds and len(times) >= 5:
                return self.weight_bytes / statistics.median(times)

    def close(self) -> None:
        if self._ctx:
            self._base.ggml_free(self._ctx)
            self._ctx = None
