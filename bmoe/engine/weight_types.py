"""Weights whose storage type llama.cpp's CPU kernels cannot combine with activations.

llama.cpp adds and multiplies some weights straight onto the F32 activations: the norms'
scales and shifts, every bias, a BERT's token-type row. ggml's CPU binary operations take
an F32 activation with an F32 weight only; any other weight type there is not a slower
path but ``GGML_ABORT`` ("binary_op: unsupported types") at the first decode, which ends
the whole process. ``convert_hf_to_gguf`` always writes such tensors in F32 and the
quantizer leaves them alone, so a file that stores them otherwise came from a converter
that got it wrong. This module reads the file's tensor table (no tensor data) and names the
first such tensor, so the load is refused with a reason instead.
"""

from __future__ import annotations

import os

from ..models.probe import TensorInfo, Unreadable, read_file_header

GGML_F32 = 0
_TYPE_NAMES = {1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1"}


def _added_to_activations(t: TensorInfo) -> bool:
    name = t.name
    return (len(t.dims) == 1 or name == "token_types.weight" or name.endswith(".bias")
            or name.endswith("_norm.weight"))


def first_unusable(path: str | os.PathLike[str]) -> TensorInfo | None:
    """The first tensor of the file llama.cpp would add to activations in a type its CPU
    kernels refuse; None when there is none (or the table cannot be read: llama.cpp's
    own loader then says what is wrong with the file)."""
    try:
        header = read_file_header(path)
    except (Unreadable, ValueError, OSError):
        return None
    for t in header.tensors:
        if _added_to_activations(t) and t.type != GGML_F32:
            return t
    return None


def type_name(qtype: int) -> str:
    return _TYPE_NAMES.get(qtype, f"type {qtype}")
