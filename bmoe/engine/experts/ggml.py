"""A ctypes mirror of `struct ggml_tensor` and the few ggml ops the streamer watches.

The layout follows the vendored `ggml/include/ggml.h` of llama-cpp-python 0.3.36
(llama.cpp 0c1e57098): type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10],
view_src, view_offs, data, name[64], extra, padding[8]. `check_layout()` verifies it
against the loaded libggml at runtime (the struct size through
`ggml_tensor_overhead()`, the op numbers through `ggml_op_name()`, and every field the
streamer reads by building two tensors in a scratch ggml context and reading them back
through the mirror), so a different llama.cpp build fails loudly at load instead of
reading the wrong fields. The library is the one llama-cpp-python loaded (found through
it, never by a path written here).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

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
    if not problems:
        problems = _field_problems(_probe_lib())
    if problems:
        raise RuntimeError("this llama.cpp build does not match bmoe's ggml mirror: "
                           + "; ".join(problems))


def _field_problems(lib: ctypes.CDLL) -> list[str]:
    """Build a 3×5 f32 tensor and a view of it in a scratch context; read type, ne, nb,
    op, src, view_src, view_offs, data and name back through the mirror."""
    ctx = lib.ggml_init(_InitParams(1 << 16, None, False))
    if not ctx:
        return ["ggml_init failed for the layout probe"]
    try:
        base = lib.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 3, 5)
        lib.ggml_set_name(base, b"bmoe_layout_probe")
        view = lib.ggml_view_1d(ctx, base, 4, 8)
        t, v = tensor_at(base), tensor_at(view)
        seen = {
            "type": (t.type, GGML_TYPE_F32),
            "ne": (list(t.ne), [3, 5, 1, 1]),
            "nb": (list(t.nb), [4, 12, 60, 60]),
            "op": (op_of(base), GGML_OP_NONE),
            "name": (name_of(base), b"bmoe_layout_probe"),
            "data": (t.data, lib.ggml_get_data(base)),
            "view op": (op_of(view), GGML_OP_VIEW),
            "src[0]": (v.src[0], base),
            "view_src": (v.view_src, base),
            "view_offs": (v.view_offs, 8),
            "view data": (v.data, (t.data or 0) + 8),
        }
        return [f"{field} reads {got!r}, expected {want!r}"
                for field, (got, want) in seen.items() if got != want]
    finally:
        lib.ggml_free(ctx)
