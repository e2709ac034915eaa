"""Deterministic GGUF test models: tiny ones for the tests, multi-GB ones for benchmarks.

Theory of operation
-------------------
`make_model` writes a qwen3moe (or dense qwen3, deepseek2 or gpt-oss) file with the
`gguf` package. The same arguments give the same bytes: every tensor chunk draws from its own SFC64
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

*gpt-oss* is gpt-oss-20b/120b's layout as llama.cpp loads it: attention with Q/K/V and
output biases (zeros here) and a learnt sink logit per head (0, or -30 in the context
kernel's layer so the kernel keeps its weights), no Q/K norms, sliding-window layers
(`sliding_window` tokens; every other layer from layer 0) between full ones, the FFN's
norm named `post_attention_norm`, a router with a bias, and experts with biases on their
gate, up and down outputs (`expert_bias` their std), which llama.cpp adds by the same
expert ids the matmuls read (`add_id`), then its clamped SwiGLU and the softmax over the
chosen experts' logits. With `expert_dtype="mxfp4"` the experts are MXFP4 as in the
released files. Its residual stream is built like qwen3moe's, and `context_mix` works:
with no Q/K norm, the kernel's scale is in the Q and K weights.

*Streaming.* All tensor infos are declared first, then header, metadata and tensor table
are written, then each tensor is generated and written chunk by chunk (one expert, or a few
MiB of rows, at a time), so a file of any size is written in bounded memory. Bulk weights
are drawn as 16-bit indices into a table of 65536 normal quantiles (fast, exactly
Gaussian-shaped); Q8_0 blocks are built directly (a per-tensor scale and int8 values).
With `expert_dtype` (MXFP4) the routed experts' F32 values are quantized as they are
written by llama.cpp's own row quantizer (`quantize.quantize_rows`): the bytes llama.cpp's
file quantizer writes for MXFP4_MOE, with no full-precision source file first.

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

from .cli import demo_model_path, ensure_demo_model, main_make_model
from .spec import (
    ARCHS,
    CHUNK_ELEMENTS,
    CONTEXT_BAND,
    CONTEXT_MIN_LOCAL,
    CONTEXT_SHARPNESS,
    DEMO_FILE,
    DTYPES,
    EXPERT_DTYPES,
    GATING,
    MLA_FIELDS,
    MOE_ARCHS,
    N_MERGES,
    SHARED_FRACTION,
    SPECIAL_TOKENS,
    SUPPRESS_LOGIT,
    TAG_TOKENS,
    VOCAB_MULTIPLE,
    ContextKernel,
    ModelSpec,
    context_kernel,
)
from .vocab import Vocab, build_vocab, special_token_ids
from .weights import router_profile
from .writer import make_model, model_size, write_atomically

__all__ = [
    "ARCHS",
    "CHUNK_ELEMENTS",
    "CONTEXT_BAND",
    "CONTEXT_MIN_LOCAL",
    "CONTEXT_SHARPNESS",
    "ContextKernel",
    "DEMO_FILE",
    "DTYPES",
    "EXPERT_DTYPES",
    "GATING",
    "MLA_FIELDS",
    "MOE_ARCHS",
    "ModelSpec",
    "N_MERGES",
    "SHARED_FRACTION",
    "SPECIAL_TOKENS",
    "SUPPRESS_LOGIT",
    "TAG_TOKENS",
    "VOCAB_MULTIPLE",
    "Vocab",
    "build_vocab",
    "context_kernel",
    "demo_model_path",
    "ensure_demo_model",
    "main_make_model",
    "make_model",
    "model_size",
    "router_profile",
    "special_token_ids",
    "write_atomically",
]
