"""Tiny BERT embedding and reranking models, for the embedding routes' tests.

`make_bert` writes a random-weight BERT (llama.cpp's `bert` architecture: token, type
and position embeddings, post-norm encoder layers, no KV cache) with the tokenizer of a
real one: the tokenizer fields are copied from a vocab-only GGUF (llama.cpp ships
`ggml-vocab-bert-bge.gguf`, BGE's WordPiece vocabulary), so token counts are the real
model's. `rerank=True` adds the classifier head (`cls`, `cls.output`, one label) and
declares rank pooling, the shape of a cross-encoder reranker.

The weights mean nothing; the vectors are what llama.cpp computes from them, so two equal
inputs give equal vectors and different inputs differ, which is what a server's tests
need. Written to a temporary file and renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

POOLING = {"none": gguf.PoolingType.NONE, "mean": gguf.PoolingType.MEAN,
           "cls": gguf.PoolingType.CLS, "last": gguf.PoolingType.LAST,
           "rank": gguf.PoolingType.RANK}


def _copy_tokenizer(w: gguf.GGUFWriter, vocab: Path) -> int:
    """Copy every `tokenizer.*` field of `vocab` into `w`; the vocabulary's size."""
    reader = gguf.GGUFReader(str(vocab))
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types = field.types
        value = field.contents()
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, types[0], sub_type=types[-1])
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            w.add_key_value(key, value, types[0])
    if not n_vocab:
        raise ValueError(f"{vocab} has no tokenizer.ggml.tokens: not a vocab GGUF")
    return n_vocab


def make_bert(path: str | os.PathLike[str], vocab: str | os.PathLike[str], *,
              n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_ff: int = 128,
              n_ctx: int = 512, pooling: str = "cls", rerank: bool = False,
              seed: int = 0, name: str = "tiny-bert", f16_vectors: bool = False) -> Path:
    """Write a tiny BERT with `vocab`'s tokenizer to `path` (F16 matrices, F32 norms).

    `f16_vectors` writes the token-type rows and the norms and biases in F16, as a
    broken converter would: llama.cpp aborts on such a file at its first decode (the
    server refuses it at load; tests use it to prove that)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, "bert")
        w.add_name(name)
        w.add_block_count(n_layer)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_layer_norm_eps(1e-12)
        w.add_causal_attention(False)
        w.add_pooling_type(POOLING["rank" if rerank else pooling])
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        n_vocab = _copy_tokenizer(w, Path(vocab))

        def mat(name: str, rows: int, cols: int) -> None:
            data = rng.normal(0.0, 1.0 / np.sqrt(cols), size=(rows, cols))
            w.add_tensor(name, data.astype(np.float16))

        def vec(name: str, n: int, value: float | None = None) -> None:
            data = (np.full(n, value) if value is not None else rng.normal(0.0, 0.02, size=n))
            w.add_tensor(name, data.astype(vector_type))

        vector_type = np.float16 if f16_vectors else np.float32
        mat("token_embd.weight", n_vocab, n_embd)
        # llama.cpp adds the type row to the F32 activations: an F16 one aborts the process
        w.add_tensor("token_types.weight",
                     rng.normal(0.0, 0.02, size=(2, n_embd)).astype(vector_type))
        mat("position_embd.weight", n_ctx, n_embd)
        vec("token_embd_norm.weight", n_embd, 1.0)
        vec("token_embd_norm.bias", n_embd)
        for i in range(n_layer):
            b = f"blk.{i}"
            for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
                mat(f"{b}.{part}.weight", n_embd, n_embd)
                vec(f"{b}.{part}.bias", n_embd)
            vec(f"{b}.attn_output_norm.weight", n_embd, 1.0)
            vec(f"{b}.attn_output_norm.bias", n_embd)
            mat(f"{b}.ffn_up.weight", n_ff, n_embd)
            vec(f"{b}.ffn_up.bias", n_ff)
            mat(f"{b}.ffn_down.weight", n_embd, n_ff)
            vec(f"{b}.ffn_down.bias", n_embd)
            vec(f"{b}.layer_output_norm.weight", n_embd, 1.0)
            vec(f"{b}.layer_output_norm.bias", n_embd)
        if rerank:
            mat("cls.weight", n_embd, n_embd)
            vec("cls.bias", n_embd)
            mat("cls.output.weight", 1, n_embd)
            vec("cls.output.bias", 1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
