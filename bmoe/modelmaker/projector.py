"""Tiny random-weight vision projectors (mmproj GGUFs) for the tests.

Theory of operation
-------------------
libmtmd (llama.cpp's `tools/mtmd`) loads a projector from a GGUF whose architecture is
`clip`. The simplest current type it supports is Gemma 3's (`clip.projector_type`
`gemma3`): a SigLIP-style ViT (patch embedding as a convolution, learned position
embeddings, pre-norm blocks with separate q/k/v and a two-matrix GELU FFN, a post norm),
then an average pool of `scale_factor` x `scale_factor` patches, an RMS norm and one
projection into the language model's embedding width. Its preprocessor resizes any image
to `image_size` x `image_size`, so every image costs the same number of tokens:
``(image_size / patch_size / scale_factor) ** 2`` (16 with the defaults here).

The keys and tensors are those `clip.cpp`'s loader reads (`load_hparams`,
`load_tensors`): `clip.has_vision_encoder`, `clip.vision.{embedding_length,
feed_forward_length, block_count, projection_dim, attention.head_count,
attention.layer_norm_epsilon, image_size, patch_size, image_mean, image_std,
projector.scale_factor}`, `clip.use_gelu`; `v.patch_embd.*`, `v.position_embd.weight`,
`v.blk.<i>.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,ffn_down}.*`, `v.post_ln.*`,
`mm.soft_emb_norm.weight`, `mm.input_projection.weight`. The projection's output width
must equal the language model's `n_embd`, or `mtmd_init_from_file` refuses the pair.

`make_vision_pair` writes a language model (the model maker's) and its projector side by
side, each with a `general.name`, so the pairing rules can be tested both ways. The same
arguments give the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .writer import make_model, write_atomically


@dataclass(frozen=True)
class ProjectorSpec:
    """Everything that decides the bytes of a projector file."""

    n_embd_text: int = 64  # the language model's embedding width
    n_embd: int = 32  # the vision tower's width
    n_head: int = 2
    n_ff: int = 48  # must differ from n_embd (the loader's up/down swap check)
    n_layer: int = 1
    image_size: int = 112
    patch_size: int = 14
    scale_factor: int = 2
    seed: int = 0
    name: str = ""  # general.name; "" writes no name

    def __post_init__(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError("image_size must be patch_size x scale_factor x a whole number")
        if self.n_embd % self.n_head or self.n_ff == self.n_embd:
            raise ValueError("n_embd must be a multiple of n_head, and n_ff differ from it")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        """What one image costs in the language model's context."""
        return (self.image_size // self.patch_size // self.scale_factor) ** 2


def _tensors(spec: ProjectorSpec) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(spec.seed)
    e, f, p = spec.n_embd, spec.n_ff, spec.patch_size

    def w(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    out: list[tuple[str, np.ndarray]] = [
        ("v.patch_embd.weight", w(e, 3, p, p).astype(np.float16)),
        ("v.patch_embd.bias", zeros(e)),
        ("v.position_embd.weight", w(spec.n_patches, e)),
    ]
    for il in range(spec.n_layer):
        blk = f"v.blk.{il}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out += [(f"{blk}.{part}.weight", w(e, e)), (f"{blk}.{part}.bias", zeros(e))]
        for norm in ("ln1", "ln2"):
            out += [(f"{blk}.{norm}.weight", ones(e)), (f"{blk}.{norm}.bias", zeros(e))]
        out += [
            (f"{blk}.ffn_up.weight", w(f, e)),
            (f"{blk}.ffn_up.bias", zeros(f)),
            (f"{blk}.ffn_down.weight", w(e, f)),
            (f"{blk}.ffn_down.bias", zeros(e)),
        ]
    out += [
        ("v.post_ln.weight", ones(e)),
        ("v.post_ln.bias", zeros(e)),
        ("mm.soft_emb_norm.weight", ones(e)),
        ("mm.input_projection.weight", w(e, spec.n_embd_text, scale=0.5)),
    ]
    return out


def _write(spec: ProjectorSpec, path: Path) -> None:
    w = gguf.GGUFWriter(path=str(path), arch="clip")
    if spec.name:
        w.add_name(spec.name)
    w.add_type("mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    v = "clip.vision"
    w.add_uint32(f"{v}.embedding_length", spec.n_embd)
    w.add_uint32(f"{v}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{v}.block_count", spec.n_layer)
    w.add_uint32(f"{v}.projection_dim", spec.n_embd_text)
    w.add_uint32(f"{v}.attention.head_count", spec.n_head)
    w.add_float32(f"{v}.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32(f"{v}.image_size", spec.image_size)
    w.add_uint32(f"{v}.patch_size", spec.patch_size)
    w.add_array(f"{v}.image_mean", [0.5, 0.5, 0.5])
    w.add_array(f"{v}.image_std", [0.5, 0.5, 0.5])
    w.add_uint32(f"{v}.projector.scale_factor", spec.scale_factor)
    for name, data in _tensors(spec):
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_projector(path: str | os.PathLike[str], **params: object) -> Path:
    """Write a projector file (a temp file, then a rename) and return its path."""
    spec = ProjectorSpec(**params)  # type: ignore[arg-type]
    return write_atomically(path, lambda tmp: _write(spec, tmp))


def make_vision_pair(
    folder: str | os.PathLike[str],
    name: str = "bmoe-vision-test",
    projector_name: str | None = None,
    model_file: str = "",
    projector_file: str = "",
    **model_params: object,
) -> tuple[Path, Path]:
    """A language model and its projector in `folder`.

    `name` goes in the model's `general.name`; the projector gets `projector_name` (the
    same name when None, "" for none), so a test can write a pair that matches, one that
    names another model, or one with no name to check.
    """
    folder = Path(folder)
    pname = name if projector_name is None else projector_name
    n_embd = int(model_params.get("n_embd", 64))  # type: ignore[call-overload]
    model = make_model(folder / (model_file or f"{name or 'unnamed'}.gguf"),
                       name=name, **model_params)
    proj = make_projector(folder / (projector_file or f"mmproj-{pname or 'unnamed'}.gguf"),
                          name=pname, n_embd_text=n_embd)
    return model, proj
