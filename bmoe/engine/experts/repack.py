"""Streamed experts in llama.cpp's repacked MXFP4 layout (its ``CPU_REPACK`` kernels).

A resident load hands MXFP4 expert tensors to llama.cpp's extra buffer type
``CPU_REPACK``: at load it rewrites every 8 rows into one interleaved block
(`block_mxfp4x8`) and its MUL_MAT_ID then runs the 8x8 kernels. The streamer loads the
model with extra buffer types off (its expert bytes come from the file, into its own
buffers), so its matmuls ran the file's layout: on the gpt-oss-120b slice an 8k prompt
ran at 34.5 tokens/s resident in that layout against 41-45 repacked, and decode took
0.0373 s/token against 0.0300 (`docs/benchmarks.md`, session 30).

So where the ``repack`` setting lets a resident load repack (the same kernel choice,
`bmoe.engine.kernels`), the streamer does it itself:

* every read of an MXFP4 expert slice is rewritten in place, right after it lands, into
  the repacked layout (`bmoe/native/readlanes.c`, ``pack_mxfp4_8``: the same bytes
  permuted within each group of 8 rows; the C lanes do it for the reads they run,
  ``pack_mxfp4`` for the reads the streamer waits on itself);
* when the streamer points a MUL_MAT_ID's weight at its buffer (`Streamer._bind`), it
  also hands the tensor to a small buffer of type ``CPU_REPACK`` (`Packer.adopt`) and
  lets that buffer type set the tensor's kernels (``tensor->extra``), as llama.cpp's
  loader would have; ggml then runs the repacked kernels on the streamer's bytes.

Which tensors: MXFP4 expert tensors whose rows come in whole groups of 8, and only where
this build's ``CPU_REPACK`` picks the 8x8 MXFP4 kernels for such a tensor on this CPU
(AVX2): `Packer.kernels_for` asks it with a scratch tensor of the same type and shape
before any read, and checks with 8 rows set through a real ``CPU_REPACK`` buffer that
its layout is the one `pack_mxfp4` writes (NEON's 4x4, say, is not). Any other type
keeps the file's layout.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from .. import moegemm
from ..kernels import extra_bufts
from . import ggml
from .reader import native_lanes

GGML_TYPE_MXFP4 = 39
BLOCK_BYTES = 17          # block_mxfp4: one exponent byte and 16 bytes of nibbles
BLOCK_ELEMS = 32
GROUP_ROWS = 8            # the rows one repacked block interleaves


class RepackUnavailable(RuntimeError):
    """This build or CPU has no repacked MXFP4 kernels for a tensor of this shape."""


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(ggml.libggml()._name)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, res, args in (
        ("ggml_backend_buft_alloc_buffer", vp, [vp, ctypes.c_size_t]),
        ("ggml_backend_buffer_init_tensor", ctypes.c_int, [vp, vp]),
        ("ggml_backend_buffer_set_usage", None, [vp, ctypes.c_int]),
        ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int]),
        ("ggml_init", vp, [ggml._InitParams]),
        ("ggml_free", None, [vp]),
        ("ggml_new_tensor_3d", vp, [vp, ctypes.c_int, i64, i64, i64]),
        ("ggml_backend_buffer_get_base", vp, [vp]),
        ("ggml_backend_buffer_free", None, [vp]),
        ("ggml_backend_tensor_alloc", ctypes.c_int, [vp, vp, vp]),
        ("ggml_backend_tensor_set", None, [vp, vp, ctypes.c_size_t, ctypes.c_size_t]),
    ):
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def _repack_buft() -> int:
    """The CPU backend's ``CPU_REPACK`` buffer type (0: this build has none here)."""
    return dict(extra_bufts()).get("CPU_REPACK", 0)


def row_bytes(ne0: int) -> int:
    return ne0 // BLOCK_ELEMS * BLOCK_BYTES


