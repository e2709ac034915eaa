"""The model maker: deterministic GGUF files, their vocabulary, templates, and llama.cpp loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest

from bmoe import modelmaker as mm
from bmoe.modelmaker import weights, writer
from bmoe.modelmaker.bpe import byte_to_unicode
from bmoe.modelmaker.templates import TEMPLATES, chat_template, render_chat

T = gguf.GGMLQuantizationType
# deepseek2 as V3 has it: Q through a LoRA bottleneck, sigmoid gating (with its bias),
# normalised and scaled expert weights, two shared experts, in Q8_0 the maker builds.
DEEPSEEK_V3 = dict(arch="deepseek2", n_layer=3, q_lora_rank=64, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_dense_lead=1,
                   n_expert_shared=2, expert_gating="sigmoid", expert_weights_norm=True,
                   expert_weights_scale=2.5, dtype="q8_0", router_skew=1.0)


# gpt-oss as the released files have it: MXFP4 experts, the rest 8-bit, with the context
# kernel (no Q/K norm: its scale is in the weights) and a short sliding window.
GPT_OSS = dict(arch="gpt-oss", n_embd=128, n_head=2, n_head_kv=1, head_dim=64,
               expert_dtype="mxfp4", dtype="q8_0", router_skew=1.5, context_mix=1.5,
               sliding_window=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mm")
    return {
        "moe": mm.make_model(d / "moe.gguf"),
        "dense": mm.make_model(d / "dense.gguf", arch="qwen3"),
        "moe-f16": mm.make_model(d / "moe-f16.gguf", dtype="f16"),
        "moe-q8": mm.make_model(d / "moe-q8.gguf", dtype="q8_0", template="qwen3_coder"),
        "dense-q8": mm.make_model(d / "dense-q8.gguf", arch="qwen3", dtype="q8_0"),
        "ctx": mm.make_model(
            d / "ctx.gguf", n_embd=128, n_head=2, n_head_kv=1, head_dim=64,
            router_skew=1.5, context_mix=1.5, dtype="f16", think_prefill=True,
        ),
        "deepseek2": mm.make_model(d / "ds2.gguf", arch="deepseek2"),
        "deepseek2-v3": mm.make_model(d / "ds2-v3.gguf", **DEEPSEEK_V3),
        "gpt-oss": mm.make_model(d / "oss.gguf", **GPT_OSS),
    }


def fields(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: t for t in r.tensors}


# --- files ----------------------------------------------------------------------------


def test_same_arguments_give_the_same_bytes(tmp_path: Path) -> None:
    a = mm.make_model(tmp_path / "a.gguf", dtype="q8_0", router_skew=2.0)
    b = mm.make_model(tmp_path / "b.gguf", dtype="q8_0", router_skew=2.0)
    c = mm.make_model(tmp_path / "c.gguf", dtype="q8_0", router_skew=2.0, seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]


def test_moe_keys_and_tensor_shapes(models: dict[str, Path]) -> None:
    kv, tensors = fields(models["moe"])
    vocab = mm.build_vocab()
    assert kv["general.architecture"] == "qwen3moe"
    assert kv["general.file_type"] == 0
    expected = {
        "context_length": 32768, "embedding_length": 64, "block_count": 4,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
        "attention.value_length": 16, "rope.freq_base": 1e6, "expert_count": 8,
        "expert_used_count": 2, "expert_feed_forward_length": 32,
    }
    for key, value in expected.items():
        assert kv[f"qwen3moe.{key}"] == pytest.approx(value), key
    assert kv["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen2"
    assert kv["tokenizer.ggml.eos_token_id"] == vocab.ids["<|im_end|>"]
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"] == TEMPLATES["hermes"]
    assert json.loads(kv["bmoe.model_maker.spec"])["n_expert"] == 8
    n_vocab = vocab.size
    # GGUF dims are ne order (numpy shape reversed), as llama.cpp's create_tensor lists them.
    want = {"token_embd.weight": (64, n_vocab), "output.weight": (64, n_vocab),
            "output_norm.weight": (64,)}
    for i in range(4):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": (64,), b + "attn_q.weight": (64, 64),
            b + "attn_k.weight": (64, 32), b + "attn_v.weight": (64, 32),
            b + "attn_output.weight": (64, 64), b + "attn_q_norm.weight": (16,),
            b + "attn_k_norm.weight": (16,), b + "ffn_norm.weight": (64,),
            b + "ffn_gate_inp.weight": (64, 8), b + "ffn_gate_exps.weight": (64, 32, 8),
            b + "ffn_up_exps.weight": (64, 32, 8), b + "ffn_down_exps.weight": (32, 64, 8),
        }
    assert {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()} == want


def test_dense_keys_and_ffn(models: dict[str, Path]) -> None:
    kv, tensors = fields(models["dense"])
    assert kv["general.architecture"] == "qwen3"
    assert kv["qwen3.feed_forward_length"] == 128
    assert not any(k.startswith("qwen3.expert") for k in kv)
    assert tuple(int(x) for x in tensors["blk.0.ffn_gate.weight"].shape) == (64, 128)
    assert tuple(int(x) for x in tensors["blk.0.ffn_down.weight"].shape) == (128, 64)
    assert not any("exps" in n or "gate_inp" in n for n in tensors)


def test_deepseek2_keys_and_tensor_shapes(models: dict[str, Path]) -> None:
    """The keys and shapes llama.cpp's deepseek2 loader reads (src/models/deepseek2.cpp),
    as its converter writes them: MLA as one KV head of kv_lora_rank + rope dims."""
    kv, tensors = fields(models["deepseek2"])
    n_vocab = mm.build_vocab().size
    assert kv["general.architecture"] == "deepseek2"
    expected = {
        "embedding_length": 64, "block_count": 4, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 1,
        "attention.key_length": 32 + 16, "attention.value_length": 32,
        "attention.key_length_mla": 32 + 16, "attention.value_length_mla": 32,
        "attention.q_lora_rank": 0, "attention.kv_lora_rank": 32,
        "rope.dimension_count": 16, "leading_dense_block_count": 1, "expert_count": 8,
        "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_shared_count": 1,
        "expert_weights_scale": 1.0, "expert_weights_norm": False, "expert_gating_func": 1,
    }
    for key, value in expected.items():
        assert kv[f"deepseek2.{key}"] == pytest.approx(value), key
    spec = json.loads(kv["bmoe.model_maker.spec"])
    assert spec["kv_lora_rank"] == 32 and spec["n_dense_lead"] == 1
    want = {"token_embd.weight": (64, n_vocab), "output.weight": (64, n_vocab),
            "output_norm.weight": (64,)}
    for i in range(4):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": (64,), b + "attn_q.weight": (64, 4 * 48),
            b + "attn_kv_a_mqa.weight": (64, 32 + 16), b + "attn_kv_a_norm.weight": (32,),
            b + "attn_k_b.weight": (32, 32, 4), b + "attn_v_b.weight": (32, 32, 4),
            b + "attn_output.weight": (4 * 32, 64), b + "ffn_norm.weight": (64,),
        }
        if i == 0:          # the leading dense layer
            want |= {b + "ffn_gate.weight": (64, 128), b + "ffn_up.weight": (64, 128),
                     b + "ffn_down.weight": (128, 64)}
            continue
        want |= {
            b + "ffn_gate_inp.weight": (64, 8), b + "ffn_gate_exps.weight": (64, 32, 8),
            b + "ffn_up_exps.weight": (64, 32, 8), b + "ffn_down_exps.weight": (32, 64, 8),
            b + "ffn_gate_shexp.weight": (64, 32), b + "ffn_up_shexp.weight": (64, 32),
            b + "ffn_down_shexp.weight": (32, 64),
        }
    assert {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()} == want


def test_deepseek2_v3_options(models: dict[str, Path]) -> None:
    kv, tensors = fields(models["deepseek2-v3"])
    assert kv["deepseek2.attention.q_lora_rank"] == 64
    assert kv["deepseek2.expert_gating_func"] == 2                    # sigmoid
    assert kv["deepseek2.expert_weights_norm"] is True
    assert kv["deepseek2.expert_weights_scale"] == pytest.approx(2.5)
    assert kv["deepseek2.expert_shared_count"] == 2
    assert "blk.1.attn_q.weight" not in tensors
    assert tuple(int(x) for x in tensors["blk.1.attn_q_a.weight"].shape) == (64, 64)
    assert tuple(int(x) for x in tensors["blk.1.attn_q_b.weight"].shape) == (64, 4 * 64)
    assert tuple(int(x) for x in tensors["blk.1.ffn_up_shexp.weight"].shape) == (64, 2 * 32)
    bias = tensors["blk.2.exp_probs_b.bias"]
    assert bias.tensor_type == T.F32 and not np.asarray(bias.data).any()
    assert "blk.0.exp_probs_b.bias" not in tensors                   # the dense layer
    assert tensors["blk.1.attn_k_b.weight"].tensor_type == T.Q8_0
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == T.F32


def test_gpt_oss_keys_and_tensor_shapes(models: dict[str, Path]) -> None:
    """The keys and tensors llama.cpp's gpt-oss loader reads (src/models/openai-moe.cpp):
    attention biases and sinks, no Q/K norms, `post_attention_norm`, the router's and
    the experts' biases (random: they change the routing and the output)."""
    kv, tensors = fields(models["gpt-oss"])
    n_vocab = mm.build_vocab().size
    assert kv["general.architecture"] == "gpt-oss"
    expected = {
        "embedding_length": 128, "block_count": 4, "attention.head_count": 2,
        "attention.head_count_kv": 1, "attention.key_length": 64,
        "attention.value_length": 64, "attention.sliding_window": 64, "expert_count": 8,
        "expert_used_count": 2, "expert_feed_forward_length": 32,
    }
    for key, value in expected.items():
        assert kv[f"gpt-oss.{key}"] == pytest.approx(value), key
    assert "gpt-oss.feed_forward_length" not in kv
    spec = json.loads(kv["bmoe.model_maker.spec"])
    assert spec["sliding_window"] == 64 and spec["expert_bias"] == pytest.approx(0.1)
    want = {"token_embd.weight": (128, n_vocab), "output.weight": (128, n_vocab),
            "output_norm.weight": (128,)}
    for i in range(4):
        b = f"blk.{i}."
        want |= {
            b + "attn_norm.weight": (128,), b + "attn_q.weight": (128, 128),
            b + "attn_k.weight": (128, 64), b + "attn_v.weight": (128, 64),
            b + "attn_output.weight": (128, 128), b + "attn_q.bias": (128,),
            b + "attn_k.bias": (64,), b + "attn_v.bias": (64,),
            b + "attn_output.bias": (128,), b + "attn_sinks.weight": (2,),
            b + "post_attention_norm.weight": (128,),
            b + "ffn_gate_inp.weight": (128, 8), b + "ffn_gate_inp.bias": (8,),
            b + "ffn_gate_exps.weight": (128, 32, 8), b + "ffn_up_exps.weight": (128, 32, 8),
            b + "ffn_down_exps.weight": (32, 128, 8), b + "ffn_gate_exps.bias": (32, 8),
            b + "ffn_up_exps.bias": (32, 8), b + "ffn_down_exps.bias": (128, 8),
        }
    assert {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()} == want
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == T.MXFP4
    assert tensors["blk.1.attn_q.weight"].tensor_type == T.Q8_0
    for name in ("ffn_gate_inp.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"):
        bias = np.asarray(tensors[f"blk.1.{name}"].data)
        assert tensors[f"blk.1.{name}"].tensor_type == T.F32 and bias.std() > 0.001, name
    assert not np.asarray(tensors["blk.2.attn_q.bias"].data).any()
    # the context kernel's layer has sinks that take nothing; the others' take a share
    assert np.asarray(tensors["blk.0.attn_sinks.weight"].data).max() <= -30
    assert not np.asarray(tensors["blk.1.attn_sinks.weight"].data).any()


