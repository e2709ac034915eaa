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

# The models' GGUF header parser: pure (stdlib and gguf's type table), no model knowledge.
from ...models.probe import Header, Unreadable, read_file_header

PAGE = os.sysconf("SC_PAGE_SIZE")
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_ROUTER_NAME = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
_ROUTER_BIAS = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.bias$")


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    layer: int
    kind: str
    offset: int         # absolute file offset of the tensor's data
    nbytes: int
    n_expert: int
    ggml_type: int = -1     # the weights' ggml type (-1: not read)
    ne0: int = 0            # elements in a row
    ne1: int = 0            # rows in one expert

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
    # blk.<l>.ffn_gate_inp.bias (gpt-oss): (layer, offset, nbytes, ggml type, n_expert)
    router_biases: tuple[tuple[int, int, int, int, int], ...] = ()

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
    """The expert tensors of a GGUF file (an empty `experts` for a dense model).

    Read with the models' header parser, which skips long arrays (a real model's vocabulary
    of 150k-262k strings) without building them: gguf's own reader builds every item and
    took 20-60 s on Gemma 3's vocabulary."""
    p = Path(path)
    try:
        header = read_file_header(p)
    except Unreadable as e:
        raise LayoutError(f"{p.name} is not a GGUF file this engine reads: {e}") from e
    return _layout_of(p, header)


def _layout_of(path: Path, header: Header) -> Layout:
    kv = header.kv
    arch = str(kv.get("general.architecture") or "")
    n_expert = _int(kv.get(f"{arch}.expert_count"))
    n_used = _int(kv.get(f"{arch}.expert_used_count"))
    experts: list[ExpertTensor] = []
    dense: list[tuple[int, int]] = []
    routers: list[tuple[int, int, int, int, int, int]] = []
    biases: list[tuple[int, int, int, int, int]] = []
    for t in header.tensors:
        m = _EXPERT_NAME.match(t.name)
        n_bytes, offset = t.nbytes, header.header_bytes + t.offset
        r = _ROUTER_NAME.match(t.name)
        if r is not None and len(t.dims) == 2:
            routers.append((int(r.group(1)), offset, n_bytes, t.type, t.dims[1], t.dims[0]))
        b = _ROUTER_BIAS.match(t.name)
        if b is not None and len(t.dims) == 1:
            biases.append((int(b.group(1)), offset, n_bytes, t.type, t.dims[0]))
        if m is None or len(t.dims) != 3:
            dense.append((offset, n_bytes))
            continue
        ne2 = t.dims[2]
        if not ne2 or n_bytes % ne2:
            raise LayoutError(f"{t.name}: {n_bytes} bytes do not split into {ne2} experts")
        experts.append(ExpertTensor(t.name, int(m.group(1)), m.group(2), offset, n_bytes, ne2,
                                    t.type, t.dims[0], t.dims[1]))
    if experts:
        if not n_expert or any(t.n_expert != n_expert for t in experts):
            raise LayoutError(f"{path.name}: expert tensors disagree with {arch}.expert_count")
        if not 1 <= n_used <= n_expert:
            raise LayoutError(f"{path.name}: {arch}.expert_used_count is {n_used}")
    experts.sort(key=lambda t: (t.layer, t.kind))
    return Layout(path=path, file_size=path.stat().st_size, arch=arch,
                  n_layer=(max(t.layer for t in experts) + 1) if experts else 0,
                  n_expert=n_expert, n_expert_used=n_used, experts=tuple(experts),
                  dense=tuple(sorted(dense)), routers=tuple(sorted(routers)),
                  router_biases=tuple(sorted(biases)))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def has_experts(path: str | os.PathLike[str]) -> bool:
    try:
        return bool(read_layout(path).experts)
    except LayoutError:
        return False
