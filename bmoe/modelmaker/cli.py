"""The demo model and `bmoe-cli make-model`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bmoe.modelmaker.templates import FRAMINGS

from .spec import ARCHS, DEMO_FILE, DTYPES, EXPERT_DTYPES, GATING
from .writer import make_model

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
                    "(qwen3moe, qwen3, deepseek2 or gpt-oss).",
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
    p.add_argument("--expert-dtype", choices=EXPERT_DTYPES[1:], default="",
                   help="the routed experts' type, quantized by llama.cpp as they are "
                        "written (default: --dtype); mxfp4 makes an MXFP4_MOE file")
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
    oss = p.add_argument_group("gpt-oss")
    oss.add_argument("--sliding-window", type=int, default=128,
                     help="tokens a sliding-window layer sees (every other layer, from 0)")
    oss.add_argument("--expert-bias", type=float, default=0.1,
                     help="std of the router's and the experts' biases (0: zeros)")
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
    if args.expert_dtype:
        params["expert_dtype"] = args.expert_dtype
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
    if args.arch == "gpt-oss":
        params |= dict(sliding_window=args.sliding_window, expert_bias=args.expert_bias)
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
