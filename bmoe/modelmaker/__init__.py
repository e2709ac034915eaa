"""Deterministic GGUF test models: tiny ones for the tests, multi-GB ones for benchmarks.

Theory of operation
-------------------
`make_model` writes a qwen3moe (or dense qwen3, or deepseek2) file with the `gguf`
package. The same arguments give the same bytes: every tensor chunk draws from its own SFC64
generator seeded by (seed, tensor name, chunk index), and no time or path goes into the file.

*deepseek2* is DeepSeek V2/V3's layout as llama.cpp loads it: multi-head latent attention
(MLA: Q straight from the hidden state or through a `q_lora_rank` bottleneck; K and V
compressed to `kv_lora_rank` plus a shared RoPE part of `qk_rope_head_dim`, written as the
absorbed `attn_k_b` / `attn_v_b` pair, so the KV cache is one "head" of kv_lora_rank +
qk_rope_head_dim), `n_dense_lead` leading layers with a dense FFN, then routed experts
beside `n_expert_shared` always-on shared experts, gated by softmax or sigmoid (the latter
with the expert-choice bias `exp_probs_b`, zero here). Its residual stream is built like
qwen3moe's (embeddings dominate, small output projections), so routing follows the token;
`context_mix` (written for qwen3's q/k-norm attention) is not offered for it.

*Streaming.* All tensor infos are declared first, then header, metadata and tensor table
are written, then each tensor is generated and written chunk by chunk (one expert, or a few
MiB of rows, at a time), so a file of any size is written in bounded memory. Bulk weights
are drawn as 16-bit indices into a table of 65536 normal quantiles (fast, exactly
Gaussian-shaped); Q8_0 blocks are built directly (a per-tensor scale and int8 values).

*Vocabulary.* Byte-level BPE like Qwen's: the 256 byte tokens (GPT-2's byte-to-unicode
mapping), merges learnt from a small built-in English/code/JSON corpus, then the special
tokens: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as CONTROL tokens, and the tags
`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`
as USER_DEFINED tokens, as Qwen3's own GGUFs have them (they are rendered by
detokenisation even with special=False; `control_tags=True` makes them CONTROL instead).
The vocabulary is padded with UNUSED `[PAD<i>]` tokens to a multiple of 64.

*Weights that make routing vary.* In a random-weight model attention averages the past and
every hidden state ends up alike, so the router picks the same experts for every token.
Here the residual stream is dominated by the token embedding: embeddings have rms
`embed_scale`, while attention output and expert down-projections are scaled by
`residual_scale` (small), and all norm weights are 1. So each layer's router input is close
to the normalised embedding of the current token, and routing follows the token.

Every embedding is ``sqrt(n_embd) * embed_scale * (a*u + sqrt(1-a^2)*z_t)`` with a shared
unit direction ``u`` (``a = SHARED_FRACTION``) and a token-specific unit ``z_t`` orthogonal to
it. The shared part is the handle for two things:

* **router skew** (popularity): router row ``j`` of layer ``l`` is a random part, orthogonal
  to ``u`` and scaled so that its logit is N(0, 1) per token, plus a multiple of ``u`` that
  adds a constant boost ``b_lj``. ``b_lj`` (`router_profile`) is ``router_skew`` for the
  layer's hottest expert, falling linearly to 0 across a "hot" quarter of the experts (a
  per-layer random choice). With ``router_skew = 0`` routing is plain random.
* **free generation stays printable**: the output rows of special, tag, padding, control
  byte and non-ASCII byte tokens are ``-k*u`` (logit about -`SUPPRESS_LOGIT`), so greedy
  or sampled text without a grammar never ends by itself and is printable ASCII; a grammar
  can still force any token.

*Locality.* With routing driven by the token alone, consecutive tokens share experts only
by popularity (top-4 of 64: 6 % at no skew; 30 % needs a top quarter taking ~85 %).
``context_mix`` > 0 turns layer 0's attention into a fixed local kernel (`ContextKernel`,
needs head_dim >= 64): it adds ``context_mix`` times the embedding's rms of a mixture of
the last ~`context_width` tokens to the residual stream, so every router sees the token
and its recent context, and consecutive tokens share experts as in real text.

Measured with llama.cpp's own routing (ffn_moe_topk, 12 layers x 64 experts, top-4,
n_embd 256, head_dim 64, 300 teacher-forced English tokens): top-quarter share /
consecutive overlap = 44 % / 6 % (plain), 58 % / 36 % (router_skew 1, context_mix 1.5),
69 % / 41 % (router_skew 1.5, context_mix 1.5), 82 % / 25 % (router_skew 2, no context).
These are properties of the weights only; the benchmark must measure its own routing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np

from bmoe.modelmaker.bpe import byte_to_unicode, train_merges
from bmoe.modelmaker.templates import FRAMINGS, chat_template

ARCHS = ("qwen3moe", "qwen3", "deepseek2")
MOE_ARCHS = ("qwen3moe", "deepseek2")
DTYPES = ("f32", "f16", "q8_0")
GATING = ("softmax", "sigmoid")  # deepseek2's expert gating functions (llama.cpp's names)
# The spec's fields only deepseek2 reads: left out of other archs' spec record, so their
# files keep the bytes they had before deepseek2 was added.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "n_dense_lead", "n_expert_shared", "expert_gating",
              "expert_weights_scale", "expert_weights_norm")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
N_MERGES = 448  # merges learnt from the corpus (fewer if the corpus runs out of pairs)
VOCAB_MULTIPLE = 64

SHARED_FRACTION = 0.5  # weight of the shared direction u in every token embedding
SUPPRESS_LOGIT = 30.0  # how far below the others suppressed tokens' logits sit
CONTEXT_SHARPNESS = 16.0  # peak attention score of the context kernel (see ContextKernel)
CONTEXT_BAND = 2.0  # kernel frequencies lie within this factor of the centre frequency
CONTEXT_MIN_LOCAL = 0.8  # share of attention the kernel must keep within 3 widths
CHUNK_ELEMENTS = 1 << 22  # about 4 M weights generated and written at a time

DEMO_FILE = "bmoe-demo-moe.gguf"

_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_Q8_BLOCK = 32
_Q8_BLOCK_BYTES = 34
_Q8_STEPS = 32.0  # int8 steps per standard deviation in Q8_0 blocks we build


# ---------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ModelSpec:
    """Everything that decides the bytes of a model file."""

    arch: str = "qwen3moe"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128  # dense FFN width (qwen3)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ctx_train: int = 32768
    rope_freq_base: float = 0.0  # 0 = auto: 1e6, or what the context kernel needs
    rms_eps: float = 1e-6
    dtype: str = "f32"
    seed: int = 0
    template: str = "hermes"
    think_prefill: bool = False
    control_tags: bool = False
    router_skew: float = 0.0
    context_mix: float = 0.0
    context_width: float = 3.0
    embed_scale: float = 1.0
    residual_scale: float = 0.05
    suppress_special: bool = True
    name: str = ""
    # deepseek2 only (MLA; its attention does not use n_head_kv or head_dim)
    q_lora_rank: int = 0  # 0: one attn_q matrix (as V2-Lite); > 0: attn_q_a, norm, attn_q_b
    kv_lora_rank: int = 32  # the compressed KV width (the cache's per-token row, with RoPE)
    qk_nope_head_dim: int = 32  # per-head Q/K width without RoPE
    qk_rope_head_dim: int = 16  # per-head Q/K width with RoPE (K's part shared by all heads)
    v_head_dim: int = 32
    n_dense_lead: int = 1  # leading layers with a dense FFN (n_ff) instead of experts
    n_expert_shared: int = 1  # always-on experts of width n_ff_exp beside the routed ones
    expert_gating: str = "softmax"  # one of GATING
    expert_weights_scale: float = 1.0  # routed experts' weights multiplied by this
    expert_weights_norm: bool = False  # the top-k weights renormalised to sum to 1

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid model spec: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if self.arch not in ARCHS:
            yield f"arch {self.arch!r} is not one of {ARCHS}"
        if self.dtype not in DTYPES:
            yield f"dtype {self.dtype!r} is not one of {DTYPES}"
        for label in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ctx_train"):
            if getattr(self, label) < 1:
                yield f"{label} must be >= 1"
        if self.n_head % self.n_head_kv:
            yield "n_head must be a multiple of n_head_kv"
        if self.head_dim % 2:
            yield "head_dim must be even (RoPE)"
        if self.is_moe:
            if not 1 <= self.n_expert_used <= self.n_expert <= 512:
                yield "need 1 <= n_expert_used <= n_expert <= 512"
            if self.n_ff_exp < 1:
                yield "n_ff_exp must be >= 1"
        elif self.n_ff < 1:
            yield "n_ff must be >= 1"
        if self.is_mla:
            yield from self._mla_problems()
        if self.dtype == "q8_0":
            for label, width in self._row_widths():
                if width % _Q8_BLOCK:
                    yield f"q8_0 needs {label} ({width}) to be a multiple of {_Q8_BLOCK}"
        if self.router_skew < 0 or self.context_mix < 0:
            yield "router_skew and context_mix must be >= 0"
        if self.context_mix > 0 and self.context_width < 1:
            yield "context_width must be >= 1 token"
        if self.embed_scale <= 0 or self.residual_scale < 0:
            yield "embed_scale must be > 0 and residual_scale >= 0"
        if self.template not in FRAMINGS:
            yield f"template {self.template!r} is not one of {FRAMINGS}"
        if self.context_mix > 0 and self.context_width >= 1:
            try:
                context_kernel(self)
            except ValueError as e:
                yield str(e)

    def _mla_problems(self) -> Iterator[str]:
        for label in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_expert_shared"):
            if getattr(self, label) < 1:
                yield f"{label} must be >= 1"
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            yield "qk_rope_head_dim must be even and >= 2 (RoPE)"
        if self.q_lora_rank < 0:
            yield "q_lora_rank must be >= 0 (0: no Q compression)"
        if not 0 <= self.n_dense_lead < self.n_layer:
            yield "need 0 <= n_dense_lead < n_layer (at least one layer with experts)"
        if self.n_dense_lead and self.n_ff < 1:
            yield "n_ff must be >= 1 (the leading dense layers)"
        if self.expert_gating not in GATING:
            yield f"expert_gating {self.expert_gating!r} is not one of {GATING}"
        if self.expert_weights_scale <= 0:
            yield "expert_weights_scale must be > 0"
        if self.context_mix > 0:
            yield "context_mix is written for qwen3's attention, not deepseek2's MLA"

    def _row_widths(self) -> Iterator[tuple[str, int]]:
        yield "n_embd", self.n_embd
        if self.is_mla:
            yield from self._mla_row_widths()
            return
        yield "n_head*head_dim", self.n_head * self.head_dim
        yield ("n_ff_exp", self.n_ff_exp) if self.is_moe else ("n_ff", self.n_ff)

    def _mla_row_widths(self) -> Iterator[tuple[str, int]]:
        if self.q_lora_rank:
            yield "q_lora_rank", self.q_lora_rank
        yield "kv_lora_rank", self.kv_lora_rank
        yield "qk_nope_head_dim", self.qk_nope_head_dim
        yield "n_head*v_head_dim", self.n_head * self.v_head_dim
        yield "n_ff_exp", self.n_ff_exp
        if self.n_dense_lead:
            yield "n_ff", self.n_ff

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHS

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek2"

    def has_experts(self, layer: int) -> bool:
        return self.is_moe and not (self.is_mla and layer < self.n_dense_lead)

    @property
    def rope_base(self) -> float:
        if self.rope_freq_base > 0:
            return self.rope_freq_base
        if self.context_mix > 0:
            return 1.0 / _context_band(self.context_width)[0]
        return 1_000_000.0

    @property
    def model_name(self) -> str:
        if self.name:
            return self.name
        if self.is_moe:
            shape = f"{self.n_layer}L-{self.n_expert}x{self.n_ff_exp}-top{self.n_expert_used}"
        else:
            shape = f"{self.n_layer}L-ff{self.n_ff}"
        return f"bmoe-test-{self.arch}-{shape}-e{self.n_embd}-{self.dtype}-s{self.seed}"


# ---------------------------------------------------------------------------------------
# Vocabulary

_CORPUS = r'''
The quick brown fox jumps over the lazy dog. This is a small model that was made for the
tests of a local server. It has not been trained, so what it writes is not meant to be
read; the tests check shapes, protocols and the number of tokens, never the prose.
Hello world! Hello there, how are you today? I am fine, thank you. What is the weather
like in Paris and in London? It is sunny and warm in the morning, and it will rain in the
evening. Please answer the question with a short sentence. Here is the answer you asked
for, and here are the results of the search. The user wants to read the file and then
write the new content to the output. Let me think about this step by step before I call
the tool. First, we need to find the function; then we can return the value.
You may call one or more functions to assist with the user query. You are provided with
function signatures within <tools></tools> XML tags. For each function call, return a json
object with function name and arguments within XML tags. You have access to the following
tools. If you choose to call a tool ONLY reply in the following format with NO suffix.
Required parameters MUST be specified. You are a helpful assistant.

def main(argv: list[str]) -> int:
    """Read the input file and print the number of lines."""
    parser = argparse.ArgumentParser(description="count lines")
    parser.add_argument("--path", type=str, default=None)
    args = parser.parse_args(argv)
    if args.path is None:
        return 1
    with open(args.path, "r", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line]
    for i, line in enumerate(lines):
        print(f"{i}: {line}")
    return 0

class Server:
    def __init__(self, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.host = host
        self.port = port

    async def handle(self, request: dict) -> dict:
        return {"status": "ok", "result": self.port}

function get(url, options) { const result = await fetch(url, options); return result.json(); }
if (x == null || x.length === 0) { throw new Error("empty"); } else { console.log(x); }
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
{"type": "function", "function": {"name": "read_file", "description": "Read a file",
"parameters": {"type": "object", "properties": {"path": {"type": "string"}},
"required": ["path"]}}}
{"role": "user", "content": "What is the time?"}, {"role": "assistant", "content": null}
[{"id": 1, "value": true}, {"id": 2, "value": false}, {"id": 3, "value": 0.5}]
<function=read_file>
<parameter=path>
/tmp/data.json
</parameter>
</function>
0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 -1 1e-6 0x1F
'''


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]
    ids: dict[str, int]  # special and tag tokens by text
    suppressed: tuple[int, ...]  # ids free generation must not produce

    @property
    def size(self) -> int:
        return len(self.tokens)


@lru_cache(maxsize=2)
def build_vocab(control_tags: bool = False) -> Vocab:
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [int(gguf.TokenType.NORMAL)] * 256
    merges = train_merges(_CORPUS, N_MERGES)
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(int(gguf.TokenType.NORMAL))
    tag_type = gguf.TokenType.CONTROL if control_tags else gguf.TokenType.USER_DEFINED
    ids: dict[str, int] = {}
    for text, kind in [(t, gguf.TokenType.CONTROL) for t in SPECIAL_TOKENS] + [
        (t, tag_type) for t in TAG_TOKENS
    ]:
        ids[text] = len(tokens)
        tokens.append(text)
        types.append(int(kind))
    while len(tokens) % VOCAB_MULTIPLE:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return Vocab(
        tokens=tuple(tokens),
        types=tuple(types),
        merges=tuple(f"{a} {b}" for a, b in merges),
        ids=ids,
        suppressed=tuple(_suppressed_ids(tokens, types)),
    )


def _suppressed_ids(tokens: Sequence[str], types: Sequence[int]) -> Iterator[int]:
    u2b = {u: b for b, u in byte_to_unicode().items()}
    allowed_bytes = set(range(0x20, 0x7F)) | {0x09, 0x0A}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind != gguf.TokenType.NORMAL:
            yield i
        elif any(u2b[c] not in allowed_bytes for c in text):
            yield i


def special_token_ids(control_tags: bool = False) -> dict[str, int]:
    """Ids of the special and tag tokens (the same for every model the maker writes)."""
    return dict(build_vocab(control_tags).ids)


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
        if self.qtype == gguf.GGMLQuantizationType.Q8_0:
            return self.n_elements // _Q8_BLOCK * _Q8_BLOCK_BYTES
        return self.n_elements * (2 if self.qtype == gguf.GGMLQuantizationType.F16 else 4)


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
        plan.append(_Tensor(blk + "ffn_norm.weight", (d,), f32, fill=1.0))
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
    return [
        _Tensor(blk + "attn_q.weight", (q_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_k.weight", (kv_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_v.weight", (kv_width, d), big, std=d**-0.5),
        _Tensor(blk + "attn_output.weight", (d, q_width), big, std=res * q_width**-0.5),
        _Tensor(blk + "attn_q_norm.weight", (spec.head_dim,), f32, fill=1.0),
        _Tensor(blk + "attn_k_norm.weight", (spec.head_dim,), f32, fill=1.0),
    ]


def _context_attn_plan(spec: ModelSpec, blk: str) -> list[_Tensor]:
    """Layer 0 attention as a fixed local kernel over the last few tokens (see context_kernel)."""
    d, big = spec.n_embd, _QTYPES[spec.dtype]
    q_width, kv_width = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    f32 = gguf.GGMLQuantizationType.F32
    sharp = context_kernel(spec).norm_weight
    return [
        _Tensor(blk + "attn_q.weight", (q_width, d), big, structured="ctx_qk"),
        _Tensor(blk + "attn_k.weight", (kv_width, d), big, structured="ctx_qk"),
        _Tensor(blk + "attn_v.weight", (kv_width, d), big, structured="ctx_v"),
        _Tensor(blk + "attn_output.weight", (d, q_width), big, structured="ctx_o"),
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
    plan = [
        _Tensor(blk + "ffn_gate_inp.weight", (e, d), router, structured="router", layer=il),
        _Tensor(blk + "ffn_gate_exps.weight", (e, ff, d), big, std=d**-0.5),
        _Tensor(blk + "ffn_up_exps.weight", (e, ff, d), big, std=d**-0.5),
        _Tensor(blk + "ffn_down_exps.weight", (e, d, ff), big, std=res * ff**-0.5),
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


@dataclass(frozen=True)
class ContextKernel:
    """Layer 0's attention when `context_mix` > 0.

    Q and K read only the shared direction u, so after q/k-norm they are the same vector at
    every position, with energy only in RoPE pairs whose frequency lies in CONTEXT_THETAS.
    The attention score between positions t and t-j is then a function of j alone,
    ``sharpness * mean_i cos(j * theta_i)``: a bump about `context_width` tokens wide around
    the current token. V reads the token-specific part of the embedding; the output adds
    ``context_mix`` times the embedding's rms of this local mixture to the residual stream.
    So every layer's router sees the current token plus its recent context, and
    consecutive tokens share part of their routing, as in real text.
    """

    pairs: tuple[int, ...]  # RoPE pair indices (first half of each head) carrying Q/K
    thetas: tuple[float, ...]
    sharpness: float  # peak attention score
    norm_weight: float  # q_norm/k_norm weight that gives that score
    weights: tuple[float, ...]  # attention over j = 0, 1, 2, ... tokens back (long context)

    @property
    def mix_rms(self) -> float:
        """rms of the attention's value mixture for unit-rms, independent values."""
        return float(np.sqrt(np.sum(np.square(self.weights))))


