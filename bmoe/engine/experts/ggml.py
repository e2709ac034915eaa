"""A ctypes mirror of `struct ggml_tensor` and the few ggml ops the streamer watches.

The layout follows the vendored `ggml/include/ggml.h` of llama-cpp-python 0.3.36
(llama.cpp 0c1e57098): type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10],
view_src, view_offs, data, name[64], extra, padding[8]. `check_layout()` verifies it
against the loaded libggml at runtime (the struct size through
`ggml_tensor_overhead()`, the op numbers through `ggml_op_name()`), so a different
llama.cpp build fails loudly at load instead of reading the wrong fields.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import llama_cpp

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
_GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object): offs, size, next, type, padding[4]

# enum ggml_op (ggml.h): the positions of the ops we test for.
GGML_OP_MUL_MAT_ID = 30
GGML_OP_VIEW = 37
GGML_TYPE_I32 = 26


class GgmlTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


OFF_OP = GgmlTensor.op.offset
OFF_NAME = GgmlTensor.name.offset
OFF_DATA = GgmlTensor.data.offset


def tensor_at(address: int) -> GgmlTensor:
    return GgmlTensor.from_address(address)


def op_of(address: int) -> int:
    return ctypes.c_int.from_address(address + OFF_OP).value


def name_of(address: int) -> bytes:
    return ctypes.string_at(address + OFF_NAME)


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL:
    lib_dir = Path(os.path.dirname(llama_cpp.__file__)) / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def check_layout() -> None:
    """Raise RuntimeError when the loaded ggml does not match this mirror."""
    lib = libggml()
    size = lib.ggml_tensor_overhead() - _GGML_OBJECT_SIZE
    problems = []
    if size != ctypes.sizeof(GgmlTensor):
        problems.append(f"sizeof(ggml_tensor) is {size}, "
                        f"the mirror has {ctypes.sizeof(GgmlTensor)}")
    for op, want in ((GGML_OP_MUL_MAT_ID, b"MUL_MAT_ID"), (GGML_OP_VIEW, b"VIEW")):
        if lib.ggml_op_name(op) != want:
            problems.append(f"ggml op {op} is {lib.ggml_op_name(op)!r}, expected {want!r}")
    if lib.ggml_type_name(GGML_TYPE_I32) != b"i32":
        problems.append("GGML_TYPE_I32 moved")
    if problems:
        raise RuntimeError("this llama.cpp build does not match bmoe's ggml mirror: "
                           + "; ".join(problems))