def test_other_archs_keep_their_spec_record() -> None:
    """deepseek2's fields stay out of other archs' spec record, so a qwen3moe file has the
    bytes it had before deepseek2 was added."""
    record = writer._spec_record(mm.ModelSpec())
    assert not set(mm.MLA_FIELDS) & set(record)
    assert set(mm.MLA_FIELDS) <= set(writer._spec_record(mm.ModelSpec(arch="deepseek2")))
    assert "expert_dtype" not in record
    assert not {"sliding_window", "expert_bias"} & set(record)
    assert {"sliding_window", "expert_bias"} <= set(
        writer._spec_record(mm.ModelSpec(arch="gpt-oss")))
    assert writer._spec_record(mm.ModelSpec(expert_dtype="mxfp4"))["expert_dtype"] == "mxfp4"


def test_mxfp4_experts_are_what_llama_cpp_quantizer_writes(tmp_path: Path) -> None:
    """Experts written in MXFP4 as they go are byte for byte what llama.cpp's quantizer
    makes of the same model in F32 (MXFP4_MOE), and the file says so: the same file type,
    and every other matrix in Q8_0 as the quantizer leaves it."""
    from bmoe.modelmaker.quantize import quantize

    shape = dict(n_layer=2, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=96, seed=5)
    direct = mm.make_model(tmp_path / "direct.gguf", dtype="q8_0", expert_dtype="mxfp4", **shape)
    source = mm.make_model(tmp_path / "f32.gguf", dtype="f32", **shape)
    quantized = quantize(source, tmp_path / "quantized.gguf", "MXFP4_MOE")
    kv, ours = fields(direct)
    kv_q, theirs = fields(quantized)
    assert kv["general.file_type"] == kv_q["general.file_type"] == 38   # MOSTLY_MXFP4_MOE
    experts = [n for n in ours if "_exps." in n]
    assert len(experts) == 6
    for name, t in ours.items():
        assert t.tensor_type == theirs[name].tensor_type, name
        if name in experts:
            assert t.tensor_type == T.MXFP4
            assert np.array_equal(np.asarray(t.data), np.asarray(theirs[name].data)), name
    assert ours["blk.1.attn_q.weight"].tensor_type == T.Q8_0