def _context_band(width: float) -> tuple[float, float]:
    # A bump exp(S * mean cos(j*theta)) has width ~ 1/(theta_rms * sqrt(S)) tokens.
    centre = 1.0 / (width * np.sqrt(CONTEXT_SHARPNESS))
    return centre / CONTEXT_BAND, centre * CONTEXT_BAND


def context_kernel(spec: ModelSpec) -> ContextKernel:
    half = spec.head_dim // 2
    thetas = spec.rope_base ** (-np.arange(half) / half)
    lo, hi = _context_band(spec.context_width)
    pairs = [i for i in range(half) if lo * 0.999 <= thetas[i] <= hi]
    sel = thetas[pairs]
    sharpness = 1.0 / (spec.context_width**2 * float(np.mean(sel**2))) if pairs else 0.0
    j = np.arange(4096)
    scores = sharpness * np.cos(np.outer(j, sel)).mean(axis=1) if pairs else 0 * j
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    local = float(weights[: int(3 * spec.context_width) + 1].sum())
    if local < CONTEXT_MIN_LOCAL:
        raise ValueError(
            f"context_mix: head_dim {spec.head_dim} (rope base {spec.rope_base:g}) has "
            f"{len(pairs)} RoPE frequencies for a {spec.context_width:g}-token kernel, which "
            f"keeps only {local:.0%} of attention local; use head_dim >= 64"
        )
    return ContextKernel(
        pairs=tuple(pairs),
        thetas=tuple(float(x) for x in sel),
        sharpness=sharpness,
        norm_weight=float(np.sqrt(sharpness / np.sqrt(spec.head_dim))),
        weights=tuple(float(x) for x in weights[:64]),
    )


