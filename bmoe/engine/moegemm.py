"""A prompt's MoE matmuls on repacked experts, four tokens at a time (`bmoe/native/moegemm.c`).

llama.cpp's ``CPU_REPACK`` kernels run a dense layer's prompt batch with its *gemm*
kernels (each interleaved weight block read once for four rows), but a MoE layer's
MUL_MAT_ID with its one-row *gemv* kernel, once for every (token, expert) pair. On the
gpt-oss-120b slice that kernel was two thirds of a prompt's CPU. The native module wraps
the expert tensor's kernels (its ``tensor->extra``): a MUL_MAT_ID of at least 32 tokens
groups each expert's rows and runs llama.cpp's own gemm kernel on every four of them and
its gemv on the rest; everything else (decode steps, MUL_MAT, other ops) goes to
llama.cpp's object unchanged. The kinds wrapped are the ones this build's ``CPU_REPACK``
picks on x86 (AVX2 and up): MXFP4 (gpt-oss), Q4_K (Qwen3's Q4_K_M experts), Q4_0,
IQ4_NL and Q2_K (AVX-512), each in 8x8 blocks.

The wrapper only ever wraps an object whose virtual functions are exactly those of one
of the kinds in the loaded ``libggml-cpu`` (found by name), after the module has
checked its mirror of ``struct ggml_tensor`` against the loaded ggml; otherwise nothing
changes. A resident model gets it through an eval callback that answers "no" to every
node (`callback`); the expert streamer wraps the tensors it binds (`wrap`).

`BMOE_MOE_GEMM=0` in the environment turns it off (to compare).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import llama_cpp as lc

from .kernels import extra_bufts

log = logging.getLogger(__name__)

ENV = "BMOE_MOE_GEMM"
_NATIVE = Path(__file__).resolve().parent.parent / "native"


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    found = sorted(_NATIVE.glob("moegemm*.so"))
    if not found:
        return None
    try:
        lib = ctypes.CDLL(str(found[0]))
    except OSError:
        return None
    lib.bmoe_moegemm_init.restype = ctypes.c_int
    lib.bmoe_moegemm_init.argtypes = [ctypes.c_void_p]
    lib.bmoe_moegemm_wrap.restype = ctypes.c_void_p
    lib.bmoe_moegemm_wrap.argtypes = [ctypes.c_void_p]
    lib.bmoe_moegemm_kind.restype = ctypes.c_char_p
    lib.bmoe_moegemm_kind.argtypes = [ctypes.c_int32]
    lib.bmoe_moegemm_stats.restype = None
    lib.bmoe_moegemm_stats.argtypes = [ctypes.c_void_p]
    return lib


@lru_cache(maxsize=1)
def _ready() -> tuple[str, ...]:
    lib = _lib()
    if lib is None:
        return ()
    repack = dict(extra_bufts()).get("CPU_REPACK")
    if not repack:
        return ()
    # the buffer type's first field is its get_name: an address in the libggml-cpu that
    # llama.cpp runs, which the module finds its kernels in
    got = lib.bmoe_moegemm_init(ctypes.c_void_p.from_address(repack).value)
    if got < 0:
        log.warning("moegemm: this llama.cpp's struct ggml_tensor is not the one the native "
                    "module reads; prompt MoE matmuls keep llama.cpp's own kernels")
        return ()
    names = []
    for i in range(32):
        name = lib.bmoe_moegemm_kind(i)
        if name is None:
            break
        if got & (1 << i):
            names.append(name.decode())
    return tuple(names)


def enabled() -> bool:
    """Whether wrapping is on here: the native module loads, its layout check passed, it
    found at least one kind, and `BMOE_MOE_GEMM` is not "0"."""
    return os.environ.get(ENV, "").strip() != "0" and bool(_ready())


def kinds() -> tuple[str, ...]:
    """The kinds this build and CPU have kernels for (whether or not enabled)."""
    return _ready()


def wrap(traits: int) -> int:
    """The wrapper for a tensor's kernels object `traits` (its ``extra``), or 0 where it
    is not one of the kinds (or wrapping is off)."""
    lib = _lib()
    if not traits or lib is None or not enabled():
        return 0
    return int(lib.bmoe_moegemm_wrap(traits) or 0)


_CALLBACK: Any = None


def callback() -> Any:
    """The eval callback for a resident model's context (``cparams.cb_eval``, user data
    None), or None where wrapping is off."""
    global _CALLBACK
    lib = _lib()
    if lib is None or not enabled():
        return None
    if _CALLBACK is None:
        address = ctypes.cast(lib.bmoe_moegemm_evalcb, ctypes.c_void_p).value
        _CALLBACK = lc.ggml_backend_sched_eval_callback(address) if address else None
    return _CALLBACK


def stats() -> dict[str, int]:
    """``ops``: prompt MUL_MAT_IDs run by the wrapper since load; ``swaps``: tensors the
    resident callback gave it; ``padded``: an expert's last groups of two or three rows it
    ran as four (padded with copies of the last row)."""
    lib = _lib()
    out = (ctypes.c_uint64 * 3)()
    if lib is not None:
        lib.bmoe_moegemm_stats(out)
    return {"ops": int(out[0]), "swaps": int(out[1]), "padded": int(out[2])}
