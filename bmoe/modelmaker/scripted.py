"""A model whose greedy answer is a given text: weights that script the next token.

Real clients (Claude Code, Codex) send no grammar, so a random-weight model never writes a
family's tool-call markup of its own accord. The model this module writes does: it is a
one-layer Llama whose next token is a lookup of the current one, with one bit of context
read by attention. Each piece of the scripted answers is a token of its own (the family's
special tokens as they are; other pieces added to the vocabulary as user-defined tokens),
so "the token after X" names one token in each answer:

- `first` is the answer while the context does not hold the `marker` token;
- `then` is the answer once it does (say the secret word of the file the first answer
  asked to read: the second answer then proves that the tool's result reached the model).

The residual stream has a constant dimension, one per scripted token, one for the marker
and one for "the marker was seen". Head 0 of the attention has its query on the constant
dimension and its key on the marker's, both on the slowest-turning RoPE pair, so every
position attends to the markers (and to nothing else) whatever their distance; the value
carries the marker's dimension into the "seen" one. The output rows read the current
token's dimension and, where the two answers part, the "seen" one. The feed-forward
weights are zero. Margins between the scripted token and any other are tens of logits,
so sampling at the clients' temperatures picks the scripted token too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .spec import VOCAB_MULTIPLE
from .vocab import build_vocab
from .writer import write_atomically

HEAD_DIM = 32
# logit weights, in units of the normalised residual (see `_output`)
STEP = 60.0      # the current token's successor
BRANCH = 40.0    # where the answers part: for or against "seen"
ROPE_BASE = 1e6  # the last RoPE pair of a 32-wide head turns 2.4e-6 rad per position


@dataclass(frozen=True)
class Script:
    """What the model answers, and how to recognise the moment to change answers."""
    template: str                 # the chat template the file carries (the family's own)
    prompt_end: str               # the generation prompt's last token ("<|assistant|>")
    marker: str                   # a token only the tool's result brings into the context
    first: tuple[str, ...]        # the answer before the marker, piece by piece
    then: tuple[str, ...]         # the answer after it
    specials: tuple[str, ...] = ()  # the family's control tokens
    eos: str = "<|endoftext|>"
    eot: str | None = None
    eom: str | None = None
    name: str = "scripted"


def _vocab(script: Script) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    base = build_vocab()
    n_normal = sum(1 for t in base.types if t == int(gguf.TokenType.NORMAL))
    tokens = list(base.tokens[:n_normal])
    types = list(base.types[:n_normal])
    ids: dict[str, int] = {}

    normal = {t: i for i, t in enumerate(tokens)}

    def add(text: str, kind: gguf.TokenType) -> None:
        if text in ids:
            return
        if text in normal:
            # a merge spelled it already: that token gives its place up (the tokenizer
            # then spells the merge in bytes), since a vocabulary must not hold a text
            # twice (llama.cpp aborts its load)
            at = normal.pop(text)
            tokens[at] = f"[PAD{at}]"
            types[at] = int(gguf.TokenType.UNUSED)
        ids[text] = len(tokens)
        tokens.append(text)
        types.append(int(kind))

    for text in ("<|endoftext|>", *script.specials, script.eos,
                 *(t for t in (script.eot, script.eom) if t)):
        add(text, gguf.TokenType.CONTROL)
    for text in (script.prompt_end, script.marker, *script.first, *script.then):
        add(text, gguf.TokenType.USER_DEFINED)
    while len(tokens) % VOCAB_MULTIPLE:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, types, list(base.merges), ids


def transitions(script: Script) -> dict[tuple[str, bool | None], str]:
    """(current token, seen) -> next token; seen None where both answers agree."""
    by_answer: list[dict[str, str]] = []
    for answer in (script.first, script.then):
        if not answer:
            raise ValueError("a scripted answer needs at least one piece")
        chain = [script.prompt_end, *answer]
        steps: dict[str, str] = {}
        for cur, nxt in zip(chain, chain[1:], strict=False):
            if steps.get(cur, nxt) != nxt:
                raise ValueError(f"{cur!r} is followed by two different pieces in one answer: "
                                 "join it with a neighbour so that each piece is unique")
            steps[cur] = nxt
        by_answer.append(steps)
    before, after = by_answer
    out: dict[tuple[str, bool | None], str] = {}
    for cur in before.keys() | after.keys():
        a, b = before.get(cur), after.get(cur)
        if a is not None and a == b:
            out[(cur, None)] = a
        else:
            if a is not None:
                out[(cur, False)] = a
            if b is not None:
                out[(cur, True)] = b
    return out


def _tensors(script: Script, ids: dict[str, int], n_vocab: int) -> dict[str, np.ndarray]:
    steps = transitions(script)
    states = sorted({cur for cur, _ in steps}, key=lambda t: ids[t])
    CONST, MARK, SEEN = 0, 1, 2
    dim = {t: 3 + i for i, t in enumerate(states)}
    d = max(64, -(-(3 + len(states)) // HEAD_DIM) * HEAD_DIM)
    n_head = d // HEAD_DIM

    embd = np.zeros((n_vocab, d), np.float32)
    embd[:, CONST] = 1.0
    for t, k in dim.items():
        embd[ids[t], k] = 1.0
    embd[ids[script.marker], MARK] = 1.0

    # rmsnorm makes a token with two unit components sqrt(d/2) along each
    unit = (d / 2) ** 0.5
    wq = np.zeros((d, d), np.float32)
    wk = np.zeros((d, d), np.float32)
    wv = np.zeros((d, d), np.float32)
    wo = np.zeros((d, d), np.float32)
    pair = HEAD_DIM - 2            # head 0's slowest RoPE pair (NORM rope: dims 2j, 2j+1)
    score = 50.0                   # the marker's attention score over any other token's 0
    g = (score * HEAD_DIM ** 0.5) ** 0.5 / unit
    wq[pair, CONST] = g
    wk[pair, MARK] = g
    wv[0, MARK] = 1.0 / unit       # head 0's value 0: 1 at a marker, 0 elsewhere
    wo[SEEN, 0] = 1.0

    out = np.zeros((n_vocab, d), np.float32)
    for (cur, seen), nxt in steps.items():
        row = out[ids[nxt]]
        row[dim[cur]] += STEP
        if seen is True:
            row[SEEN] += BRANCH
            row[CONST] -= BRANCH / 2
        elif seen is False:
            row[SEEN] -= BRANCH

    f32 = np.float32
    ff = 64
    return {
        "token_embd.weight": embd,
        "blk.0.attn_norm.weight": np.ones(d, f32),
        "blk.0.attn_q.weight": wq,
        "blk.0.attn_k.weight": wk,
        "blk.0.attn_v.weight": wv,
        "blk.0.attn_output.weight": wo,
        "blk.0.ffn_norm.weight": np.ones(d, f32),
        "blk.0.ffn_gate.weight": np.zeros((ff, d), f32),
        "blk.0.ffn_up.weight": np.zeros((ff, d), f32),
        "blk.0.ffn_down.weight": np.zeros((d, ff), f32),
        "output_norm.weight": np.ones(d, f32),
        "output.weight": out,
        "_n_head": np.array(n_head),
    }


def make_scripted(path: str | os.PathLike[str], script: Script, *,
                  n_ctx_train: int = 131072) -> Path:
    """Write the scripted model (atomically) and return its path."""
    tokens, types, merges, ids = _vocab(script)
    tensors = _tensors(script, ids, len(tokens))
    n_head = int(tensors.pop("_n_head"))
    d = tensors["token_embd.weight"].shape[1]

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), arch="llama")
        w.add_name(script.name)
        w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(d)
        w.add_block_count(1)
        w.add_feed_forward_length(tensors["blk.0.ffn_up.weight"].shape[0])
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head)
        w.add_rope_dimension_count(HEAD_DIM)
        w.add_rope_freq_base(ROPE_BASE)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids[script.eos])
        if script.eot:
            w.add_eot_token_id(ids[script.eot])
        if script.eom:
            w.add_eom_token_id(ids[script.eom])
        w.add_add_bos_token(False)
        w.add_chat_template(script.template)
        for tname, arr in tensors.items():
            w.add_tensor(tname, np.ascontiguousarray(arr))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return write_atomically(path, write)
