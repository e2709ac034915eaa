"""Where a GGUF file keeps its routed experts: read from the header, before llama.cpp loads.

An *expert tensor* is `blk.<l>.ffn_<kind>_exps.weight` (kind gate, up, down or the merged
gate_up): ne = [rows, cols, n_expert], one expert's slice is `nb[2]` = nbytes / n_expert
bytes at `data_offset + e * nb[2]`. A *unit* is one (layer, expert): its slices in every
expert tensor of the layer, what the cache holds and counts. Everything else in the file
(attention, norms, router, embeddings, shared experts) is *dense*.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

PAGE = os.sysconf("SC_PAGE_SIZE")
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_ROUTER_NAME = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    layer: int
    kind: str
    offset: int         # absolute file offset of the tensor's data
    nbytes: int
    n_expert: int

    @property
    def slice_bytes(self) -> int:
        return self.nbytes // self.n_expert


@dataclass(frozen=True)
class Layout:
    path: Path
    file_size: int
    arch: str
    n_layer: int        # layers that have routed experts (blk indices 0..n_layer-1 may skip)
    n_expert: int
    n_expert_used: int
    experts: tuple[ExpertTensor, ...]
    dense: tuple[tuple[int, int], ...]   # (offset, nbytes) of every other tensor
    # blk.<l>.ffn_gate_inp.weight: (layer, offset, nbytes, ggml type, n_expert, n_embd)
    routers: tuple[tuple[int, int, int, int, int, int], ...] = ()

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({t.layer for t in self.experts}))

    def tensors_of(self, layer: int) -> tuple[ExpertTensor, ...]:
        return tuple(t for t in self.experts if t.layer == layer)

    def unit_bytes(self, layer: int) -> int:
        return sum(t.slice_bytes for t in self.tensors_of(layer))

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.experts)

    @property
    def token_cycle_bytes(self) -> int:
        """Bytes one token's routed experts span over all layers (top-k in every layer)."""
        return sum(self.unit_bytes(layer) for layer in self.layers) * self.n_expert_used

    @property
    def dense_bytes(self) -> int:
        return sum(n for _, n in self.dense)


class LayoutError(ValueError):
    """The file is not a GGUF whose experts this engine can stream."""


def read_layout(path: str | os.PathLike[str]) -> Layout:
    """The expert tensors of a GGUF file (an empty `experts` for a dense model)."""
    p = Path(path)
    try:
        reader = gguf.GGUFReader(p)
    except (ValueError, OSError) as e:
        raise LayoutError(f"{p.name} is not a GGUF file this engine reads: {e}") from e
    try:
        return _layout_of(p, reader)
    finally:
        _close(reader)


def _close(reader: gguf.GGUFReader) -> None:
    # GGUFReader memory-maps the whole file; drop it now so that no mapping of ours is
    # left for the model file (the streamer finds llama.cpp's mapping in /proc/self/maps).
    mm = getattr(reader.data, "_mmap", None)
    reader.tensors.clear()
    reader.fields.clear()
    del reader.data
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return f.contents() if f is not None else None


def _layout_of(path: Path, reader: gguf.GGUFReader) -> Layout:
    arch = str(_field(reader, "general.architecture") or "")
    n_expert = int(_field(reader, f"{arch}.expert_count") or 0)
    n_used = int(_field(reader, f"{arch}.expert_used_count") or 0)
    experts: list[ExpertTensor] = []
    dense: list[tuple[int, int]] = []
    routers: list[tuple[int, int, int, int, int, int]] = []
    for t in reader.tensors:
        m = _EXPERT_NAME.match(t.name)
        n_bytes, offset = int(t.n_bytes), int(t.data_offset)
        r = _ROUTER_NAME.match(t.name)
        if r is not None and len(t.shape) == 2:
            routers.append((int(r.group(1)), offset, n_bytes, int(t.tensor_type),
                            int(t.shape[1]), int(t.shape[0])))
        if m is None or len(t.shape) != 3:
            dense.append((offset, n_bytes))
            continue
        ne2 = int(t.shape[2])
        if n_bytes % ne2:
            raise LayoutError(f"{t.name}: {n_bytes} bytes do not split into {ne2} experts")
        experts.append(ExpertTensor(t.name, int(m.group(1)), m.group(2), offset, n_bytes, ne2))
    if experts:
        if not n_expert or any(t.n_expert != n_expert for t in experts):
            raise LayoutError(f"{path.name}: expert tensors disagree with {arch}.expert_count")
        if not 1 <= n_used <= n_expert:
            raise LayoutError(f"{path.name}: {arch}.expert_used_count is {n_used}")
    experts.sort(key=lambda t: (t.layer, t.kind))
    return Layout(path=path, file_size=path.stat().st_size, arch=arch,
                  n_layer=(max(t.layer for t in experts) + 1) if experts else 0,
                  n_expert=n_expert, n_expert_used=n_used, experts=tuple(experts),
                  dense=tuple(sorted(dense)), routers=tuple(sorted(routers)))


def has_experts(path: str | os.PathLike[str]) -> bool:
    try:
        return bool(read_layout(path).experts)
    except LayoutError:
        return False
