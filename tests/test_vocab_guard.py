"""The vocabulary check before llama.cpp loads a file (`bmoe.engine.vocab_guard`): a text
spelled twice is named; a hostile or cut header is left to llama.cpp's own loader."""

from __future__ import annotations

from pathlib import Path

import gguf
from hypothesis import given, settings
from hypothesis import strategies as st

from bmoe.engine.vocab_guard import first_duplicate


def write_vocab(path: Path, tokens: list[str]) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_text_twice_is_named_with_both_ids(tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "v.gguf", ["a", "b", "<|end|>", "c", "<|end|>"])
    twice = first_duplicate(path)
    assert twice is not None and (twice.first, twice.again) == (2, 4)
    assert twice.shown() == "'<|end|>'"


def test_a_clean_vocabulary_passes(tmp_path: Path) -> None:
    assert first_duplicate(write_vocab(tmp_path / "v.gguf", ["a", "b", "ab", " a"])) is None


def test_the_real_model_passes() -> None:
    from _real_models import gemma_path
    assert first_duplicate(gemma_path()) is None          # 262,144 tokens, all distinct


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=4), max_size=40), st.integers(min_value=0, max_value=4096))
def test_cut_files_never_raise(tmp_path_factory: object, tokens: list[str], cut: int) -> None:
    folder = tmp_path_factory.mktemp("cut")  # type: ignore[attr-defined]
    path = write_vocab(folder / "v.gguf", tokens)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    twice = first_duplicate(path)
    if twice is not None:                        # only ever a real duplicate of the list
        assert tokens.index(tokens[twice.again]) == twice.first
