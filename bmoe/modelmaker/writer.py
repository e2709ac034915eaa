"""Writing a made model: the GGUF metadata and tensors, atomically (a temporary file
in the same folder, then a rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np

from bmoe.modelmaker.templates import chat_template

from .spec import GPT_OSS_FIELDS, MLA_FIELDS, ModelSpec
from .vocab import Vocab, build_vocab
from .weights import _chunks, _plan

# ---------------------------------------------------------------------------------------
# Writing


def _add_metadata(w: gguf.GGUFWriter, spec: ModelSpec, vocab: Vocab) -> None:
    w.add_name(spec.model_name)
    w.add_file_type(int(spec.file_type))
    if spec.dtype == "q8_0" or spec.expert_dtype:
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
    if spec.is_gpt_oss:
        w.add_sliding_window(spec.sliding_window)
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
    if not spec.is_gpt_oss:
        for label in GPT_OSS_FIELDS:
            del record[label]
    if not spec.expert_dtype:      # files without it keep the bytes they had before it
        del record["expert_dtype"]
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
