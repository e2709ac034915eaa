"""A ctypes mirror of `struct ggml_tensor` and the few ggml ops the streamer watches.

The layout follows the vendored `ggml/include/ggml.h` of llama-cpp-python 0.3.36
(llama.cpp 0c1e57098): type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10],
view_src, view_offs, data, name[64], extra, padding[8]. `check_layout()` verifies it
against the loaded libggml at runtime (the struct size through
`ggml_tensor_overhead()`, the op numbers through `ggml_op_name()`, and every field the
streamer reads by building two tensors in a scratch ggml context and reading them back
through the mirror), so a different llama.cpp build fails loudly at load instead of
reading the wrong fields. The same offsets are what the native graph callback
(`bmoe/native/evalcb.c`, see `evalcb.py`) is handed: `native_layout()`; the probe can read
its tensors through any reader, so that side is checked the same way. The library is
the one llama-cpp-python loaded (found through it, never by a path written here).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import llama_cpp._ggml

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
_GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object): offs, size, next, type, padding[4]

# enum ggml_op (ggml.h): the positions of the ops we test for.
GGML_OP_MUL_MAT_ID = 30
GGML_OP_VIEW = 37
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_OP_NONE = 0


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
OFF_NE = GgmlTensor.ne.offset
OFF_NB = GgmlTensor.nb.offset
OFF_SRC = GgmlTensor.src.offset
OFF_TYPE = GgmlTensor.type.offset
OFF_VIEW_SRC = GgmlTensor.view_src.offset


def native_layout() -> list[int]:
    """What the native callback reads, in the order `evalcb.c` takes it: the offsets of
    op, name, ne, nb, data and src, the struct's size, the VIEW and MUL_MAT_ID ops, the
    offsets of type and view_src, and the F32 type."""
    return [OFF_OP, OFF_NAME, OFF_NE, OFF_NB, OFF_DATA, OFF_SRC, ctypes.sizeof(GgmlTensor),
            GGML_OP_VIEW, GGML_OP_MUL_MAT_ID, OFF_TYPE, OFF_VIEW_SRC, GGML_TYPE_F32]


def tensor_at(address: int) -> GgmlTensor:
    return GgmlTensor.from_address(address)


def op_of(address: int) -> int:
    return ctypes.c_int.from_address(address + OFF_OP).value


def name_of(address: int) -> bytes:
    return ctypes.string_at(address + OFF_NAME)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL:
    """ggml, as llama-cpp-python loaded it (its own handle, so the signatures set here
    never touch llama-cpp-python's)."""
    lib = ctypes.CDLL(llama_cpp._ggml.libggml._name, mode=ctypes.RTLD_GLOBAL)
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def _probe_lib() -> ctypes.CDLL:
    """A handle of its own for the layout probe (others set these functions' signatures
    on `libggml()` with their own structure types)."""
    lib = ctypes.CDLL(llama_cpp._ggml.libggml._name)
    lib.ggml_init.restype = ctypes.c_void_p
    lib.ggml_init.argtypes = [_InitParams]
    lib.ggml_free.restype = None
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    lib.ggml_new_tensor_2d.restype = ctypes.c_void_p
    lib.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                       ctypes.c_int64]
    lib.ggml_view_1d.restype = ctypes.c_void_p
    lib.ggml_view_1d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_size_t]
    lib.ggml_set_name.restype = ctypes.c_void_p
    lib.ggml_set_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_get_data.restype = ctypes.c_void_p
    lib.ggml_get_data.argtypes = [ctypes.c_void_p]
    lib.ggml_mul.restype = ctypes.c_void_p
    lib.ggml_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
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
    for ggml_type, want in ((GGML_TYPE_I32, b"i32"), (GGML_TYPE_F32, b"f32"),
                            (GGML_TYPE_F16, b"f16")):
        if lib.ggml_type_name(ggml_type) != want:
            problems.append(f"ggml type {ggml_type} is {lib.ggml_type_name(ggml_type)!r}, "
                            f"expected {want!r}")
    if not problems:
        problems = _field_problems(_probe_lib())
    if problems:
        raise RuntimeError("this llama.cpp build does not match bmoe's ggml mirror: "
                           + "; ".join(problems))