def test_row_quantizer_refuses_what_ggml_cannot_take() -> None:
    from bmoe.modelmaker.quantize import QuantizeError, quantize_rows

    rows = np.zeros((4, 48), dtype=np.float32)
    with pytest.raises(QuantizeError, match="multiple of 32"):
        quantize_rows(rows, T.MXFP4)
    with pytest.raises(QuantizeError, match="does not write IQ2_XXS"):
        quantize_rows(np.zeros((4, 256), dtype=np.float32), T.IQ2_XXS)   # needs an imatrix
    with pytest.raises(QuantizeError, match="2-D"):
        quantize_rows(np.zeros(64, dtype=np.float32), T.MXFP4)
    out = quantize_rows(np.ones((3, 64), dtype=np.float32), T.MXFP4)
    assert out.shape == (3, 2 * 17)
    assert np.allclose(gguf.quants.dequantize(out, T.MXFP4), 1.0)


@pytest.mark.parametrize(("key", "dtype", "ftype"), [("moe-f16", T.F16, 1), ("moe-q8", T.Q8_0, 7)])
def test_f16_and_q8_0(models: dict[str, Path], key: str, dtype: T, ftype: int) -> None:
    kv, tensors = fields(models[key])
    assert kv["general.file_type"] == ftype
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == dtype
    assert tensors["token_embd.weight"].tensor_type == dtype
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == T.F32  # routers stay F32
    assert tensors["blk.1.ffn_norm.weight"].tensor_type == T.F32
    t = tensors["blk.1.ffn_up_exps.weight"]
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    assert values.shape == (8, 32, 64)
    assert float(values.std()) == pytest.approx(64**-0.5, rel=0.05)


