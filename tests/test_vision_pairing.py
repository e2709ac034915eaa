"""A model's projector, paired by the two headers; the listing's `projector`; the loader.

The model maker writes the pairs (a tiny language model and a tiny gemma3-type
projector), named so every rule is tested both ways.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bmoe.models.listing import ProbeCache, scan
from bmoe.models.pairing import Names, normal, pair, projector_for
from bmoe.models.probe import probe_file
from bmoe.modelmaker import make_model
from bmoe.modelmaker.projector import make_projector, make_vision_pair


def names(*n: str) -> Names:
    return Names(frozenset(normal(x) for x in n if normal(x)))


def test_names_compare_by_letters_and_digits() -> None:
    assert normal("Qwen3-VL 30B_A3B.Instruct") == "qwen3vl30ba3binstruct"
    assert names("Qwen3-VL-30B").matches(names("qwen3 vl 30b"))


def test_pair_rules() -> None:
    model = names("Gemma-4-26B")
    # a match wins, first by file name among several
    assert pair(model, [("b.gguf", names("gemma 4 26b")), ("a.gguf", names("Gemma4-26B"))]) \
        == "a.gguf"
    # one that names another model never, however alone
    assert pair(model, [("other.gguf", names("Llama-4-Scout"))]) == ""
    # the folder's only projector when one of the two has no name
    assert pair(model, [("anon.gguf", names())]) == "anon.gguf"
    assert pair(names(), [("named.gguf", names("Llama-4-Scout"))]) == "named.gguf"
    # ... and not when there are two
    assert pair(model, [("a.gguf", names()), ("b.gguf", names())]) == ""
    # a base-model name counts as the header's name
    assert pair(names("My-Finetune", "Gemma-4-26B"), [("p.gguf", names("gemma-4-26b"))]) \
        == "p.gguf"


def test_the_projector_of_a_folder_is_found_by_headers_not_file_names(tmp_path: Path) -> None:
    model, proj = make_vision_pair(tmp_path / "match", name="bmoe-vision-test",
                                   model_file="m.gguf", projector_file="zz-unrelated-name.gguf")
    assert probe_file(proj).role == "projector"
    assert projector_for(model) == proj

    model, _ = make_vision_pair(tmp_path / "mismatch", name="bmoe-vision-test",
                                projector_name="some-other-model",
                                projector_file="mmproj-bmoe-vision-test.gguf")
    assert projector_for(model) is None        # the file NAME says it is ours; the header not

    model, proj = make_vision_pair(tmp_path / "anon", name="bmoe-vision-test",
                                   projector_name="")
    assert projector_for(model) == proj        # the only projector, and it names nothing
    make_projector(tmp_path / "anon" / "second.gguf")
    assert projector_for(model) is None        # two nameless ones: nothing to decide by


def test_the_listing_shows_each_models_projector(tmp_path: Path) -> None:
    make_vision_pair(tmp_path, name="bmoe-vision-test", model_file="a.gguf",
                     projector_file="mmproj-a.gguf")
    make_model(tmp_path / "b.gguf", name="another-model")
    make_projector(tmp_path / "mmproj-c.gguf", name="third-model")
    rows = {m.name: m.to_json() for m in scan([tmp_path], ProbeCache())}
    assert rows["a.gguf"]["projector"] == "mmproj-a.gguf"
    assert rows["b.gguf"]["projector"] == ""
    assert rows["mmproj-a.gguf"]["role"] == "projector"
    assert "projector" not in rows["mmproj-c.gguf"]


def test_a_session_loads_the_paired_projector_or_the_named_one(tmp_path: Path) -> None:
    from bmoe.engine.errors import LoadError
    from bmoe.engine.session import Session

    model, proj = make_vision_pair(tmp_path / "pair")
    s = Session(model, {"ctx-size": 256, "threads": 1})
    try:
        assert s.vision is not None and s.vision.projector == proj
        assert s.vision.fixed_tokens == 16
    finally:
        s.close()
    lone = make_model(tmp_path / "lone" / "lone.gguf", name="bmoe-vision-test")
    s = Session(lone, {"ctx-size": 256, "threads": 1})
    try:
        assert s.vision is None
    finally:
        s.close()
    s = Session(lone, {"ctx-size": 256, "threads": 1, "mmproj": str(proj)})
    try:
        assert s.vision is not None and s.vision.projector == proj
    finally:
        s.close()
    with pytest.raises(LoadError, match="does not exist"):
        Session(lone, {"ctx-size": 256, "threads": 1, "mmproj": str(tmp_path / "nope.gguf")})


def test_a_projector_for_another_width_is_refused_at_load_not_crashed(tmp_path: Path) -> None:
    from bmoe.engine.errors import LoadError
    from bmoe.engine.session import Session

    model = make_model(tmp_path / "m.gguf", name="w")
    wrong = make_projector(tmp_path / "p.gguf", name="w", n_embd_text=32)
    with pytest.raises(LoadError, match="could not be loaded with this model"):
        Session(model, {"ctx-size": 256, "threads": 1, "mmproj": str(wrong)})


def test_a_paired_projector_libmtmd_refuses_leaves_the_model_loaded_without_images(
        tmp_path: Path) -> None:
    from bmoe.engine.errors import LoadError
    from bmoe.engine.session import Session

    model = make_model(tmp_path / "m.gguf", name="w")
    make_projector(tmp_path / "p.gguf", name="w", n_embd_text=32)   # pairs, but cannot load
    s = Session(model, {"ctx-size": 256, "threads": 1})
    try:
        assert s.vision is None
    finally:
        s.close()
    with pytest.raises(LoadError, match="is not an image projector"):
        Session(model, {"ctx-size": 256, "threads": 1, "mmproj": str(model)})
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(LoadError, match="is not an image projector"):
        Session(model, {"ctx-size": 256, "threads": 1, "mmproj": str(junk)})
