"""Guessing the next layers' experts before their routers run (read-ahead, `prefetch`).

When the router of layer l has run, its input — layer l's normalised hidden state h
(`ffn_norm-<l>`, the `src[1]` of the router's `ffn_moe_logits-<l>` matmul) — is still in
llama.cpp's graph memory: the layer's expert matmuls read it next. The residual stream
changes little from one layer to the next (each layer adds a small update to it), so
the router of layer l+1 applied to h, `softmax(W_{l+1} h)`, guesses l+1's choice before
l+1's attention has run. This is the approach of Pre-gated MoE (Hwang et al., ISCA 2024:
the next layer's gate evaluated on the current layer's input) and of the
activation-aware prefetching in MoE-Infinity (Xue et al., 2024); `depth` N applies the
routers of l+1 .. l+N to the same h. Only the `k` most probable experts whose probability
is at least `spec-gate` are guessed, the most probable first.

Router weights (and a router's bias, where it has one: gpt-oss) are read once from the
GGUF file (F32 or F16; a quantised router
falls back to the previous token's routing of that layer, as does a graph whose router
input cannot be found). The cost is one [n_expert, n_embd] matrix-vector product per
guessed layer, in numpy on the engine thread.

With the native callback the same guesses are made in C before the routing reaches
Python (`evalcb.NativeCallback.guess`: the routers in bfloat16, half the bytes to stream
past the compute), and `Predictor.from_rows` reads them; the numpy path here serves the
Python callback and the `invert` knob.

`Predictor.invert` (a test knob) guesses the k *least* probable experts: every guess
wrong, to check that wrong guesses only cost bandwidth.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from . import ggml
from .layout import Layout

_FLOAT_TYPES = {0: np.float32, 1: np.float16}     # GGML_TYPE_F32, GGML_TYPE_F16


def read_routers(layout: Layout) -> dict[int, np.ndarray]:
    """layer -> router weights [n_expert, n_embd] float32 (layers with a float router)."""
    out: dict[int, np.ndarray] = {}
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        for layer, offset, nbytes, ggml_type, n_expert, n_embd in layout.routers:
            dtype = _FLOAT_TYPES.get(ggml_type)
            if dtype is None or layer >= layout.n_layer:
                continue
            raw = os.pread(fd, nbytes, offset)
            w = np.frombuffer(raw, dtype=dtype)
            if w.size != n_expert * n_embd:
                continue
            out[layer] = w.astype(np.float32).reshape(n_expert, n_embd)
    finally:
        os.close(fd)
    return out


def read_router_biases(layout: Layout) -> dict[int, np.ndarray]:
    """layer -> the router's bias [n_expert] float32 (gpt-oss's routers have one, which
    llama.cpp adds to the logits before its top k), for layers with a float bias."""
    out: dict[int, np.ndarray] = {}
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        for layer, offset, nbytes, ggml_type, n_expert in layout.router_biases:
            dtype = _FLOAT_TYPES.get(ggml_type)
            if dtype is None or layer >= layout.n_layer or n_expert != layout.n_expert:
                continue
            b = np.frombuffer(os.pread(fd, nbytes, offset), dtype=dtype)
            if b.size == n_expert:
                out[layer] = b.astype(np.float32)
    finally:
        os.close(fd)
    return out


def _router_h(topk: ggml.GgmlTensor, layer: int) -> ggml.GgmlTensor | None:
    """Layer `layer`'s router input tensor h, found from its topk view
    (topk -> argsort -> probs -> logits -> (W, h)), or None where the graph differs."""
    argsort = topk.view_src or topk.src[0]
    probs = ggml.tensor_at(argsort).src[0] if argsort else None
    logits = ggml.tensor_at(probs).src[0] if probs else None
    if not logits or ggml.name_of(logits) != f"ffn_moe_logits-{layer}".encode():
        return None
    h_addr = ggml.tensor_at(logits).src[1]
    if not h_addr:
        return None
    h = ggml.tensor_at(h_addr)
    if h.type != 0 or not h.data:          # GGML_TYPE_F32
        return None
    return h


def router_input(topk: ggml.GgmlTensor, layer: int) -> np.ndarray | None:
    """Layer `layer`'s router input for the graph's last token, or None where the graph
    differs."""
    try:
        h = _router_h(topk, layer)
        if h is None:
            return None
        n_embd, n_tok, row = int(h.ne[0]), int(h.ne[1]), int(h.nb[1])
        addr = h.data + (n_tok - 1) * row
        return np.ctypeslib.as_array((ctypes.c_float * n_embd).from_address(addr)).copy()
    except (ValueError, OSError):
        return None


def router_rows(topk: ggml.GgmlTensor, layer: int) -> np.ndarray | None:
    """Layer `layer`'s router input for every token of the batch, [n_tok, n_embd], or
    None where the graph differs."""
    try:
        h = _router_h(topk, layer)
        if h is None:
            return None
        n_embd, n_tok, row = int(h.ne[0]), int(h.ne[1]), int(h.nb[1])
        if n_tok < 1 or row < 4 * n_embd or row % 4:
            return None
        flat = np.ctypeslib.as_array(
            (ctypes.c_float * ((n_tok - 1) * row // 4 + n_embd)).from_address(h.data))
        return np.lib.stride_tricks.as_strided(flat, shape=(n_tok, n_embd),
                                               strides=(row, 4)).copy()
    except (ValueError, OSError):
        return None


def batch_guess(router: np.ndarray | None, h: np.ndarray | None, k: int,
                n_expert: int, n_tok: int, bias: np.ndarray | None = None) -> np.ndarray:
    """A prompt batch's guess of the next layer's experts, most used first.

    With the next layer's router `router` [n_expert, n_embd] and this layer's router
    input for every token `h` [n_tok, n_embd] (n_tok tokens): the union over the tokens of
    each one's `k` most probable experts, ordered by how many tokens pick them (softmax
    keeps the order, so the logits' top k are the probabilities'; the router's `bias`,
    where it has one, is added first). Without them: every expert
    when the batch routes to more expert choices than the layer has (a 512-token batch
    with top-8 of 128 routes to nearly all of them), else nothing."""
    if router is None or h is None or router.shape[1] != h.shape[1] or not len(h):
        if n_tok * k >= n_expert:
            return np.arange(n_expert, dtype=np.int64)
        return np.zeros(0, dtype=np.int64)
    logits = h @ router.T                                    # [n_tok, n_expert]
    if bias is not None and bias.shape == (logits.shape[1],):
        logits += bias
    kk = min(k, logits.shape[1])
    top = np.argpartition(-logits, kk - 1, axis=1)[:, :kk]
    counts = np.bincount(top.ravel(), minlength=n_expert)
    order = np.argsort(-counts, kind="stable")
    return order[counts[order] > 0].astype(np.int64)


class Predictor:
    """Guesses of layers l+1 .. l+depth from layer l's router input."""

    def __init__(self, routers: dict[int, np.ndarray], n_layer: int, k: int, depth: int,
                 gate: float, biases: dict[int, np.ndarray] | None = None) -> None:
        self.routers = routers
        self.biases = biases or {}      # layer -> the router's bias (gpt-oss)
        self.n_layer = n_layer
        self.k = k
        self.depth = depth
        self.gate = float(gate)
        self.invert = False
        self.last: dict[int, np.ndarray] = {}     # previous token's routing per layer

    def from_rows(self, layer: int, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """`guesses` as the native callback made them for layer `layer` (its
        `guess_rows`: per next layer a count, then the ids; -1 where it had no router or
        router input, which falls back to that layer's previous routing as here)."""
        out = []
        for d in range(min(self.depth, len(rows))):
            j = layer + 1 + d
            if j >= self.n_layer:
                break
            n = int(rows[d, 0])
            if n < 0:
                prev = self.last.get(j)
                if prev is not None:
                    out.append((j, prev))
            elif n:
                out.append((j, rows[d, 1:1 + n].astype(np.int64)))
        return out

    def guesses(self, layer: int, h: np.ndarray | None) -> list[tuple[int, np.ndarray]]:
        """[(layer j, expert ids most likely first)] for j in layer+1 .. layer+depth."""
        out = []
        for j in range(layer + 1, min(self.n_layer, layer + 1 + self.depth)):
            w = self.routers.get(j)
            if h is None or w is None or w.shape[1] != h.shape[0]:
                prev = self.last.get(j)
                if prev is not None and not self.invert:
                    out.append((j, prev))
                continue
            logits = w @ h
            b = self.biases.get(j)
            if b is not None and b.shape == logits.shape:
                logits = logits + b
            p = np.exp(logits - logits.max())
            p /= p.sum()
            order = np.argsort(p if self.invert else -p, kind="stable")[: self.k]
            if not self.invert:
                order = order[p[order] >= self.gate]
            if len(order):
                out.append((j, order.astype(np.int64)))
        return out
