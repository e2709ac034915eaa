"""The ctypes mirror of `struct ggml_tensor`, checked field by field against the loaded
ggml (a scratch context, no model)."""

from __future__ import annotations

import pytest

from bmoe.engine.experts import ggml


def test_the_mirror_reads_every_field_of_a_probe_tensor() -> None:
    assert ggml._field_problems(ggml._probe_lib()) == []
    ggml.check_layout()


def test_a_shifted_field_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ggml, "OFF_OP", ggml.OFF_OP + 4)
    monkeypatch.setattr(ggml, "OFF_NAME", ggml.OFF_NAME + 1)
    problems = ggml._field_problems(ggml._probe_lib())
    assert any("op reads" in p for p in problems)    # the view's op: VIEW
    assert any(p.startswith("name reads") for p in problems)