def _context_qk(spec: ModelSpec, n_heads: int) -> np.ndarray:
    u = _shared_direction(spec)
    pattern = np.zeros(spec.head_dim)
    pattern[list(context_kernel(spec).pairs)] = 1.0 / (SHARED_FRACTION * np.sqrt(spec.n_embd))
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
    rng: np.random.Generator, n: int, std: float, qtype: gguf.GGMLQuantizationType
) -> np.ndarray:
    idx = _indices(rng, n)
    if qtype == gguf.GGMLQuantizationType.F32:
        return (_normal_table() * std).astype(np.float32)[idx]
    if qtype == gguf.GGMLQuantizationType.F16:
        table = (_normal_table() * std).astype(np.float16).view(np.uint16)
        return table[idx]
    return _q8_blocks(idx, std)


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
        yield _bulk_chunk(_rng(spec.seed, t.name, k + 1), n_rows * row, t.std, t.qtype)


# ---------------------------------------------------------------------------------------
# Writing


def _add_metadata(w: gguf.GGUFWriter, spec: ModelSpec, vocab: Vocab) -> None:
    w.add_name(spec.model_name)
    w.add_file_type(int(_FILE_TYPES[spec.dtype]))
    if spec.dtype == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_head_count(spec.n_head)
    if spec.is_mla:
        _add_mla_metadata(w, spec)
    else:
        w.add_head_count_kv(spec.n_head_kv)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.is_moe:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if not spec.is_moe or spec.is_mla:
        w.add_feed_forward_length(spec.n_ff)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.types))
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(vocab.ids["<|im_end|>"])
    w.add_bos_token_id(vocab.ids["<|endoftext|>"])
    w.add_pad_token_id(vocab.ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template(spec.template, spec.think_prefill))
    w.add_string("bmoe.model_maker.spec", json.dumps(_spec_record(spec), sort_keys=True))


