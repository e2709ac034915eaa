"""The ctypes mirror of `struct ggml_tensor`, checked field by field against the loaded
ggml (a scratch context, no model), and the native graph callback's reading of it."""

from __future__ import annotations

import pytest

from bmoe.engine.experts import evalcb, ggml


def test_the_mirror_reads_every_field_of_a_probe_tensor() -> None:
    assert ggml._field_problems(ggml._probe_lib()) == []
    ggml.check_layout()


def test_a_shifted_field_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ggml, "OFF_OP", ggml.OFF_OP + 4)
    monkeypatch.setattr(ggml, "OFF_NAME", ggml.OFF_NAME + 1)
    problems = ggml._field_problems(ggml._probe_lib())
    assert any("op reads" in p for p in problems)    # the view's op: VIEW
    assert any(p.startswith("name reads") for p in problems)


@pytest.mark.parametrize("name,field", [("OFF_NE", "ne reads"), ("OFF_NB", "nb reads"),
                                        ("OFF_DATA", "data reads"), ("OFF_SRC", "src[0] reads")])
def test_each_offset_the_native_callback_gets_is_checked(
        monkeypatch: pytest.MonkeyPatch, name: str, field: str) -> None:
    monkeypatch.setattr(ggml, name, getattr(ggml, name) + 8)
    problems = ggml._field_problems(ggml._probe_lib())
    assert any(p.startswith(field) for p in problems), problems


def _native(layout: list[int] | None = None) -> evalcb.NativeCallback:
    return evalcb.NativeCallback(lambda *_a: True, lambda _n: 0, layout=layout)


def test_the_native_side_reads_the_probe_as_the_mirror_does() -> None:
    cb = _native()
    assert cb.fn and cb.user_data
    assert cb.stats() == {"asks": 0, "bind_calls": 0, "route_calls": 0, "binding": True,
                          "resident_routes": 0, "resident_hits": 0, "resident": False,
                          "guessed": 0, "guess_missing": 0}
    assert cb.resident(True, 4, 8) and cb.stats()["resident"]
    assert not cb.resident(True, 4, 1 << 20)      # more experts than the C side counts


def test_the_native_side_refuses_a_wrong_offset() -> None:
    layout = ggml.native_layout()
    shifted = list(layout)
    shifted[2] += 8                                          # ne
    with pytest.raises(evalcb.NativeUnavailable, match=r"ne reads \[5, 1\]"):
        _native(shifted)
    outside = list(layout)
    outside[0] = layout[6]                                   # op past the struct's end
    with pytest.raises(evalcb.NativeUnavailable, match="outside the tensor"):
        _native(outside)
    for field in (9, 10):                                    # type, view_src
        outside = list(layout)
        outside[field] = layout[6] - 2                       # across the struct's end
        with pytest.raises(evalcb.NativeUnavailable, match="outside the tensor"):
            _native(outside)
    with pytest.raises(evalcb.NativeUnavailable, match="outside the tensor"):
        _native(layout[:-1])                                 # an older extension's count
