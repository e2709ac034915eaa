"""Vocabularies llama.cpp's loader aborts on.

llama.cpp builds a map from each token's text to its id and then asserts that the map
has as many entries as the list has tokens (``GGML_ASSERT(id_to_token.size() ==
token_to_id.size())`` in ``llama-vocab.cpp``): a file whose vocabulary spells one token
twice does not fail its load with an error but ends the whole process. A converter that
appends added tokens without looking makes such files. This module reads the token list
from the file's header (no tensor data) and names the first text that is there twice,
so the load is refused with a reason instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..models.probe import Unreadable, read_file_header

TOKENS_KEY = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class Duplicate:
    text: bytes
    first: int
    again: int

    def shown(self) -> str:
        text = self.text.decode("utf-8", errors="replace")
        return repr(text if len(text) <= 40 else text[:40] + "...")


def first_duplicate(path: str | os.PathLike[str]) -> Duplicate | None:
    """The first token text the file's vocabulary holds twice; None when there is none
    (or the header cannot be read: llama.cpp's own loader then says what is wrong)."""
    try:
        header = read_file_header(path, whole=frozenset({TOKENS_KEY}))
    except (Unreadable, ValueError, OSError):
        return None
    tokens = header.kv.get(TOKENS_KEY)
    if not isinstance(tokens, list):
        return None
    seen: dict[bytes, int] = {}
    for i, text in enumerate(tokens):
        at = seen.setdefault(text, i)
        if at != i:
            return Duplicate(text, at, i)
    return None
