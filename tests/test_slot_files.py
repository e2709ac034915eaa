"""llama-server's slot files (``--slot-save-path``, ``POST /slots/{id}?action=...``).

Real engine: the KV cache of a prompt is saved to a file, replaced by another prompt's,
restored, and the next request that starts the same way takes its prefix from the
restored KV. Files that are not a saved state of this model (short, wrong magic, a count
past the context, ids past the vocabulary, cut short, noise) are refused with a 400 and
the server answers on; names with a folder part are refused before any file is touched.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess, start_server

PROMPT = "What is the capital of France? Tell me about it."
OTHER = "Something else entirely, with other words."


@pytest.fixture(scope="module")
def slots(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path
          ) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("slots")
    srv = start_server(tmp_path_factory.mktemp("data"), "--model", str(tiny_moe), "-c", "256",
                       "--slot-save-path", str(folder), "--parallel", "2")
    try:
        yield srv, folder
    finally:
        srv.stop()


def _complete(srv: ServerProcess, prompt: str) -> dict[str, Any]:
    status, _, body = srv.request("POST", "/completion", {"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                         "cache_prompt": True})
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _act(srv: ServerProcess, slot: int, action: str, body: Any = None) -> tuple[int, Any]:
    status, _, answer = srv.request("POST", f"/slots/{slot}?action={action}", body or {})
    return status, answer


def test_save_restore_and_the_prefix_comes_from_the_file(
        slots: tuple[ServerProcess, Path]) -> None:
    srv, folder = slots
    first = _complete(srv, PROMPT)
    status, saved = _act(srv, 1, "save", {"filename": "france.bin"})
    assert status == 200, saved
    assert saved["n_saved"] == first["timings"]["prompt_n"] + first["timings"]["cache_n"] + 2
    assert (folder / "france.bin").stat().st_size == saved["n_written"]
    assert [p.name for p in folder.iterdir() if p.name.endswith(".part")] == []
    assert (folder / ".france.bin.slot.json").is_file()
    _complete(srv, OTHER)                                   # the KV is now another prompt's
    status, restored = _act(srv, 0, "restore", {"filename": "france.bin"})
    assert status == 200, restored
    assert restored["n_restored"] == saved["n_saved"]
    again = _complete(srv, PROMPT)
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1
    assert again["content"] == first["content"]
    status, erased = _act(srv, 0, "erase")
    assert status == 200 and erased["n_erased"] > 0, erased
    assert _complete(srv, PROMPT)["timings"]["cache_n"] == 0


@pytest.mark.parametrize("name", ["../x.bin", "a/b.bin", ".hidden", "", "x\ny", "a\\b"])
def test_a_name_with_a_folder_part_is_refused(slots: tuple[ServerProcess, Path],
                                              name: str) -> None:
    srv, folder = slots
    status, body = _act(srv, 0, "save", {"filename": name})
    assert status == 400 and "Invalid filename" in body["error"]["message"], body
    assert not (folder.parent / "x.bin").exists()


def _bad_files(good: bytes) -> dict[str, bytes]:
    magic = struct.pack("=I", 0x67677371)
    return {
        "short.bin": b"gg",
        "magic.bin": b"XXXX" + good[4:],
        "count.bin": magic + struct.pack("=II", 3, 10**6),
        "vocab.bin": magic + struct.pack("=II", 3, 2) + struct.pack("=ii", 5, 10**7),
        "cut.bin": good[: len(good) // 2],      # llama.cpp alone aborts on this one
        "flipped.bin": good[:-8] + bytes(b ^ 0xFF for b in good[-8:]),
        "garbage.bin": os.urandom(4096),
    }


@pytest.mark.parametrize("with_record", [False, True])
def test_files_that_are_not_what_was_saved_are_refused_and_nothing_falls(
        slots: tuple[ServerProcess, Path], with_record: bool) -> None:
    """Without a record, or with the record of the good file copied beside them (its
    model and context match, its digest does not)."""
    srv, folder = slots
    _complete(srv, PROMPT)
    assert _act(srv, 0, "save", {"filename": "good.bin"})[0] == 200
    good = (folder / "good.bin").read_bytes()
    record = (folder / ".good.bin.slot.json").read_text()
    for name, data in _bad_files(good).items():
        (folder / name).write_bytes(data)
        if with_record:
            (folder / f".{name}.slot.json").write_text(record)
        status, body = _act(srv, 0, "restore", {"filename": name})
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (name, body)
        said = "changed since it was saved" if with_record else "not saved by this server"
        assert said in body["error"]["message"], body
        assert srv.info()["state"] == "ready"
        assert _complete(srv, PROMPT)["content"]          # the server answers on
    status, body = _act(srv, 0, "restore", {"filename": "missing.bin"})
    assert status == 404, body
    assert _act(srv, 5, "erase")[0] == 400                # past --parallel 2
    assert _act(srv, 0, "bogus")[0] == 400
    assert _act(srv, 0, "restore", {"filename": "good.bin"})[0] == 200


def test_a_slot_saved_for_another_context_is_refused(
        tmp_path: Path, tiny_moe: Path, slots: tuple[ServerProcess, Path]) -> None:
    srv, folder = slots
    _complete(srv, PROMPT)
    assert _act(srv, 0, "save", {"filename": "ctx256.bin"})[0] == 200
    other = start_server(tmp_path, "--model", str(tiny_moe), "-c", "512",
                         "--slot-save-path", str(folder))
    try:
        status, body = _act(other, 0, "restore", {"filename": "ctx256.bin"})
        assert status == 400 and "another model or context" in body["error"]["message"], body
    finally:
        other.stop()
