"""Expert streaming: run an MoE whose file is larger than memory, reading routed experts.

llama.cpp computes; this package owns residency. It captures the expert tensors at
load, reads the experts each layer's router picks (in llama.cpp's graph-eval callback,
before the layer's expert matmuls), reads ahead the experts the next layers' routers
are expected to pick, and keeps the hot ones in one cache of a known byte budget. See
docs/expert-cache.md for the design as built, and `streamer` for its theory of operation.

Modules: `layout` (the GGUF header: where the experts are), `ggml` (the ctypes mirror of
`struct ggml_tensor`), `memory` (anonymous buffers, llama.cpp's file mapping),
`nopopulate` (a load that reads no experts), `reader` (O_DIRECT reads over parallel
lanes, and their priority queue), `cache` (the numpy cache and its policies), `predict`
(the next layers' guesses), `budget` (cache-mb and auto, and what a prompt batch needs
beside the cache), `allocs` (llama.cpp's buffer sizes, heard from its log), `streamer`
(the session's Streamer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...models.probe import Unreadable, read_file_header
from .layout import LayoutError, read_layout
from .streamer import ExpertStreamer

if TYPE_CHECKING:
    from ..session import Session

__all__ = ["ExpertStreamer", "streamer_factory"]


def streamer_factory(session: Session) -> ExpertStreamer | None:
    """The streamer for `session`'s model, or None (streaming off, or no routed experts)."""
    values: dict[str, Any] = session.values
    if not values.get("moe-stream", False):
        return None
    try:
        layout = read_layout(session.path)
    except LayoutError:
        return None    # not a GGUF we read: llama.cpp's load will say what is wrong
    if not layout.experts:
        return None
    if split_count(session.path) > 1:
        # The streamer reads one file; the experts of a split set's other shards are
        # not in this layout. Such a set runs on plain mmap (the probe says so too).
        return None
    return ExpertStreamer(session.path, layout, values)


def split_count(path: Any) -> int:
    """How many files the model at ``path`` is split into, by its header (1 if none)."""
    try:
        count = read_file_header(path).kv.get("split.count", 1)
    except Unreadable:
        return 1
    return count if isinstance(count, int) and count > 1 else 1
