"""The made model's tensors: which (the plan, per architecture) and what is in them
(structured weights with the routing and context properties the package describes),
generated in chunks from per-tensor seeds.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import gguf
import numpy as np

from .quantize import quantize_rows
from .spec import (
    _Q8_BLOCK,
    _Q8_BLOCK_BYTES,
    _Q8_STEPS,
    _QTYPES,
    CHUNK_ELEMENTS,
    SHARED_FRACTION,
    SUPPRESS_LOGIT,
    ModelSpec,
    context_kernel,
)
from .vocab import Vocab

# ---------------------------------------------------------------------------------------
# Random numbers


def _rng(seed: int, name: str, chunk: int = 0) -> np.random.Generator:
    entropy = [seed & 0xFFFFFFFF, zlib.crc32(name.encode()), chunk]
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(entropy)))


@lru_cache(maxsize=1)
def _normal_table() -> np.ndarray:
    """65536 quantiles of N(0, 1), rescaled to unit variance exactly."""
    dist = statistics.NormalDist()
    n = 1 << 16
    table = np.array([dist.inv_cdf((i + 0.5) / n) for i in range(n)], dtype=np.float64)
    return table / table.std()


def _gaussian(rng: np.random.Generator, n: int) -> np.ndarray:
    """n draws from the normal table (float64 view of shape (n,))."""
    return _normal_table()[_indices(rng, n)]


def _indices(rng: np.random.Generator, n: int) -> np.ndarray:
    raw = rng.bit_generator.random_raw((n + 3) // 4)
    return raw.view(np.uint16)[:n]


def _unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _orthogonal_to(a: np.ndarray, u: np.ndarray) -> np.ndarray:
    return a - np.outer(a @ u, u)


# ---------------------------------------------------------------------------------------
# Tensor plan


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is the row (GGUF ne0)
    qtype: gguf.GGMLQuantizationType
    std: float = 0.0  # bulk random weights: N(0, std^2)
    fill: float | None = None  # constant tensors (norm weights)
    structured: str = ""  # "embd", "output", "router"
    layer: int = -1

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


def _plan(spec: ModelSpec, n_vocab: int) -> list[_Tensor]:
    d, big = spec.n_embd, _QTYPES[spec.dtype]
    f32 = gguf.GGMLQuantizationType.F32
    plan = [_Tensor("token_embd.weight", (n_vocab, d), big, structured="embd")]
    for il in range(spec.n_layer):
        blk = f"blk.{il}."
        plan.append(_Tensor(blk + "attn_norm.weight", (d,), f32, fill=1.0))
        if spec.is_mla:
            plan += _mla_plan(spec, blk)
        elif il == 0 and spec.context_mix > 0:
            plan += _context_attn_plan(spec, blk)
        else:
            plan += _attn_plan(spec, blk)
        if spec.is_gpt_oss:
            plan += _gpt_oss_attn_extras(spec, blk, il)
        plan.append(_Tensor(f"{blk}{spec.ffn_norm_name}.weight", (d,), f32, fill=1.0))
        plan += _ffn_plan(spec, blk, il)
    plan += [
        _Tensor("output_norm.weight", (d,), f32, fill=1.0),
        _Tensor("output.weight", (n_vocab, d), big, structured="output"),
    ]
    return plan


def _attn_plan(spec: ModelSpec, blk: str) -> list[_Tensor]:
    d, big, res = spec.n_embd, _QTYPES[spec.dtype], spec.residual_scale
    q_width, kv_width = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    f32 = gguf.GGMLQuantizationType.F32
    plan = [
        _Tensor(blk + "attn_q.weight", (q_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_k.weight", (kv_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_v.weight", (kv_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_output.weight", (d, q_width), big, std=res * q_width**-0.5),
    ]
    if spec.is_gpt_oss:     # no Q/K norms
        return plan
    return plan + [
        _Tensor(blk + "attn_q_norm.weight", (spec.head_dim,), f32, fill=1.0),
        _Tensor(blk + "attn_k_norm.weight", (spec.head_dim,), f32, fill=1.0),
    ]


# A gpt-oss sink logit that takes no share of the attention (exp(-30) beside scores near
# 0): the context kernel's layer keeps the weights `context_kernel` computed.
_NO_SINK = -30.0


def _gpt_oss_attn_extras(spec: ModelSpec, blk: str, il: int) -> list[_Tensor]:
    """gpt-oss's attention biases (zeros, as llama.cpp reads them) and per-head sinks: the
    other layers' sinks at 0, a share of each head's attention as in the real model."""
    d, f32 = spec.n_embd, gguf.GGMLQuantizationType.F32
    q_width, kv_width = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    sink = _NO_SINK if il == 0 and spec.context_mix > 0 else 0.0
    return [
        _Tensor(blk + "attn_q.bias", (q_width,), f32, fill=0.0),
        _Tensor(blk + "attn_k.bias", (kv_width,), f32, fill=0.0),
        _Tensor(blk + "attn_v.bias", (kv_width,), f32, fill=0.0),
        _Tensor(blk + "attn_output.bias", (d,), f32, fill=0.0),
        _Tensor(blk + "attn_sinks.weight", (spec.n_head,), f32, fill=sink),
    ]


def _context_attn_plan(spec: ModelSpec, blk: str) -> list[_Tensor]:
    """Layer 0 attention as a fixed local kernel over the last few tokens (see context_kernel)."""
    d, big = spec.n_embd, _QTYPES[spec.dtype]
    q_width, kv_width = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    f32 = gguf.GGMLQuantizationType.F32
    sharp = context_kernel(spec).norm_weight
    plan = [
        _Tensor(blk + "attn_q.weight", (q_width, d), big, structured="ctx_qk"),
        _Tensor(blk + "attn_k.weight", (kv_width, d), big, structured="ctx_qk"),
        _Tensor(blk + "attn_v.weight", (kv_width, d), big, structured="ctx_v"),
        _Tensor(blk + "attn_output.weight", (d, q_width), big, structured="ctx_o"),
    ]
    if spec.is_gpt_oss:     # no Q/K norms: the scale is in the weights (_context_qk)
        return plan
    return plan + [
        _Tensor(blk + "attn_q_norm.weight", (spec.head_dim,), f32, fill=sharp),
        _Tensor(blk + "attn_k_norm.weight", (spec.head_dim,), f32, fill=sharp),
    ]


def _mla_plan(spec: ModelSpec, blk: str) -> list[_Tensor]:
    """deepseek2's attention, in the split (absorbed) form llama.cpp's converter writes."""
    d, big, res = spec.n_embd, _QTYPES[spec.dtype], spec.residual_scale
    f32 = gguf.GGMLQuantizationType.F32
    h, nope, rope = spec.n_head, spec.qk_nope_head_dim, spec.qk_rope_head_dim
    kv, v, ql = spec.kv_lora_rank, spec.v_head_dim, spec.q_lora_rank
    q_width = h * (nope + rope)
    if ql:
        plan = [
            _Tensor(blk + "attn_q_a.weight", (ql, d), big, std=d**-0.5),
            _Tensor(blk + "attn_q_a_norm.weight", (ql,), f32, fill=1.0),
            _Tensor(blk + "attn_q_b.weight", (q_width, ql), big, std=ql**-0.5),
        ]
    else:
        plan = [_Tensor(blk + "attn_q.weight", (q_width, d), big, std=d**-0.5)]
    return plan + [
        _Tensor(blk + "attn_kv_a_mqa.weight", (kv + rope, d), big, std=d**-0.5),
        _Tensor(blk + "attn_kv_a_norm.weight", (kv,), f32, fill=1.0),
        _Tensor(blk + "attn_k_b.weight", (h, kv, nope), big, std=nope**-0.5),
        _Tensor(blk + "attn_v_b.weight", (h, v, kv), big, std=kv**-0.5),
        _Tensor(blk + "attn_output.weight", (d, h * v), big, std=res * (h * v) ** -0.5),
    ]


def _dense_ffn(spec: ModelSpec, blk: str, ff: int, suffix: str = "") -> list[_Tensor]:
    d, big, res = spec.n_embd, _QTYPES[spec.dtype], spec.residual_scale
    return [
        _Tensor(f"{blk}ffn_gate{suffix}.weight", (ff, d), big, std=d**-0.5),
        _Tensor(f"{blk}ffn_up{suffix}.weight", (ff, d), big, std=d**-0.5),
        _Tensor(f"{blk}ffn_down{suffix}.weight", (d, ff), big, std=res * ff**-0.5),
    ]


def _ffn_plan(spec: ModelSpec, blk: str, il: int) -> list[_Tensor]:
    d, big, res = spec.n_embd, _QTYPES[spec.dtype], spec.residual_scale
    if not spec.has_experts(il):
        return _dense_ffn(spec, blk, spec.n_ff)
    e, ff = spec.n_expert, spec.n_ff_exp
    router = gguf.GGMLQuantizationType.F32  # llama-quantize keeps routers in F32 too
    exps = _QTYPES[spec.expert_dtype] if spec.expert_dtype else big
    plan = [
        _Tensor(blk + "ffn_gate_inp.weight", (e, d), router, structured="router", layer=il),
        _Tensor(blk + "ffn_gate_exps.weight", (e, ff, d), exps, std=d**-0.5),
        _Tensor(blk + "ffn_up_exps.weight", (e, ff, d), exps, std=d**-0.5),
        _Tensor(blk + "ffn_down_exps.weight", (e, d, ff), exps, std=res * ff**-0.5),
    ]
    if spec.is_gpt_oss:
        # the router's bias, and each expert's biases (llama.cpp's add_id reads them by
        # the same expert ids as the matmuls)
        std = spec.expert_bias
        plan += [
            _Tensor(blk + "ffn_gate_inp.bias", (e,), router, std=std),
            _Tensor(blk + "ffn_gate_exps.bias", (e, ff), router, std=std),
            _Tensor(blk + "ffn_up_exps.bias", (e, ff), router, std=std),
            _Tensor(blk + "ffn_down_exps.bias", (e, d), router, std=res * std),
        ]
    if spec.is_mla:
        plan += _dense_ffn(spec, blk, ff * spec.n_expert_shared, "_shexp")
        if spec.expert_gating == "sigmoid":  # V3's expert-choice bias (zero: plain top-k)
            plan.append(_Tensor(blk + "exp_probs_b.bias", (e,), router, fill=0.0))
    return plan


# ---------------------------------------------------------------------------------------
# Tensor contents


def _shared_direction(spec: ModelSpec) -> np.ndarray:
    return _unit_rows(_gaussian(_rng(spec.seed, "shared-direction"), spec.n_embd))


def _token_embeddings(spec: ModelSpec, n_vocab: int) -> np.ndarray:
    u = _shared_direction(spec)
    z = _gaussian(_rng(spec.seed, "token_embd.weight"), n_vocab * spec.n_embd)
    z = _unit_rows(_orthogonal_to(z.reshape(n_vocab, spec.n_embd), u))
    a = SHARED_FRACTION
    return spec.embed_scale * np.sqrt(spec.n_embd) * (a * u + np.sqrt(1 - a * a) * z)


def _shared_gain(spec: ModelSpec) -> float:
    """How much the context mixed in by layer 0 shrinks the shared part of a normed state."""
    return float(np.sqrt(1.0 + spec.context_mix**2))


def _output_rows(spec: ModelSpec, vocab: Vocab) -> np.ndarray:
    d, u = spec.n_embd, _shared_direction(spec)
    w = _gaussian(_rng(spec.seed, "output.weight"), vocab.size * d).reshape(vocab.size, d)
    w = _orthogonal_to(w, u) / np.sqrt(d)
    if spec.suppress_special:
        k = SUPPRESS_LOGIT * _shared_gain(spec) / (SHARED_FRACTION * np.sqrt(d))
        w[list(vocab.suppressed)] = -k * u
    return w


def router_profile(spec: ModelSpec, layer: int) -> np.ndarray:
    """Per-expert router logit boost of a layer (in units of the router noise's std)."""
    boost = np.zeros(spec.n_expert)
    if spec.router_skew == 0 or not spec.is_moe:
        return boost
    hot = max(1, spec.n_expert // 4)
    order = _rng(spec.seed, "hot-experts", layer).permutation(spec.n_expert)
    boost[order[:hot]] = spec.router_skew * (1.0 - np.arange(hot) / hot)
    return boost


def _router(spec: ModelSpec, layer: int) -> np.ndarray:
    # Router input: the normed residual, sqrt(d) * (a*u + token part + context part) / gain.
    d, u, a = spec.n_embd, _shared_direction(spec), SHARED_FRACTION
    gain, mix2 = _shared_gain(spec), spec.context_mix**2
    name = f"blk.{layer}.ffn_gate_inp.weight"
    w = _gaussian(_rng(spec.seed, name), spec.n_expert * d).reshape(spec.n_expert, d)
    off_u_rms = np.sqrt((1 - a * a + mix2) / (1 + mix2))  # rms of the input off u, per sqrt(d)
    w = _orthogonal_to(w, u) / (np.sqrt(d) * off_u_rms)  # logit noise N(0, 1)
    boost = router_profile(spec, layer)
    return w + np.outer(boost * gain / (a * np.sqrt(d)), u)


def _context_qk(spec: ModelSpec, n_heads: int) -> np.ndarray:
    u = _shared_direction(spec)
    pattern = np.zeros(spec.head_dim)
    kernel = context_kernel(spec)
    # Q and K read a*sqrt(d) along u (layer 0's normed input): 1 on the kernel's pairs
    value = 1.0 / (SHARED_FRACTION * np.sqrt(spec.n_embd))
    if spec.is_gpt_oss:
        # no Q/K norm to scale them: the value qwen3's norm would give them, in the weights
        value *= kernel.norm_weight * np.sqrt(spec.head_dim / len(kernel.pairs))
    pattern[list(kernel.pairs)] = value
    return np.outer(np.tile(pattern, n_heads), u)


def _context_v(spec: ModelSpec) -> np.ndarray:
    d, u = spec.n_embd, _shared_direction(spec)
    rows = spec.n_head_kv * spec.head_dim
    w = _gaussian(_rng(spec.seed, "blk.0.attn_v.weight"), rows * d).reshape(rows, d)
    return _orthogonal_to(w, u) / np.sqrt(d * (1 - SHARED_FRACTION**2))


def _context_o(spec: ModelSpec) -> np.ndarray:
    d, u = spec.n_embd, _shared_direction(spec)
    cols = spec.n_head * spec.head_dim
    w = _gaussian(_rng(spec.seed, "blk.0.attn_output.weight"), d * cols).reshape(d, cols)
    w = _orthogonal_to(w.T, u).T  # nothing along u: the shared direction stays a constant
    scale = spec.context_mix * spec.embed_scale / (np.sqrt(cols) * context_kernel(spec).mix_rms)
    return w * scale


def _structured(spec: ModelSpec, vocab: Vocab, t: _Tensor) -> np.ndarray:
    if t.structured == "embd":
        return _token_embeddings(spec, vocab.size)
    if t.structured == "output":
        return _output_rows(spec, vocab)
    if t.structured == "ctx_qk":
        return _context_qk(spec, t.shape[0] // spec.head_dim)
    if t.structured == "ctx_v":
        return _context_v(spec)
    if t.structured == "ctx_o":
        return _context_o(spec)
    return _router(spec, t.layer)


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def _bulk_chunk(
    rng: np.random.Generator, n: int, std: float, qtype: gguf.GGMLQuantizationType,
    row: int,
) -> np.ndarray:
    idx = _indices(rng, n)
    if qtype == gguf.GGMLQuantizationType.F32:
        return (_normal_table() * std).astype(np.float32)[idx]
    if qtype == gguf.GGMLQuantizationType.F16:
        table = (_normal_table() * std).astype(np.float16).view(np.uint16)
        return table[idx]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        return _q8_blocks(idx, std)
    # the F32 weights this chunk has in an F32 file, through llama.cpp's row quantizer:
    # the bytes llama.cpp's quantizer writes from that file
    values = (_normal_table() * std).astype(np.float32)[idx]
    return quantize_rows(values.reshape(-1, row), qtype)


def _q8_blocks(idx: np.ndarray, std: float) -> np.ndarray:
    """Q8_0 blocks of Gaussian weights: one scale for the tensor, int8 quants."""
    quants = np.clip(np.rint(_normal_table() * _Q8_STEPS), -127, 127).astype(np.int8)
    blocks = np.empty((idx.size // _Q8_BLOCK, _Q8_BLOCK_BYTES), dtype=np.uint8)
    scale = np.float16(std / _Q8_STEPS)
    blocks[:, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    blocks[:, 2:] = quants.view(np.uint8)[idx].reshape(-1, _Q8_BLOCK)
    return blocks


def _chunks(spec: ModelSpec, vocab: Vocab, t: _Tensor) -> Iterator[np.ndarray]:
    """The tensor's data in file order, a bounded piece at a time."""
    if t.fill is not None:
        yield np.full(t.shape, t.fill, dtype=np.float32)
        return
    if t.structured:
        yield _encode(_structured(spec, vocab, t), t.qtype)
        return
    row = int(np.prod(t.shape[1:]))
    rows_per_chunk = max(1, CHUNK_ELEMENTS // row)
    for k, start in enumerate(range(0, t.shape[0], rows_per_chunk)):
        n_rows = min(rows_per_chunk, t.shape[0] - start)
        yield _bulk_chunk(_rng(spec.seed, t.name, k + 1), n_rows * row, t.std, t.qtype,
                          t.shape[-1])