def test_big_tensors_are_written_in_bounded_chunks() -> None:
    spec = mm.ModelSpec(n_layer=1, n_embd=2048, n_head=16, n_head_kv=4, head_dim=128,
                        n_expert=128, n_ff_exp=768, dtype="f16")
    vocab = mm.build_vocab()
    experts = next(t for t in weights._plan(spec, vocab.size) if t.name.endswith("ffn_up_exps.weight"))
    chunks = weights._chunks(spec, vocab, experts)
    first = next(chunks)
    assert first.nbytes <= 2 * mm.CHUNK_ELEMENTS * 2
    assert first.nbytes < experts.nbytes // 32
    assert mm.model_size(**vars(spec) | {"n_layer": 24}) > 10 * 2**30


def test_spec_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mm.make_model(tmp_path / "x.gguf", dtype="q8_0", n_embd=48)
    with pytest.raises(ValueError, match="head_dim >= 64"):
        mm.make_model(tmp_path / "x.gguf", context_mix=1.0)
    with pytest.raises(ValueError, match="n_expert_used"):
        mm.ModelSpec(n_expert=4, n_expert_used=5)
    ds2 = "deepseek2"
    with pytest.raises(ValueError, match="at least one layer with experts"):
        mm.ModelSpec(arch=ds2, n_layer=2, n_dense_lead=2)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        mm.ModelSpec(arch=ds2, qk_rope_head_dim=15)
    with pytest.raises(ValueError, match="expert_gating 'relu'"):
        mm.ModelSpec(arch=ds2, expert_gating="relu")
    with pytest.raises(ValueError, match="n_expert_shared must be >= 1"):
        mm.ModelSpec(arch=ds2, n_expert_shared=0)
    with pytest.raises(ValueError, match="context_mix is written for qwen3"):
        mm.ModelSpec(arch=ds2, n_embd=128, head_dim=64, context_mix=1.0)
    with pytest.raises(ValueError, match=r"q8_0 needs kv_lora_rank \(40\)"):
        mm.ModelSpec(arch=ds2, dtype="q8_0", kv_lora_rank=40)
    with pytest.raises(ValueError, match="expert_dtype 'q2_k'"):
        mm.ModelSpec(expert_dtype="q2_k")
    with pytest.raises(ValueError, match=r"mxfp4 experts need n_ff_exp \(48\)"):
        mm.ModelSpec(expert_dtype="mxfp4", n_ff_exp=48)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        mm.ModelSpec(arch="gpt-oss", sliding_window=0)
    with pytest.raises(ValueError, match="expert_bias must be >= 0"):
        mm.ModelSpec(arch="gpt-oss", expert_bias=-1.0)
    with pytest.raises(ValueError, match="needs an architecture with experts"):
        mm.ModelSpec(arch="qwen3", expert_dtype="mxfp4")
    assert not list(tmp_path.iterdir())