class Packer:
    """The ``CPU_REPACK`` buffer type and one small buffer of it that the streamer's
    repacked expert tensors are handed to (the bytes stay in the streamer's buffers; the
    buffer only tells ggml which kernels run them). One per process, never freed: a
    tensor of a model still loaded may point at it."""

    def __init__(self) -> None:
        lib = _lib()
        if lib.ggml_type_name(GGML_TYPE_MXFP4) != b"mxfp4":
            raise RepackUnavailable("this build's ggml types differ (no MXFP4 at 39)")
        self.buft = _repack_buft()
        if not self.buft:
            raise RepackUnavailable("this build has no CPU_REPACK buffer type on this CPU")
        self.buffer = lib.ggml_backend_buft_alloc_buffer(self.buft, 64)
        if not self.buffer:
            raise RepackUnavailable("a CPU_REPACK buffer could not be made")
        lib.ggml_backend_buffer_set_usage(self.buffer, 1)     # WEIGHTS, as a model's
        self._kernels: dict[tuple[int, int, int, int], int] = {}

    def kernels_for(self, ggml_type: int, ne0: int, ne1: int, ne2: int) -> int:
        """The kernels (``tensor->extra``) ``CPU_REPACK`` picks for a tensor of this type
        and shape on this CPU: asked with a scratch tensor. Raises RepackUnavailable
        where it picks none, or where they are not the 8x8 MXFP4 ones this module writes
        the layout of (only MXFP4, rows a multiple of 8, AVX2)."""
        key = (ggml_type, ne0, ne1, ne2)
        if key in self._kernels:
            return self._kernels[key]
        if ggml_type != GGML_TYPE_MXFP4 or ne0 % BLOCK_ELEMS or ne1 % GROUP_ROWS:
            raise RepackUnavailable("only MXFP4 rows in whole groups of 8 are repacked")
        extra = self.scratch_kernels(ggml_type, ne0, ne1, ne2)
        if not extra:
            raise RepackUnavailable("CPU_REPACK has no kernels for MXFP4 on this CPU "
                                    "(the 8x8 ones need AVX2)")
        if not self._same_layout(ggml_type, ne0, extra):
            raise RepackUnavailable("CPU_REPACK lays MXFP4 out otherwise on this CPU than "
                                    "the 8x8 blocks the streamer writes")
        self._kernels[key] = extra
        return extra

    def scratch_kernels(self, ggml_type: int, ne0: int, ne1: int, ne2: int) -> int:
        """The kernels object ``CPU_REPACK`` gives a tensor of any type and shape on this
        CPU (0: none), asked with a scratch tensor initialised in its buffer."""
        lib = _lib()
        ctx = lib.ggml_init(ggml._InitParams(1 << 12, None, True))
        if not ctx:
            raise RepackUnavailable("ggml_init failed")
        try:
            t = lib.ggml_new_tensor_3d(ctx, ggml_type, ne0, ne1, ne2)
            lib.ggml_backend_buffer_init_tensor(self.buffer, t)
            return int(ggml.tensor_at(t).extra or 0)
        finally:
            lib.ggml_free(ctx)

    def _same_layout(self, ggml_type: int, ne0: int, kernels: int) -> bool:
        """Whether `pack_mxfp4` writes, byte for byte, what ``CPU_REPACK`` writes for 8
        rows of `ne0` (a tensor set through a real buffer of that type), with the same
        kernels as the expert tensor's: the check that this CPU's choice is the 8x8
        layout (another CPU's, NEON's 4x4, would not match)."""
        import numpy as np

        readlanes = native_lanes()
        if readlanes is None:
            return False
        lib = _lib()
        rows = row_bytes(ne0)
        src = np.random.default_rng(ne0).integers(0, 256, GROUP_ROWS * rows, dtype=np.uint8)
        want = src.copy()
        readlanes.pack_mxfp4(want, rows)
        ctx = lib.ggml_init(ggml._InitParams(1 << 12, None, True))
        buf = lib.ggml_backend_buft_alloc_buffer(self.buft, src.nbytes + 64) if ctx else None
        try:
            if not buf:
                return False
            t = lib.ggml_new_tensor_3d(ctx, ggml_type, ne0, GROUP_ROWS, 1)
            base = lib.ggml_backend_buffer_get_base(buf)
            if lib.ggml_backend_tensor_alloc(buf, t, base) != 0:
                return False
            if (ggml.tensor_at(t).extra or 0) != kernels:
                return False
            lib.ggml_backend_tensor_set(t, src.ctypes.data, 0, src.nbytes)
            return bool(ctypes.string_at(base, src.nbytes) == want.tobytes())
        finally:
            if buf:
                lib.ggml_backend_buffer_free(buf)
            if ctx:
                lib.ggml_free(ctx)

    def adopt(self, tensor: int, kernels: int) -> None:
        """Hand the expert tensor at `tensor` (its data already the streamer's repacked
        bytes) to the ``CPU_REPACK`` buffer, and check that the buffer type set the
        kernels `kernels_for` found."""
        t = ggml.tensor_at(tensor)
        old_buffer, old_extra = t.buffer, t.extra
        t.buffer = self.buffer
        _lib().ggml_backend_buffer_init_tensor(self.buffer, tensor)
        if (t.extra or 0) != kernels:
            t.buffer, t.extra = old_buffer, old_extra
            raise RuntimeError(f"{ggml.name_of(tensor).decode(errors='replace')}: "
                               "llama.cpp's CPU_REPACK picked other kernels for it than "
                               "for its scratch twin")
        wrapper = moegemm.wrap(kernels)      # a prompt's rows four at a time, as resident
        if wrapper:
            t.extra = wrapper


_packer: Packer | None = None


def packer() -> Packer:
    """The process's Packer (made on first use)."""
    global _packer
    if _packer is None:
        _packer = Packer()
    return _packer
