"""Quantize a model with llama.cpp's own quantizer (`llama_model_quantize`).

The model maker writes F32 / F16 / Q8_0 itself; every other type (the K-quants, the
IQ types, MXFP4 for experts) is what a person's real model carries, and only llama.cpp
writes those exactly as a real model has them. So the tests, the benchmarks and the
kernel probe quantize a model-maker file here, into a temp file renamed when whole.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

import llama_cpp as lc

# The file types llama.cpp's quantizer writes that the tests and the probe use, by the
# names llama-quantize takes. Each maps to llama.cpp's LLAMA_FTYPE_MOSTLY_<NAME>.
FTYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4_MOE")


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