def test_router_profile_heats_a_quarter_of_experts() -> None:
    spec = mm.ModelSpec(n_expert=64, n_expert_used=4, router_skew=2.0)
    boost = mm.router_profile(spec, 3)
    assert np.count_nonzero(boost) == 16 and boost.max() == pytest.approx(2.0)
    assert not np.array_equal(np.flatnonzero(boost), np.flatnonzero(mm.router_profile(spec, 4)))
    assert not mm.router_profile(mm.ModelSpec(), 0).any()


def test_cli_and_demo_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert mm.main_make_model(["--out", str(out), "--layers", "2", "--experts", "4",
                               "--top-k", "1", "--dtype", "f16", "--router-skew", "1"]) == 0
    kv, _ = fields(out)
    assert kv["qwen3moe.block_count"] == 2 and kv["qwen3moe.expert_used_count"] == 1
    assert str(out) in capsys.readouterr().out
    assert mm.main_make_model(["--out", str(out), "--dtype", "q8_0", "--embd", "40"]) == 2
    assert mm.main_make_model(["--out", str(out), "--arch", "deepseek2", "--q-lora-rank", "32",
                               "--shared-experts", "2", "--gating", "sigmoid"]) == 0
    kv, tensors = fields(out)
    assert kv["deepseek2.attention.q_lora_rank"] == 32 and "blk.1.exp_probs_b.bias" in tensors
    assert kv["deepseek2.expert_shared_count"] == 2
    assert mm.main_make_model(["--out", str(out), "--arch", "gpt-oss", "--sliding-window", "32",
                               "--expert-bias", "0"]) == 0
    kv, tensors = fields(out)
    assert kv["gpt-oss.attention.sliding_window"] == 32
    assert not np.asarray(tensors["blk.1.ffn_up_exps.bias"].data).any()

    path = mm.ensure_demo_model(tmp_path / "data")
    assert path == mm.demo_model_path(tmp_path / "data")
    assert path == tmp_path / "data" / "models" / "bmoe-demo-moe.gguf"
    stamp = path.stat().st_mtime_ns
    assert mm.ensure_demo_model(tmp_path / "data").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# --- vocabulary -----------------------------------------------------------------------


