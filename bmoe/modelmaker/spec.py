"""What a made model is: its parameters (`ModelSpec`, checked when made), the
constants of the maker, and the context kernel a spec must admit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np

from bmoe.modelmaker.templates import FRAMINGS

ARCHS = ("qwen3moe", "qwen3", "deepseek2", "gpt-oss")


MOE_ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")


DTYPES = ("f32", "f16", "q8_0")


# Types the routed experts' three tensors may have instead of `dtype`, quantized as they
# are written by llama.cpp's own row quantizer (`quantize.quantize_rows`): the expert
# bytes a real model of that type streams, without a full-precision source file to
# quantize afterwards (a 12-layer slice of gpt-oss-120b would need 38 GiB of Q8_0 first).
# "" is `dtype`.
EXPERT_DTYPES = ("", "mxfp4")


GATING = ("softmax", "sigmoid")  # deepseek2's expert gating functions (llama.cpp's names)


# The spec's fields only gpt-oss reads: left out of other archs' spec record, as MLA_FIELDS.
GPT_OSS_FIELDS = ("sliding_window", "expert_bias")


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
    "mxfp4": gguf.GGMLQuantizationType.MXFP4,
}


# The file type a file with quantized experts declares: what llama.cpp's quantizer writes
# for that mix (MXFP4_MOE: experts in MXFP4, the other matrices in Q8_0).
_EXPERT_FILE_TYPES = {"mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}


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
    expert_dtype: str = ""  # one of EXPERT_DTYPES: the routed experts' type ("" = dtype)
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
    # gpt-oss only (its attention alternates sliding-window and full layers, has biases
    # and per-head sinks; its experts and router have biases, read by the expert ids)
    sliding_window: int = 128  # tokens a sliding-window layer (every other, from 0) sees
    expert_bias: float = 0.1  # std of the experts' and the router's biases (0: zeros)

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
        if self.is_gpt_oss and self.sliding_window < 1:
            yield "sliding_window must be >= 1 token"
        if self.is_gpt_oss and self.expert_bias < 0:
            yield "expert_bias must be >= 0"
        if self.expert_dtype:
            yield from self._expert_dtype_problems()
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

    def _expert_dtype_problems(self) -> Iterator[str]:
        if self.expert_dtype not in EXPERT_DTYPES:
            yield f"expert_dtype {self.expert_dtype!r} is not one of {EXPERT_DTYPES[1:]}"
            return
        if not self.is_moe:
            yield "expert_dtype needs an architecture with experts"
        block = gguf.GGML_QUANT_SIZES[_QTYPES[self.expert_dtype]][0]
        for label, width in (("n_embd", self.n_embd), ("n_ff_exp", self.n_ff_exp)):
            if width % block:
                yield f"{self.expert_dtype} experts need {label} ({width}) to be a multiple of {block}"

    @property
    def file_type(self) -> gguf.LlamaFileType:
        """The file type the header declares (what llama.cpp's quantizer would write)."""
        if self.expert_dtype:
            return _EXPERT_FILE_TYPES[self.expert_dtype]
        return _FILE_TYPES[self.dtype]

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

    @property
    def is_gpt_oss(self) -> bool:
        return self.arch == "gpt-oss"

    @property
    def ffn_norm_name(self) -> str:
        """The norm before the FFN: gpt-oss calls it the post-attention norm."""
        return "post_attention_norm" if self.is_gpt_oss else "ffn_norm"

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
