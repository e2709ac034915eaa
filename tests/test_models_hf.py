"""Hugging Face on --hf-endpoint (the local HTTPS hub): search, models, inspect (verdicts,
one model larger than this machine, a header read cut once, every time, by a host that
will not resume), add, forget, a direct link; and what curl is given: only URLs the
server built from validated parts, the token never on a command line."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from _hub import TOKEN, Hub
from _models_support import (BIG, BIG_NAME, GATED, SPLIT, TINY, curl_spy, models_server,
                             stock_hub)
from conftest import ServerProcess

from bmoe.models import curl
from bmoe.models.curl import CurlConfig
from bmoe.models.hf import HfError, HfSite
from bmoe.models.probe import FIRST_READ, ModelProbe


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("hub")
    h = Hub(folder)
    info = stock_hub(h, folder)
    yield h, info
    h.close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory,
        hub: tuple[Hub, dict[str, Any]]) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("hf-server")
    env, log = curl_spy(folder)
    s = models_server(folder / "data", hub[0], env=env)
    yield s, log
    s.stop()


def post(s: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, data = s.request("POST", path, body)
    return status, data


def test_search_asks_for_the_fields_by_name(srv: tuple[ServerProcess, Path],
                                            hub: tuple[Hub, dict[str, Any]]) -> None:
    s, _ = srv
    status, body = post(s, "/api/hf/search", {"query": "bmoe-test"})
    assert status == 200 and body["query"] == "bmoe-test"
    ids = [r["id"] for r in body["repos"]]
    assert ids[0] == TINY and set(ids) >= {TINY, SPLIT, GATED, BIG}    # most downloaded first
    gated = next(r for r in body["repos"] if r["id"] == GATED)
    assert gated["gated"] is True and gated["modified"].startswith("2026-")
    asked = [r for r in hub[0].requests if r["path"] == "/api/models"][-1]
    assert set(asked["expand"]) >= {"downloads", "likes", "lastModified", "gated"}
    for bad in ({}, {"query": ""}, {"query": 3}, {"query": "x" * 201}):
        assert post(s, "/api/hf/search", bad)[0] == 400


def test_models_groups_sets_orders_by_role_and_reads_links(srv: tuple[ServerProcess, Path],
                                                           hub: tuple[Hub, dict[str, Any]]) -> None:
    s, _ = srv
    status, body = post(s, "/api/hf/models", {"repo": TINY})
    assert status == 200, body
    assert (body["repo"], body["revision"], body["file"]) == (TINY, "main", "")
    roles = [(m["name"], m["role"]) for m in body["models"]]
    assert roles[-1] == ("mmproj-tiny-F16.gguf", "projector"), roles
    tiny = next(m for m in body["models"] if m["name"] == "tiny-moe-F32.gguf")
    assert tiny["quant"] == "F32" and tiny["complete"] and tiny["count"] == 1
    status, body = post(s, "/api/hf/models", {"repo": f"{hub[0].url}/{SPLIT}/blob/main/F32/"
                                              "tiny-dense-F32-00002-of-00003.gguf"})
    assert status == 200, body
    assert body["file"] == "F32/tiny-dense-F32-00001-of-00003.gguf"
    (split,) = body["models"]
    assert split["count"] == 3 and split["complete"] and len(split["files"]) == 3
    assert split["bytes"] == sum(p.stat().st_size for p in hub[1]["shards"])
    for text in ("a name to search for", "https://evil.example/owner/repo", "../../etc",
                 f"{hub[0].url}/{TINY}/tree/..%2F..", "owner/repo/extra", "", 7,
                 f"{hub[0].url}/{TINY}/resolve/main/../x.gguf"):
        status, body = post(s, "/api/hf/models", {"repo": text})
        assert (status, body["code"]) == (400, "not_a_repo"), (text, body)
    status, body = post(s, "/api/hf/models", {"repo": "bmoe-test/no-such-repo"})
    assert status == 401, body
    status, body = post(s, "/api/hf/models", {"repo": TINY, "revision": "v9"})
    assert status == 404, body


def test_a_gated_repository_needs_its_token_which_reaches_curl_only_in_a_file(
        srv: tuple[ServerProcess, Path], hub: tuple[Hub, dict[str, Any]]) -> None:
    s, log = srv
    status, body = post(s, "/api/hf/models", {"repo": GATED})
    assert (status, body["code"]) == (401, "hf_unauthorized"), body
    status, body = post(s, "/api/hf/models", {"repo": GATED, "token": TOKEN})
    assert status == 200 and body["models"][0]["name"] == "gated-moe-F32.gguf", body
    status, body = post(s, "/api/hf/inspect", {"repo": GATED, "name": "gated-moe-F32.gguf",
                                               "token": TOKEN})
    assert status == 200 and body["model"]["readable"], body
    assert any(r["auth"] == f"Bearer {TOKEN}" for r in hub[0].requests)
    calls = log.read_text()
    assert TOKEN not in calls                          # never on a command line
    assert "@" in calls and "--header" in calls        # a header file instead
    assert post(s, "/api/hf/models", {"repo": GATED, "token": "two words"})[0] == 400


def test_inspect_a_small_moe_fits_and_streams(srv: tuple[ServerProcess, Path]) -> None:
    s, _ = srv
    status, body = post(s, "/api/hf/inspect", {"repo": TINY, "name": "tiny-moe-F32.gguf"})
    assert status == 200, body
    m, v = body["model"], body["verdict"]
    assert m["readable"] and m["role"] == "model" and m["arch"] == "qwen3moe" and m["is_moe"]
    assert m["streamable"] and m["refusal"] == ""
    assert (v["mode"], v["fit"], v["downloadable"]) == ("streams", "fits", True)
    assert v["headline"] == "Fits here: the experts stream from flash"
    assert v["memory"].startswith("the experts stream from flash and ")
    assert v["memory"].endswith("and the plan sizes the cache from the rest")
    assert v["disk"].startswith("needs ") and "MiB free" in v["disk"]
    mach = body["machine"]
    assert mach["residency_budget"] > 0 and mach["memory_total"] >= mach["budget_if_loaded"]
    assert mach["disk_free"] > 0 and mach["present_bytes"] == 0


def disk_first(body: dict[str, Any], fit: str) -> str:
    """The fit this machine gives: a model needing more disk than the models folder has
    free is `no_disk` before anything else (the big model needs 62.9 GB; the memory
    verdict stays in `memory`)."""
    m = body["machine"]
    return "no_disk" if body["bytes"] - m["present_bytes"] > m["disk_free"] else fit


def test_inspect_a_model_larger_than_this_machine(srv: tuple[ServerProcess, Path],
                                                  hub: tuple[Hub, dict[str, Any]]) -> None:
    s, _ = srv
    hub[0].requests.clear()
    status, body = post(s, "/api/hf/inspect", {"repo": BIG, "name": BIG_NAME})
    assert status == 200, body
    assert body["bytes"] == hub[1]["big_size"] > body["machine"]["memory_total"]
    m, v = body["model"], body["verdict"]
    assert (m["n_expert"], m["n_expert_used"], m["n_layer"]) == (128, 4, 36)
    assert m["expert_bytes"] > 60e9 and m["token_cycle_bytes"] == m["expert_bytes"] * 4 // 128
    assert v["mode"] == "streams" and v["fit"] == disk_first(body, "fits"), v
    assert "that fits in" in v["memory"], v        # the memory verdict, whatever the disk
    # only the header crossed the line: range requests, no more than the first read
    fetched = [r for r in hub[0].requests if r["path"].startswith("/cdn/")]
    assert fetched and all(r["range"] and r["range"].startswith("bytes=0-") for r in fetched)
    print("\nINSPECT", json.dumps(body, indent=1))


def test_inspect_verdicts_for_what_is_not_a_streamed_model(srv: tuple[ServerProcess, Path]) -> None:
    s, _ = srv
    status, body = post(s, "/api/hf/inspect", {"repo": TINY, "name": "mmproj-tiny-F16.gguf"})
    assert status == 200
    v = body["verdict"]
    assert (v["mode"], v["fit"], v["downloadable"]) == ("not a model", "not_a_model", False)
    assert "projector" in v["memory"] and body["model"]["role"] == "projector"
    status, body = post(s, "/api/hf/inspect", {"repo": TINY, "name": "tiny-moe-broken.gguf"})
    assert status == 200
    assert body["model"] == {"readable": False}
    assert (body["verdict"]["mode"], body["verdict"]["fit"]) == ("not readable", "unknown")
    status, body = post(s, "/api/hf/inspect", {"repo": SPLIT,
                                               "name": "F32/tiny-dense-F32-00001-of-00003.gguf"})
    assert status == 200
    assert (body["verdict"]["mode"], body["verdict"]["fit"]) == ("plain mmap", "no_streaming")
    assert body["files"] == 3 and body["complete"]
    assert post(s, "/api/hf/inspect", {"repo": TINY, "name": "nope.gguf"})[0] == 404


def test_add_forget_and_the_added_entries_are_kept(srv: tuple[ServerProcess, Path],
                                                   hub: tuple[Hub, dict[str, Any]]) -> None:
    s, _ = srv
    status, body = post(s, "/api/hf/add", {"repo": SPLIT,
                                           "name": "F32/tiny-dense-F32-00001-of-00003.gguf"})
    assert status == 201, body
    eid = body["id"]
    assert eid == f"hf:{SPLIT}/F32/tiny-dense-F32-00001-of-00003.gguf"
    assert body["title"] == "tiny-dense-F32" and body["quant"] == "F32"
    assert post(s, "/api/hf/add", {"repo": SPLIT, "name": "F32/tiny-dense-F32-00001-of-00003.gguf"})[0] == 201
    rows = [c for c in s.request("GET", "/api/models")[2]["catalog"] if c["id"] == eid]
    assert len(rows) == 1 and rows[0]["added"] and len(rows[0]["files"]) == 3
    f0 = rows[0]["files"][0]
    assert f0["name"] == "tiny-dense-F32-00001-of-00003.gguf" and len(f0["sha256"]) == 64
    assert f0["url"].startswith(hub[0].url + f"/{SPLIT}/resolve/main/")
    saved = json.loads((s.data_dir / "added-models.json").read_text())
    assert [m["id"] for m in saved["models"]] == [eid]
    status, _, body = s.request("DELETE", f"/api/hf/entry/{eid}")
    assert status == 200, body
    assert s.request("DELETE", f"/api/hf/entry/{eid}")[0] == 404
    assert s.request("DELETE", "/api/hf/entry/qwen3-30b-a3b-q4_k_m")[0] == 404  # shipped


def test_a_direct_link_becomes_an_entry_of_the_whole_set(srv: tuple[ServerProcess, Path],
                                                         hub: tuple[Hub, dict[str, Any]]) -> None:
    s, _ = srv
    url = hub[0].resolve_url(SPLIT, "F32/tiny-dense-F32-00002-of-00003.gguf") + "?download=1#x"
    status, body = post(s, "/api/models/url", {"url": url})
    assert status == 201, body
    assert body["id"] == "url:tiny-dense-F32-00001-of-00003.gguf"
    assert body["bytes"] == sum(p.stat().st_size for p in hub[1]["shards"])
    row = next(c for c in s.request("GET", "/api/models")[2]["catalog"] if c["id"] == body["id"])
    assert [f["url"].endswith("-of-00003.gguf?download=1") for f in row["files"]] == [True] * 3
    for bad in ("http://127.0.0.1/x.gguf", "https://u:p@127.0.0.1/x.gguf",
                "https://127.0.0.1/x.bin", "https://127.0.0.1/.x.gguf", "https://127.0.0.1/-x.gguf",
                "https://127.0.0.1/a%2Fb.gguf", "file:///etc/passwd", "--config=/x.gguf",
                "https://127.0.0.1/x-00001-of-00200.gguf", 5):
        status, body = post(s, "/api/models/url", {"url": bad})
        assert (status, body.get("code")) == (400, "invalid_url"), (bad, body)
    status, body = post(s, "/api/models/url", {"url": hub[0].resolve_url(TINY, "missing.gguf")})
    assert status == 502, body
    assert s.request("DELETE", "/api/hf/entry/url:tiny-dense-F32-00001-of-00003.gguf")[0] == 200


def test_ids_never_name_a_path_or_a_url(srv: tuple[ServerProcess, Path]) -> None:
    s, _ = srv
    for eid in ("../../etc/passwd", "https://evil.example/x.gguf", "/etc/passwd", "", None, 3):
        status, _, body = s.request("POST", "/api/models/download", {"id": eid})
        assert status in (400, 404), (eid, body)
    for eid in ("..%2F..%2Fetc%2Fpasswd", "https:%2F%2Fevil.example%2Fx"):
        assert s.request("DELETE", f"/api/models/partial/{eid}")[0] == 404
        assert s.request("DELETE", f"/api/models/download/{eid}")[0] == 404
    assert post(s, "/api/hf/add", {"repo": TINY, "name": "../../x.gguf"})[0] == 404
    assert post(s, "/api/hf/inspect", {"repo": "https://evil.example/a/b",
                                       "name": "x.gguf"})[0] == 400


def cdn_ranges(h: Hub) -> list[str | None]:
    """The Range of every request that reached the bytes (after the site's redirect)."""
    return [r["range"] for r in h.requests if r["path"].startswith("/cdn/")]


def big_header_bytes(h: Hub) -> int:
    return len(h.repos[BIG].files[BIG_NAME].data)


def test_inspect_resumes_a_header_read_cut_once(srv: tuple[ServerProcess, Path],
                                                hub: tuple[Hub, dict[str, Any]]) -> None:
    """A connection closed inside the header is tried again after the downloads' first
    wait, from the byte it ended at, and the inspect answers as if nothing happened."""
    s, _ = srv
    h = hub[0]
    cut = big_header_bytes(h) // 3
    h.clear()
    h.fault(BIG, BIG_NAME, drop_after=cut, times=1)
    try:
        t0 = time.monotonic()
        status, body = post(s, "/api/hf/inspect", {"repo": BIG, "name": BIG_NAME})
        waited = time.monotonic() - t0
        assert status == 200, body
        assert body["model"]["readable"] and body["model"]["n_expert"] == 128, body
        assert cdn_ranges(h) == [f"bytes=0-{FIRST_READ - 1}", f"bytes={cut}-"]
        assert waited >= curl.retry_wait(1)
    finally:
        h.clear()


async def test_a_header_read_cut_every_time_gives_up_after_the_bounded_attempts(
        autojump_clock: trio.testing.MockClock, hub: tuple[Hub, dict[str, Any]]) -> None:
    """Cut every time: the downloads' six attempts, each resumed where the last one ended,
    the downloads' waits between them (2 + 4 + 8 + 16 + 32 s, on a clock that jumps),
    then the route's 502 with a sentence."""
    h = hub[0]
    cut = big_header_bytes(h) // 10              # six reads hold well under the header
    h.clear()
    h.fault(BIG, BIG_NAME, drop_after=cut, times=100)
    site = HfSite(h.url, CurlConfig(ca_file=h.cert))
    try:
        t0 = trio.current_time()
        with pytest.raises(HfError) as info:
            await site.header(BIG, "main", BIG_NAME, "")
        waited = trio.current_time() - t0
    finally:
        ranges = cdn_ranges(h)
        h.clear()
    e = info.value
    assert (e.status, e.code) == (502, "hf_unreachable")
    assert e.message == (f"The header of {BIG_NAME} could not be fetched: the connection "
                         f"ended before the file did (after {curl.MAX_ATTEMPTS} attempts).")
    assert ranges == [f"bytes=0-{FIRST_READ - 1}"] + [f"bytes={k * cut}-"
                                                       for k in range(1, curl.MAX_ATTEMPTS)]
    assert waited == pytest.approx(sum(curl.retry_wait(a) for a in range(1, curl.MAX_ATTEMPTS)))


async def test_a_host_that_will_not_resume_is_read_again_from_the_start(
        autojump_clock: trio.testing.MockClock, hub: tuple[Hub, dict[str, Any]]) -> None:
    """A host that ignores ranges, cut once: the continuation is refused (curl's exit 33,
    never bytes from the wrong place), and the header is read again from its first byte."""
    h = hub[0]
    cut = big_header_bytes(h) // 3
    h.clear()
    h.fault(BIG, BIG_NAME, drop_after=cut, times=1, no_ranges=True)
    site = HfSite(h.url, CurlConfig(ca_file=h.cert))
    try:
        header = await site.header(BIG, "main", BIG_NAME, "")
        ranges = cdn_ranges(h)
    finally:
        h.clear()
    assert ModelProbe.of([header]).n_expert == 128
    assert ranges == [f"bytes=0-{FIRST_READ - 1}", f"bytes={cut}-", f"bytes=0-{FIRST_READ - 1}"]


def test_curl_only_ever_receives_urls_the_server_built(srv: tuple[ServerProcess, Path],
                                                       hub: tuple[Hub, dict[str, Any]]) -> None:
    """Runs last in this file: every curl call so far, each with its URL after ``--``."""
    _, log = srv
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls
    for args in calls:
        assert "--proto" in args and args[args.index("--proto") + 1] == "=https"
        assert args[args.index("--proto-redir") + 1] == "=https"
        assert args[-2] == "--", args
        url = args[-1]
        assert url.startswith(hub[0].url + "/"), url
        assert not any(a.startswith("http") for a in args[:-1]), args


def test_inspect_under_a_memory_cap_will_not_fit(tmp_path: Path,
                                                 hub: tuple[Hub, dict[str, Any]]) -> None:
    """The same 66 GB model, with this server in a 1 GiB memory cgroup: its resident floor
    (dense weights and one token cycle, about 3.3 GB) is more than the process may hold."""
    group = Path("/sys/fs/cgroup/memory") / f"bmoe-models-test-{tmp_path.name[-12:]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as e:
        pytest.skip(f"no cgroup-v1 memory controller to cap the server with here: {e}")
    s = models_server(tmp_path / "data", hub[0])
    try:
        (group / "cgroup.procs").write_text(str(s.proc.pid))
        status, body = post(s, "/api/hf/inspect", {"repo": BIG, "name": BIG_NAME})
        assert status == 200, body
        assert body["machine"]["residency_budget"] <= 1 << 30
        v = body["verdict"]
        assert (v["mode"], v["fit"]) == ("streams", disk_first(body, "will_not_fit")), v
        assert "that is more than the" in v["memory"], v
        if v["fit"] == "will_not_fit":
            assert v["headline"].startswith("Will not fit: 3291 MiB must stay resident")
        print("\nCAPPED", json.dumps(v, indent=1))
    finally:
        s.stop()
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_inspect_counts_what_the_loaded_model_holds(tmp_path: Path, tiny_moe: Path,
                                                    hub: tuple[Hub, dict[str, Any]]) -> None:
    """With a model loaded, the verdict's machine says what unloading it would give back:
    the loaded model's holding (the planner's figure), added to what is free now."""
    s = models_server(tmp_path / "data", hub[0], "-m", str(tiny_moe), "--no-moe-stream")
    try:
        s.wait_state("ready")
        status, body = post(s, "/api/hf/inspect", {"repo": TINY, "name": "tiny-moe-F32.gguf"})
        assert status == 200, body
        mach = body["machine"]
        assert mach["loaded_model"] == tiny_moe.name
        assert mach["loaded_held"] == tiny_moe.stat().st_size      # resident: the whole file
        assert mach["budget_if_loaded"] == min(mach["residency_budget"] + mach["loaded_held"],
                                               mach["memory_total"])
    finally:
        s.stop()