def _add_mla_metadata(w: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """deepseek2's keys as llama.cpp's converter writes them: MLA is MQA over the compressed
    KV (one KV head of kv_lora_rank + qk_rope_head_dim), `*_mla` the decompressed heads."""
    rope = spec.qk_rope_head_dim
    w.add_head_count_kv(1)
    w.add_key_length(spec.kv_lora_rank + rope)
    w.add_value_length(spec.kv_lora_rank)
    w.add_key_length_mla(spec.qk_nope_head_dim + rope)
    w.add_value_length_mla(spec.v_head_dim)
    w.add_q_lora_rank(spec.q_lora_rank)  # llama.cpp requires the key; 0 means attn_q
    w.add_kv_lora_rank(spec.kv_lora_rank)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(spec.n_dense_lead)
    w.add_expert_shared_count(spec.n_expert_shared)
    w.add_expert_weights_scale(spec.expert_weights_scale)
    w.add_expert_weights_norm(spec.expert_weights_norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType[spec.expert_gating.upper()])


def _spec_record(spec: ModelSpec) -> dict[str, object]:
    record = asdict(spec)
    if not spec.is_mla:
        for label in MLA_FIELDS:
            del record[label]
    return record


def _write(spec: ModelSpec, path: Path) -> None:
    vocab = build_vocab(spec.control_tags)
    plan = _plan(spec, vocab.size)
    w = gguf.GGUFWriter(path=None, arch=spec.arch)
    _add_metadata(w, spec, vocab)
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    out = w.fout[0]
    try:
        for t in plan:
            w.write_padding(out, out.tell())
            written = 0
            for chunk in _chunks(spec, vocab, t):
                out.write(np.ascontiguousarray(chunk).data.cast("B"))
                written += chunk.nbytes
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            w.write_padding(out, t.nbytes)
        out.flush()
        os.fsync(out.fileno())
    finally:
        w.close()


def make_model(path: str | os.PathLike[str], **params: object) -> Path:
    """Write a model file (atomically: a temp file, then a rename) and return its path.

    Keyword parameters are the fields of `ModelSpec`; the same parameters always give
    byte-identical files.
    """
    spec = ModelSpec(**params)  # type: ignore[arg-type]
    return write_atomically(path, lambda tmp: _write(spec, tmp))


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """`write` a file into a temporary name beside `path`, then rename it into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)  # mkstemp makes it private; a model file is not a secret
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def model_size(**params: object) -> int:
    """Tensor bytes a model would have (without writing it)."""
    spec = ModelSpec(**params)  # type: ignore[arg-type]
    return sum(t.nbytes for t in _plan(spec, build_vocab(spec.control_tags).size))


# ---------------------------------------------------------------------------------------
# Demo model and CLI


def demo_model_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / "models" / DEMO_FILE


def ensure_demo_model(data_dir: str | os.PathLike[str]) -> Path:
    """The tiny MoE demo model in `<data_dir>/models`, written if it is missing."""
    path = demo_model_path(data_dir)
    if not path.exists():
        make_model(path)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bmoe-cli make-model",
        description="Write a deterministic random-weight GGUF model "
                    "(qwen3moe, qwen3 or deepseek2).",
    )
    p.add_argument("--out", required=True, type=Path, help="output .gguf path")
    p.add_argument("--arch", choices=ARCHS, default="qwen3moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2, help="experts used per token")
    p.add_argument("--embd", type=int, default=64, help="embedding width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ff-exp", type=int, default=32, help="expert FFN width")
    p.add_argument("--ff", type=int, default=128, help="dense FFN width (qwen3)")
    p.add_argument("--ctx-train", type=int, default=32768)
    p.add_argument("--dtype", choices=DTYPES, default="f32")
    p.add_argument("--template", choices=FRAMINGS, default="hermes")
    p.add_argument("--think-prefill", action="store_true")
    p.add_argument("--router-skew", type=float, default=0.0,
                   help="logit boost of the hottest expert, in router-noise sigmas")
    p.add_argument("--context-mix", type=float, default=0.0,
                   help="weight of the recent-token context in the residual (head-dim >= 64)")
    p.add_argument("--context-width", type=float, default=3.0, help="context kernel, tokens")
    p.add_argument("--seed", type=int, default=0)
    mla = p.add_argument_group("deepseek2 (MLA)")
    mla.add_argument("--q-lora-rank", type=int, default=0, help="0: no Q compression")
    mla.add_argument("--kv-lora-rank", type=int, default=32)
    mla.add_argument("--nope-dim", type=int, default=32, help="per-head Q/K width without RoPE")
    mla.add_argument("--rope-dim", type=int, default=16, help="per-head Q/K width with RoPE")
    mla.add_argument("--v-dim", type=int, default=32, help="per-head V width")
    mla.add_argument("--dense-lead", type=int, default=1, help="leading dense-FFN layers")
    mla.add_argument("--shared-experts", type=int, default=1)
    mla.add_argument("--gating", choices=GATING, default="softmax")
    return p


def main_make_model(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    params: dict[str, object] = dict(
        arch=args.arch,
        n_layer=args.layers,
        n_expert=args.experts,
        n_expert_used=args.top_k,
        n_embd=args.embd,
        n_head=args.heads,
        n_head_kv=args.kv_heads,
        head_dim=args.head_dim,
        n_ff_exp=args.ff_exp,
        n_ff=args.ff,
        n_ctx_train=args.ctx_train,
        dtype=args.dtype,
        template=args.template,
        think_prefill=args.think_prefill,
        router_skew=args.router_skew,
        context_mix=args.context_mix,
        context_width=args.context_width,
        seed=args.seed,
    )
    if args.arch == "deepseek2":
        params |= dict(
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.nope_dim,
            qk_rope_head_dim=args.rope_dim,
            v_head_dim=args.v_dim,
            n_dense_lead=args.dense_lead,
            n_expert_shared=args.shared_experts,
            expert_gating=args.gating,
        )
    started = time.monotonic()
    try:
        path = make_model(args.out, **params)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    size = path.stat().st_size
    elapsed = time.monotonic() - started
    print(f"{path}  {size / 2**20:.1f} MiB  {elapsed:.2f} s")
    return 0
