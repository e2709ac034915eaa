"""Quantize a model with llama.cpp's own quantizer (`llama_model_quantize`).

The model maker writes F32 / F16 / Q8_0 itself; every other type (the K-quants, the
IQ types, MXFP4 for experts) is what a person's real model carries, and only llama.cpp
writes those exactly as a real model has them. So the tests, the benchmarks and the
kernel probe quantize a model-maker file here, into a temp file renamed when whole.

`quantize_rows` is the same quantizer one matrix at a time (ggml's
`ggml_quantize_chunk`, which `llama_model_quantize` calls for every tensor): the model
maker writes quantized experts with it as it goes, where a whole source file first would
not fit the disk (`ModelSpec.expert_dtype`).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import gguf
import llama_cpp as lc
import llama_cpp._ggml
import numpy as np

# The file types llama.cpp's quantizer writes that the tests and the probe use, by the
# names llama-quantize takes. Each maps to llama.cpp's LLAMA_FTYPE_MOSTLY_<NAME>.
FTYPES = ("Q2_K", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4_MOE")


class QuantizeError(RuntimeError):
    pass


def ftype_of(name: str) -> int:
    """llama.cpp's file-type number for a quantization name (``Q4_K_M``)."""
    key = name.upper()
    value = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{key}", None)
    if key not in FTYPES or not isinstance(value, int):
        raise QuantizeError(f"unknown quantization {name!r}: choose one of {', '.join(FTYPES)}")
    return value


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str,
             *, threads: int = 1, requantize: bool = False) -> Path:
    """Write `src` quantized to `ftype` at `dst` (atomically) and return `dst`.

    `requantize` lets llama.cpp quantize tensors that are already quantized (a Q8_0
    source: half the F16 file, where an F16 slice of a large shape would not fit the disk).
    """
    target = Path(dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype_of(ftype)
    params.nthread = max(1, threads)
    params.allow_requantize = requantize
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                     ctypes.byref(params))
        if rc != 0:
            raise QuantizeError(f"llama.cpp could not quantize {Path(src).name} to {ftype} "
                                f"(code {rc})")
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# Types quantize_rows takes (the model maker's EXPERT_DTYPES): ggml quantizes them without
# an importance matrix, and gguf describes their blocks (GGML_QUANT_SIZES), so the output's
# size is known before ggml writes it.
ROW_TYPES = (gguf.GGMLQuantizationType.MXFP4,)
ROW_THREADS = max(1, min(4, os.cpu_count() or 1))   # row pieces quantized side by side


@lru_cache(maxsize=1)
def _quantize_chunk() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = llama_cpp._ggml.libggml.ggml_quantize_chunk   # found through llama-cpp-python's ggml
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


def quantize_rows(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The rows of a 2-D float32 array quantized to `qtype` by ggml, as bytes (uint8,
    one row of blocks per input row). The row length must be a whole number of blocks."""
    if qtype not in ROW_TYPES:
        raise QuantizeError(f"quantize_rows does not write {qtype.name}")
    rows = np.ascontiguousarray(values, dtype=np.float32)
    if rows.ndim != 2:
        raise QuantizeError("quantize_rows takes a 2-D array of rows")
    n_rows, n_per_row = rows.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if n_per_row % block:
        raise QuantizeError(f"{qtype.name} rows must be a multiple of {block} values, "
                            f"not {n_per_row}")
    row_bytes = n_per_row // block * size
    out = np.empty((n_rows, row_bytes), dtype=np.uint8)
    fn = _quantize_chunk()

    def piece(lo: int, hi: int) -> None:
        # ggml quantizes rows [lo, hi): it reads src + start and writes dst + lo rows of
        # blocks (`start` counts values)
        got = fn(int(qtype), rows.ctypes.data, out.ctypes.data, lo * n_per_row, hi - lo,
                 n_per_row, None)
        if got != (hi - lo) * row_bytes:
            raise QuantizeError(f"ggml wrote {got} bytes for {hi - lo} {qtype.name} rows, "
                                f"expected {(hi - lo) * row_bytes}")

    step = -(-n_rows // ROW_THREADS)
    spans = [(lo, min(n_rows, lo + step)) for lo in range(0, n_rows, step)]
    if len(spans) == 1:
        piece(*spans[0])
    else:
        with ThreadPoolExecutor(len(spans)) as pool:
            for f in [pool.submit(piece, lo, hi) for lo, hi in spans]:
                f.result()
    return out