def test_vocabulary() -> None:
    v = mm.build_vocab()
    b2u = byte_to_unicode()
    assert v.tokens[:256] == tuple(b2u[b] for b in range(256))
    assert len(set(v.tokens)) == v.size and v.size % 64 == 0
    assert len(v.merges) >= 200
    index = set(v.tokens)
    for merge in v.merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= index, merge
    types = {t: v.types[i] for t, i in v.ids.items()}
    assert types["<|im_end|>"] == gguf.TokenType.CONTROL
    assert types["<think>"] == gguf.TokenType.USER_DEFINED
    assert mm.build_vocab(control_tags=True).types[v.ids["<think>"]] == gguf.TokenType.CONTROL
    assert v.types[-1] == gguf.TokenType.UNUSED
    assert mm.special_token_ids() == v.ids


# --- templates ------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
     "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c1", "content": "warm"},
]


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_generation_prompt_endings(key: str) -> None:
    text = TEMPLATES[key]
    msgs = [{"role": "user", "content": "hi"}]
    on = render_chat(text, msgs, enable_thinking=True)
    off = render_chat(text, msgs, enable_thinking=False)
    prefill = key.endswith("think-prefill")
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + (
        "<think>\n" if prefill else "")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    bare = render_chat(text, msgs, add_generation_prompt=False)
    assert bare == "<|im_start|>user\nhi<|im_end|>\n"


def test_hermes_renders_every_message_kind() -> None:
    text = render_chat(TEMPLATES["hermes"], CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"
            "Use the tool.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                         "<tool_response>\nwarm\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    string_args = dict(CALL, function={"name": "f", "arguments": '{"a": 1}'})
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "ok", "tool_calls": [string_args]}]
    assert ('ok\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
            in render_chat(TEMPLATES["hermes"], msgs))