Fields = dict[str, object]


def read_fields(address: int) -> Fields:
    """op, ne[:2], nb[:2], data, src[0], src[1], type, view_src and name of the tensor at
    `address`, read at the module's offsets (what `native_layout()` hands the native
    callback)."""
    def word(off: int, ctype: Any) -> int:
        return int(ctype.from_address(address + off).value or 0)

    i64, size = ctypes.c_int64, ctypes.c_size_t
    return {
        "op": word(OFF_OP, ctypes.c_int),
        "ne": [word(OFF_NE, i64), word(OFF_NE + 8, i64)],
        "nb": [word(OFF_NB, size), word(OFF_NB + 8, size)],
        "data": word(OFF_DATA, ctypes.c_void_p),
        "src[0]": word(OFF_SRC, ctypes.c_void_p),
        "src[1]": word(OFF_SRC + 8, ctypes.c_void_p),
        "type": word(OFF_TYPE, ctypes.c_int),
        "view_src": word(OFF_VIEW_SRC, ctypes.c_void_p),
        "name": ctypes.string_at(address + OFF_NAME),
    }


def _field_problems(lib: ctypes.CDLL,
                    read: Callable[[int], Fields] = read_fields) -> list[str]:
    """Build a 3×5 f32 tensor, a view of it and its product with a 3×5 f16 one in a
    scratch context; read type, ne, nb, op, src, view_src, view_offs, data and name back
    through the mirror, and op, ne, nb, data, src[0], src[1], type, view_src and name
    through `read` (the module's offsets, or the native side's)."""
    ctx = lib.ggml_init(_InitParams(1 << 16, None, False))
    if not ctx:
        return ["ggml_init failed for the layout probe"]
    try:
        base = lib.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 3, 5)
        lib.ggml_set_name(base, b"bmoe_layout_probe")
        view = lib.ggml_view_1d(ctx, base, 4, 8)
        lib.ggml_set_name(view, b"bmoe_layout_view")
        other = lib.ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 3, 5)
        both = lib.ggml_mul(ctx, base, other)       # same shapes: ggml asserts otherwise
        t, v = tensor_at(base), tensor_at(view)
        data = lib.ggml_get_data(base) or 0
        rb, rv, r2 = read(base), read(view), read(both)
        seen = {
            "type": (t.type, GGML_TYPE_F32),
            "ne": (rb["ne"], [3, 5]),
            "nb": (rb["nb"], [4, 12]),
            "op": (rb["op"], GGML_OP_NONE),
            "name": (rb["name"], b"bmoe_layout_probe"),
            "data": (rb["data"], data),
            "src[0] of a leaf": (rb["src[0]"], 0),
            "view op": (rv["op"], GGML_OP_VIEW),
            "view ne": (rv["ne"], [4, 1]),
            "view name": (rv["name"], b"bmoe_layout_view"),
            "src[0]": (rv["src[0]"], base),
            "read type": ((rb["type"], read(other)["type"]), (GGML_TYPE_F32, GGML_TYPE_F16)),
            "read view_src": (rv["view_src"], base),
            "view_src of a leaf": (rb["view_src"], 0),
            "src[1]": ((r2["src[0]"], r2["src[1]"]), (base, other)),
            "view data": (rv["data"], data + 8),
            "mirror ne": (list(t.ne), [3, 5, 1, 1]),
            "mirror nb": (list(t.nb), [4, 12, 60, 60]),
            "mirror data": (t.data or 0, data),
            "mirror src[0]": (v.src[0], base),
            "view_src": (v.view_src, base),
            "view_offs": (v.view_offs, 8),
        }
        return [f"{field} reads {got!r}, expected {want!r}"
                for field, (got, want) in seen.items() if got != want]
    finally:
        lib.ggml_free(ctx)
