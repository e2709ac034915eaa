"""The GGUF probe: figures against the engine's own expert layout, roles from the header,
split sets, and hostile headers (a fixed corpus and Hypothesis) read as "not readable"."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _gguf_files import hostile_headers, make_model, split_model, write_kind
from bmoe.engine.experts.layout import read_layout
from bmoe.models.probe import (HEADER_CAP, ModelProbe, Truncated, Unreadable, parse_header,
                               probe_file, probe_files, probe_source, read_header, split_parts)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("probe")
    moe = make_model(d / "moe.gguf", n_layer=3, n_expert=8, n_expert_used=2)
    dense = make_model(d / "dense.gguf", arch="qwen3")
    return {"moe": moe, "dense": dense, "dir": d}


def fetch_of(data: bytes):  # type: ignore[no-untyped-def]
    return lambda offset, length: data[offset:offset + length]


def test_moe_figures_match_the_streamers_layout(files: dict[str, Path]) -> None:
    p = probe_file(files["moe"])
    layout = read_layout(files["moe"])
    assert p.readable and p.role == "model" and p.arch == "qwen3moe"
    assert (p.block_count, p.n_layer, p.n_moe_layer) == (3, 3, 3)
    assert (p.n_expert, p.n_expert_used, p.n_embd) == (8, 2, 64)
    assert p.is_moe and p.streamable and p.refusal == ""
    assert p.expert_bytes == layout.expert_bytes
    assert p.dense_bytes == layout.dense_bytes
    assert p.token_cycle_bytes == layout.token_cycle_bytes
    assert p.largest_dense_tensor == max(n for _, n in layout.dense)
    # header + tensors is the file, to the alignment
    assert p.header_bytes + p.dense_bytes + p.expert_bytes <= files["moe"].stat().st_size
    assert set(p.to_json()) == set(ModelProbe.WIRE)


def test_dense_model_is_not_streamed_and_carries_no_refusal(files: dict[str, Path]) -> None:
    p = probe_file(files["dense"])
    assert p.readable and p.role == "model" and not p.is_moe
    assert not p.streamable and p.refusal == "" and p.expert_bytes == 0


def test_split_set_sums_every_shard_and_is_refused_streaming(files: dict[str, Path]) -> None:
    shards = split_model(files["moe"], files["dir"], "moe-split", 3)
    whole, first = probe_files(shards), probe_file(shards[0])
    single = probe_file(files["moe"])
    assert whole.expert_bytes == single.expert_bytes and whole.dense_bytes == single.dense_bytes
    assert first.expert_bytes < single.expert_bytes        # one shard holds part of it
    assert whole.split_count == 3 and not whole.streamable
    assert "split into 3 files" in whole.refusal
    assert split_parts(shards[1].name) == ("moe-split", 2, 3)


@pytest.mark.parametrize("kind,kw,role", [
    ("projector (general.type)", {"arch": "clip", "kv": {"general.type": "mmproj"}}, "projector"),
    ("projector (arch clip)", {"arch": "clip"}, "projector"),
    ("draft (nextn)", {"kv": {"llama.nextn_predict_layers": 2}}, "draft"),
    ("draft (target layers)", {"kv": {"llama.target_layers": 3}}, "draft"),
    ("other (general.type)", {"kv": {"general.type": "adapter"}}, "other"),
    ("other (no block count)", {"block_count": None}, "other"),
    ("model", {}, "model"),
])
def test_role_comes_from_the_header(tmp_path: Path, kind: str, kw: dict, role: str) -> None:
    # the name says "model" every time: only the header decides
    path = write_kind(tmp_path / "Model-Q4_K_M.gguf", **kw)
    assert probe_file(path).role == role, kind


@pytest.mark.parametrize("name", list(hostile_headers()))
def test_hostile_header_is_not_readable(name: str) -> None:
    p = probe_source(fetch_of(hostile_headers()[name]))
    assert not p.readable and p.reason and p.role == ""
    assert p.to_json()["readable"] is False


def test_truncated_real_header_at_every_cut(files: dict[str, Path]) -> None:
    data = files["moe"].read_bytes()
    end = probe_file(files["moe"]).header_bytes
    for cut in list(range(0, 64)) + list(range(64, end, max(1, end // 300))):
        with pytest.raises((Truncated, Unreadable)):
            parse_header(data[:cut])
        assert not probe_source(fetch_of(data[:cut])).readable


def test_header_longer_than_the_cap_is_refused_without_reading_it_all() -> None:
    asked: list[int] = []
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"a.b"
    head += struct.pack("<IQ", 8, HEADER_CAP * 2)        # a string longer than the cap

    def fetch(offset: int, length: int) -> bytes:
        asked.append(length)
        return (head + b"x" * length)[offset:offset + length]
    with pytest.raises(Unreadable):
        read_header(fetch)
    assert sum(asked) <= HEADER_CAP


def test_a_header_that_needs_more_than_the_first_read_is_fetched_in_steps(tmp_path: Path) -> None:
    big = {f"blk.{i}.w{j}.weight": (4, 4) for i in range(30) for j in range(2000)}
    path = write_kind(tmp_path / "many.gguf", tensors=big)
    p = probe_file(path)
    assert p.readable and p.header_bytes > 2 << 20


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_headers_never_escape(files: dict[str, Path], data: st.DataObject) -> None:
    real = bytearray(files["moe"].read_bytes()[:probe_file(files["moe"]).header_bytes])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(real) - 1))
        real[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(real)))
    p = probe_source(fetch_of(bytes(real[:cut])))
    assert isinstance(p, ModelProbe)
    if not p.readable:
        assert p.reason


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=512))
def test_fuzz_random_bytes_after_the_magic(blob: bytes) -> None:
    for data in (blob, b"GGUF" + blob, b"GGUF\x03\x00\x00\x00" + blob):
        p = probe_source(fetch_of(data))
        assert isinstance(p, ModelProbe)


def test_model_bytes_counts_every_shard_present(tmp_path: Path) -> None:
    from bmoe.models.probe import model_bytes

    (tmp_path / "m-00001-of-00003.gguf").write_bytes(b"x" * 3)
    (tmp_path / "m-00002-of-00003.gguf").write_bytes(b"x" * 5)
    (tmp_path / "one.gguf").write_bytes(b"x" * 7)
    assert model_bytes(tmp_path / "m-00001-of-00003.gguf") == 8      # the third is missing
    assert model_bytes(str(tmp_path / "one.gguf")) == 7