def test_qwen3_coder_renders_every_message_kind() -> None:
    text = render_chat(TEMPLATES["qwen3_coder"], CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access")
    assert ("<function>\n<name>get_weather</name>\n<description>Get the weather</description>\n"
            "<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>\n"
            "<description>City</description>\n</parameter>") in text
    assert '<required>["city"]</required>' in text
    assert ("<think>\nUse the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n") in text
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm" in text
    no_system = render_chat(TEMPLATES["qwen3_coder"], CONVERSATION[1:2], TOOLS)
    assert no_system.startswith("<|im_start|>system\nYou are Qwen, a helpful AI assistant")
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    with pytest.raises(ValueError, match="must be an object"):
        render_chat(TEMPLATES["qwen3_coder"], bad)


@pytest.mark.parametrize("framing", ["hermes", "qwen3_coder"])
def test_reasoning_is_kept_only_after_the_last_query(framing: str) -> None:
    msgs = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nfirst"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second", "reasoning_content": "new thought"},
    ]
    text = render_chat(chat_template(framing), msgs, add_generation_prompt=False)
    assert "old thought" not in text
    assert "<|im_start|>assistant\nfirst<|im_end|>" in text
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nsecond<|im_end|>\n")
    with pytest.raises(ValueError, match="unexpected message role"):
        render_chat(chat_template(framing), [{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_templates_render_the_same_in_llama_cpp_python(key: str) -> None:
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    formatter = chat_format.Jinja2ChatFormatter(
        template=TEMPLATES[key], eos_token="<|im_end|>", bos_token="")
    for thinking in (True, False):
        got = formatter(messages=CONVERSATION, tools=TOOLS, enable_thinking=thinking).prompt
        assert got == render_chat(TEMPLATES[key], CONVERSATION, TOOLS, enable_thinking=thinking)


# --- llama.cpp ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp() -> Iterator[Any]:
    """llama-cpp-python's high-level ``Llama``, loading with the kernels the engine chose
    for this host (``bmoe.engine.kernels``): its own default takes every extra buffer
    type, whose AMX kernels crash on some CPUs. ``Llama`` has no parameter for it, so its
    default model parameters are the engine's here."""
    import llama_cpp as lc
    import llama_cpp.llama_cpp as low

    from bmoe.engine import kernels

    choice = kernels.choose("auto")
    default = low.llama_model_default_params

    def chosen() -> Any:
        params = default()
        params.use_extra_bufts = choice.extra_bufts
        return params

    low.llama_model_default_params = chosen
    try:
        yield lc
    finally:
        low.llama_model_default_params = default


@pytest.mark.parametrize("key", ["moe", "dense", "moe-f16", "moe-q8", "dense-q8", "ctx",
                                 "deepseek2", "deepseek2-v3", "gpt-oss"])
def test_llama_cpp_loads_and_generates(
    llama_cpp: Any, models: dict[str, Path], key: str
) -> None:
    llm = llama_cpp.Llama(model_path=str(models[key]), n_ctx=256, n_threads=1, verbose=False)
    try:
        assert llm.n_ctx() == 256 and llm.n_vocab() == mm.build_vocab().size
        assert llm.metadata["tokenizer.chat_template"].startswith("{%- macro content_text")
        prompt = render_chat(llm.metadata["tokenizer.chat_template"],
                             [{"role": "user", "content": "hello world"}])
        runs = [llm.create_completion(prompt, max_tokens=24, temperature=0.0) for _ in range(2)]
    finally:
        llm.close()
    first = runs[0]["choices"][0]
    assert first["finish_reason"] == "length" and runs[0]["usage"]["completion_tokens"] == 24
    assert first["text"] == runs[1]["choices"][0]["text"]
    assert set(first["text"]) <= set(map(chr, range(0x20, 0x7F))) | {"\n", "\t"}


def test_llama_cpp_tokenizer(llama_cpp: Any, models: dict[str, Path]) -> None:
    llm = llama_cpp.Llama(model_path=str(models["moe"]), n_ctx=64, n_threads=1, verbose=False)
    try:
        ids = mm.special_token_ids()
        hello = llm.tokenize(b"hello world", add_bos=False)
        assert len(hello) < len(b"hello world")
        assert llm.detokenize(hello) == b"hello world"
        for text, tid in ids.items():
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == [tid], text
        # Tags are user-defined tokens, as in Qwen3's GGUFs: whole even without parse_special,
        # and rendered by detokenisation; control tokens are neither.
        assert llm.tokenize(b"<think>", add_bos=False, special=False) == [ids["<think>"]]
        assert llm.detokenize([ids["</tool_call>"]]) == b"</tool_call>"
        assert len(llm.tokenize(b"<|im_end|>", add_bos=False, special=False)) > 1
        assert llm.detokenize([ids["<|im_end|>"]]) == b""
        assert llm.token_eos() == ids["<|im_end|>"]
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        assert eog == {ids["<|im_end|>"], ids["<|endoftext|>"]}
        assert llama_cpp.llama_model_n_ctx_train(llm.model) == 32768
    finally:
        llm.close()
