"""The models package's pure parts: the verdict's words (the spec's own example), the
retry policy, the catalog's rules, links and repository ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bmoe.models import catalog, curl, download, hf, service, verdict
from bmoe.models.errors import ModelsError
from bmoe.models.probe import ModelProbe

GEMMA = ModelProbe(readable=True, arch="gemma4", role="model", type="model", block_count=30,
                   is_moe=True, n_expert=128, n_expert_used=8, n_layer=30, n_moe_layer=30,
                   n_embd=2816, dense_bytes=1755954296, expert_bytes=12846366720,
                   token_cycle_bytes=802897920, largest_dense_tensor=784334848,
                   streamable=True)
SPEC_MACHINE = verdict.Machine(5736517632, 5736517632, "", 0, 15919931392, 38495465472, 0)


def test_the_specs_example_word_for_word() -> None:
    v = verdict.verdict(GEMMA, 14618145824, SPEC_MACHINE)
    assert v == {
        "downloadable": True, "mode": "streams", "fit": "fits",
        "headline": "Fits here: the experts stream from flash",
        "disk": "needs 13940 MiB of disk; the models folder has 36712 MiB free",
        "memory": "the experts stream from flash and 1674 MiB stays resident, plus a cache of "
                  "at least one token cycle (765 MiB); that fits in the 5470 MiB this process "
                  "may hold, and the plan sizes the cache from the rest"}


def test_every_fit_code() -> None:
    small = verdict.Machine(1 << 30, 1 << 30, "", 0, 2 << 30, 100 << 30, 0)
    v = verdict.verdict(GEMMA, 14618145824, small)
    assert (v["fit"], v["mode"]) == ("will_not_fit", "streams")
    assert v["headline"].startswith("Will not fit: 2440 MiB must stay resident")
    nodisk = verdict.Machine(8 << 30, 8 << 30, "", 0, 16 << 30, 1 << 30, 0)
    v = verdict.verdict(GEMMA, 14618145824, nodisk)
    assert (v["fit"], v["downloadable"]) == ("no_disk", False) and "Not enough disk" in v["headline"]
    present = verdict.Machine(8 << 30, 8 << 30, "", 0, 16 << 30, 1 << 30, 14618145824)
    assert verdict.verdict(GEMMA, 14618145824, present)["downloadable"] is True
    dense = ModelProbe(readable=True, arch="qwen3", role="model", dense_bytes=1 << 30)
    v = verdict.verdict(dense, 1 << 30, SPEC_MACHINE)
    assert (v["fit"], v["mode"]) == ("no_streaming", "plain mmap")
    refused = ModelProbe(readable=True, role="model", is_moe=True, refusal="it is split")
    assert "it is split" in verdict.verdict(refused, 1, SPEC_MACHINE)["memory"]
    for role in ("projector", "draft", "other"):
        v = verdict.verdict(ModelProbe(readable=True, role=role), 1, SPEC_MACHINE)
        assert (v["fit"], v["mode"], v["downloadable"]) == ("not_a_model", "not a model", False)
    v = verdict.verdict(ModelProbe.unreadable("the file ends inside its header"), 1, SPEC_MACHINE)
    assert (v["fit"], v["mode"]) == ("unknown", "not readable")
    assert "the file ends inside its header" in v["memory"]
    blind = verdict.Machine(0, 0, "", 0, 0, 100 << 30, 0)
    v = verdict.verdict(GEMMA, 14618145824, blind)
    assert v["fit"] == "unknown" and "could not be read" in v["headline"]


def test_a_loaded_model_is_named_in_the_sentence() -> None:
    m = verdict.Machine(5736517632, 5736517632, "other.gguf", 0, 15919931392, 38495465472, 0)
    assert "(measured with other.gguf loaded)" in verdict.verdict(GEMMA, 1, m)["memory"]


def test_machine_now_reads_this_machine() -> None:
    m = verdict.machine_now(loaded_model="", disk_free=5, present_bytes=0)
    assert 0 < m.residency_budget <= m.memory_total and m.budget_if_loaded == m.residency_budget


def test_the_retry_policy() -> None:
    assert [curl.retry_wait(a) for a in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]
    for code in (6, 7, 16, 18, 28, 35, 52, 55, 56, 92):
        assert curl.should_retry(code, 1) and curl.should_retry(code, 5)
        assert not curl.should_retry(code, 6)
    for code in (1, 22, 23, 33, 60, 63):
        assert not curl.should_retry(code, 1)
    # one policy: the downloads and the header reads follow curl.py's, not copies of it
    for user in (download, hf):
        assert (user.retry_wait, user.should_retry) == (curl.retry_wait, curl.should_retry)


def test_the_shipped_catalog_is_whole_and_valid() -> None:
    entries = catalog.load_shipped()
    ids = [e.id for e in entries]
    assert len(ids) == len(set(ids)) >= 6
    raw = json.loads(catalog.SHIPPED.read_text())["models"]
    assert len(raw) == len(entries)                          # none left out
    for e in entries:
        for f in e.files:
            assert catalog.is_bare_name(f.name) and f.url.startswith("https://huggingface.co/")
            assert not f.sha256 or catalog.SHA256.match(f.sha256)
    gemma = next(e for e in entries if e.id == "gemma-4-26b-a4b-it-q4_0")
    assert gemma.bytes == 14618145824


@pytest.mark.parametrize("bad,why", [
    ({"id": "x", "files": [{"name": "../x.gguf", "url": "https://h/x"}]}, "bare file name"),
    ({"id": "x", "files": [{"name": "a\\b.gguf", "url": "https://h/x"}]}, "bare file name"),
    ({"id": "x", "files": [{"name": "C:x.gguf", "url": "https://h/x"}]}, "bare file name"),
    ({"id": "x", "files": [{"name": "x.gguf", "url": "http://h/x"}]}, "not https"),
    ({"id": "x", "files": [{"name": "x.gguf", "url": "https://u:p@h/x"}]}, "user name"),
    ({"id": "x", "files": [{"name": "x.gguf", "url": "https://h/x", "sha256": "ABC"}]}, "sha256"),
    ({"id": "X Y", "files": [{"name": "x.gguf", "url": "https://h/x"}]}, "id"),
    ({"id": "x", "files": []}, "no file"),
])
def test_a_catalog_entry_that_breaks_a_rule_is_left_out(tmp_path: Path, bad: dict, why: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    good = {"id": "ok", "files": [{"name": "ok.gguf", "url": "https://h/ok.gguf", "bytes": 1}]}
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": [good, bad]}))
    with caplog.at_level(logging.WARNING):
        entries = catalog.load_shipped(path)
    assert [e.id for e in entries] == ["ok"]
    assert why in caplog.text


def test_added_entries_are_kept_atomically(tmp_path: Path) -> None:
    added = catalog.AddedEntries(tmp_path)
    e = catalog.Entry("url:a.gguf", "a", [catalog.CatalogFile("a.gguf", 3, "https://h/a.gguf")],
                      added=True)
    added.put(e)
    assert catalog.AddedEntries(tmp_path).get("url:a.gguf") is not None
    assert not list(tmp_path.glob(".*.tmp"))
    assert added.remove("url:a.gguf") and not catalog.AddedEntries(tmp_path).entries


@pytest.mark.parametrize("name,quant", [
    ("Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"), ("gpt-oss-20b-mxfp4.gguf", "MXFP4"),
    ("GLM-4.5-Air-Q4_K_M-00001-of-00002.gguf", "Q4_K_M"), ("x-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("gemma-4-26B-A4B-it-Q4_0.gguf", "Q4_0"), ("m-IQ2_XXS.gguf", "IQ2_XXS"),
    ("m-bf16.gguf", "BF16"), ("plain.gguf", ""),
])
def test_quant_from_a_file_name(name: str, quant: str) -> None:
    assert catalog.quant_of(name) == quant


def test_links_name_a_whole_set() -> None:
    url, names = service.url_shards("https://h.example/d/x-00002-of-00003.gguf?dl=1#frag")
    assert url == "https://h.example/d/x-00002-of-00003.gguf?dl=1"
    assert names == ["x-00001-of-00003.gguf", "x-00002-of-00003.gguf", "x-00003-of-00003.gguf"]
    assert service.with_last_segment(url, names[0]) == "https://h.example/d/x-00001-of-00003.gguf?dl=1"
    assert service.url_shards("https://h/m%2B1.gguf")[1] == ["m+1.gguf"]
    for bad in ("http://h/x.gguf", "https://h/x.gguf.exe", "https://h/", "ftp://h/x.gguf",
                "https:///x.gguf", "https://h/x-00001-of-00129.gguf", "https://h/a b.gguf"):
        with pytest.raises(ModelsError) as e:
            service.url_shards(bad)
        assert e.value.code == "invalid_url", bad
    assert service.url_shards("http://mirror:8/x.gguf", "http://mirror:8")[1] == ["x.gguf"]


@pytest.mark.parametrize("text,ref", [
    ("owner/repo", ("owner/repo", "main", "")),
    ("https://huggingface.co/owner/repo", ("owner/repo", "main", "")),
    ("huggingface.co/owner/repo/tree/dev", ("owner/repo", "dev", "")),
    ("https://hf.co/owner/repo/blob/main/Q4/m.gguf", ("owner/repo", "main", "Q4/m.gguf")),
    ("https://huggingface.co/owner/repo/resolve/v1.0/m.gguf?download=true",
     ("owner/repo", "v1.0", "m.gguf")),
])
def test_repository_ids_and_links(text: str, ref: tuple[str, str, str]) -> None:
    r = hf.parse_repo_text(text, hf.DEFAULT_ENDPOINT)
    assert (r.repo, r.revision, r.file) == ref


@pytest.mark.parametrize("text", [
    "qwen coder", "owner", "owner/repo/extra", "../etc", "owner/..", "https://evil.com/o/r",
    "https://huggingface.co.evil.com/o/r", "https://u:p@huggingface.co/o/r",
    "https://huggingface.co/o/r/blob/main/../../x", "https://huggingface.co/o/r/tree/a..b",
    "https://huggingface.co:444/o/r", "o/r?x", "",
])
def test_text_that_is_not_a_repository(text: str) -> None:
    with pytest.raises(hf.HfError) as e:
        hf.parse_repo_text(text, hf.DEFAULT_ENDPOINT)
    assert e.value.code == "not_a_repo"


def test_the_file_listing_groups_sets_and_takes_lfs_ids() -> None:
    sha = "a" * 64
    files = hf._tree_files([
        {"type": "file", "path": "README.md", "size": 3},
        {"type": "directory", "path": "Q4"},
        {"type": "file", "path": "Q4/m-00002-of-00002.gguf", "size": 2, "lfs": {"oid": sha, "size": 20}},
        {"type": "file", "path": "Q4/m-00001-of-00002.gguf", "lfs": {"oid": sha, "size": 10}},
        {"type": "file", "path": "mmproj-m-F16.gguf", "lfs": {"oid": "nothex", "size": 1}},
        {"type": "file", "path": "../evil.gguf", "size": 1},
        {"type": "file", "path": "mtp-m.gguf", "size": 1},
    ])
    models = hf.group_files(files)
    assert [(m.name, m.role, m.count, m.complete) for m in models] == [
        ("Q4/m-00001-of-00002.gguf", "model", 2, True), ("mtp-m.gguf", "draft", 1, True),
        ("mmproj-m-F16.gguf", "projector", 1, True)]
    assert models[0].bytes == 30 and models[0].files[0].sha256 == sha
    assert models[2].files[0].sha256 == ""


def test_every_shipped_model_names_its_chat_format() -> None:
    """The Models screen says which format each catalog model writes its reasoning and
    tool calls in: an engine family, named as /api/info names it."""
    from bmoe.engine.families import FAMILIES
    from bmoe.models.catalog import load_shipped
    entries = load_shipped()
    assert entries
    for e in entries:
        assert e.chat_format in FAMILIES, (e.id, e.chat_format)
        assert e.chat_format_name == FAMILIES[e.chat_format].label, e.id
        out = e.to_json()
        assert out["chat_format"] == e.chat_format
