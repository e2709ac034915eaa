"""Backend packs and the signed feed, end to end: a real bmoe-server, real curl, a local
HTTPS feed (tests/_hub.py) signed with a key made here, archives written with tarfile.

Every unsafe archive is refused with nothing installed; a feed changed after signing, or
signed by another key, is a ``feed_error`` and nothing from it is used; a pack whose
bytes are not the feed's SHA-256 is a 502 with nothing installed; an install writes
``pack.json``, says ``restart_required`` and publishes ``backend`` events; a pack that
does not load is reported at the next start, never fatal; and a real ggml CPU backend
built from the engine's own llama.cpp source registers after a restart.
(That the network is refused these routes is in tests/test_local_only_routes.py and
tests/test_security_e2e.py, which read the local-only list every route registers.)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _backend_pack import (cpu_backend_library, member, new_key, pack_entry, sign, tamper,
                           tar_pack)
from _hub import Hub
from _models_support import Events
from conftest import ServerProcess, start_server

from bmoe import __version__
from bmoe.backends.feed import target

TARGET = target()
REPO = "bmoe/release"
LIB = b"\x7fELF not really a library, just bytes of one\n" * 64


@dataclass
class Feed:
    hub: Hub
    key: Any
    key_file: Path
    packs: dict[str, bytes]
    entries: list[dict[str, Any]]
    installer: bytes

    @property
    def url(self) -> str:
        return self.hub.resolve_url(REPO, "feed.json")

    def publish(self, document: bytes) -> None:
        self.hub.add_file(REPO, "feed.json", document)

    def document(self, **changes: Any) -> bytes:
        inst = self.installer
        feed = {"version": "99.0.0", "published": "2026-11-30", "notes": "Faster and safer.",
                "packs": self.entries,
                "installers": {f"wheel-{TARGET}": {
                    "url": self.hub.resolve_url(REPO, "bmoe-99.0.0.whl"),
                    "sha256": hashlib.sha256(inst).hexdigest(), "size": len(inst),
                    "file": "bmoe-99.0.0-cp311-cp311-linux_x86_64.whl"}}}
        feed.update(changes)
        return sign(self.key, feed)


def _good_pack() -> bytes:
    return tar_pack([member("./", tarfile.DIRTYPE), member("libggml-test.so", data=LIB),
                     member("README", data=b"a test pack\n"), member("lib", tarfile.DIRTYPE),
                     member("lib/readme-link", tarfile.SYMTYPE, link="../README")])


# Each hostile archive, and what the refusal names.
UNSAFE: dict[str, tuple[list[tuple[tarfile.TarInfo, bytes]], str]] = {
    "absolute": ([member("/tmp/bmoe-pack-escape/abs.so", data=LIB)], "absolute path"),
    "drive": ([member("C:evil.so", data=LIB)], "drive"),
    "backslash": ([member("..\\evil.so", data=LIB)], "backslash"),
    "dotdot": ([member("libggml-x.so", data=LIB), member("../evil.so", data=LIB)], ".."),
    "dotdot-deep": ([member("a/b/../../../evil.so", data=LIB)], ".."),
    "hardlink": ([member("libggml-x.so", data=LIB),
                  member("libggml-y.so", tarfile.LNKTYPE, link="/etc/passwd")], "hard link"),
    "chardev": ([member("libggml-x.so", data=LIB), member("null", tarfile.CHRTYPE)],
                "character device"),
    "blockdev": ([member("libggml-x.so", data=LIB), member("sda", tarfile.BLKTYPE)],
                 "block device"),
    "fifo": ([member("libggml-x.so", data=LIB), member("pipe", tarfile.FIFOTYPE)], "fifo"),
    "under-link": ([member("out", tarfile.SYMTYPE, link="/tmp/bmoe-pack-escape"),
                    member("out/evil.so", data=LIB)], "under the link"),
    "under-link-later": ([member("out/", tarfile.DIRTYPE), member("out/x.so", data=LIB),
                          member("out", tarfile.SYMTYPE, link="/tmp")], "entry out"),
    "twice": ([member("libggml-x.so", data=LIB), member("libggml-x.so", data=LIB)], "twice"),
    "link-outside": ([member("libggml-x.so", data=LIB),
                      member("etc", tarfile.SYMTYPE, link="../../../../etc")],
                     "points outside"),
    "link-absolute": ([member("libggml-x.so", data=LIB),
                       member("passwd", tarfile.SYMTYPE, link="/etc/passwd")], "points outside"),
}


@pytest.fixture(scope="module")
def feed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Feed]:
    folder = tmp_path_factory.mktemp("feed")
    hub = Hub(folder)
    key, key_file = new_key(folder)
    packs = {"good": _good_pack(), "needs-driver": _good_pack(), "tampered": _good_pack(),
             "no-library": tar_pack([member("README", data=b"nothing to load\n")])}
    packs.update({f"unsafe-{name}": tar_pack(members) for name, (members, _) in UNSAFE.items()})
    entries = []
    for pid, data in packs.items():
        hub.add_file(REPO, f"{pid}.tar.gz", data)
        extra: dict[str, Any] = {}
        if pid == "needs-driver":
            extra["drivers"] = ["libbmoe-no-such-driver.so.9"]
        entries.append(pack_entry(pid, hub.resolve_url(REPO, f"{pid}.tar.gz"), data, TARGET,
                                  title=f"Pack {pid}", **extra))
    # the tampered pack: what the host serves is not what the feed signed
    hub.add_file(REPO, "tampered.tar.gz", _good_pack()[:-1] + b"\x01")
    entries.append(pack_entry("other-os", hub.resolve_url(REPO, "good.tar.gz"), packs["good"],
                              "plan9-mips"))
    installer = b"PK\x03\x04 a wheel's bytes " * 100
    hub.add_file(REPO, "bmoe-99.0.0.whl", installer)
    f = Feed(hub, key, key_file, packs, entries, installer)
    f.publish(f.document())
    yield f
    hub.close()


def feed_server(data: Path, feed: Feed, *args: str) -> ServerProcess:
    return start_server(data, "--feed-url", feed.url, "--feed-key-file", str(feed.key_file),
                        "--hf-ca-file", feed.hub.cert, *args, wait_ready=False)


@pytest.fixture(scope="module")
def server(feed: Feed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = feed_server(tmp_path_factory.mktemp("backends-data"), feed)
    status, _, body = srv.request("GET", "/api/backends?refresh=1")
    assert status == 200 and "feed_error" not in body, body
    yield srv
    srv.stop()


def install(srv: ServerProcess, pack_id: str, body: Any = None) -> tuple[int, Any]:
    status, _, answer = srv.request("POST", f"/api/backends/{pack_id}/install", body or {},
                                    timeout=120)
    return status, answer


def nothing_installed(data: Path, pack_id: str) -> None:
    backends = data / "backends"
    assert not (backends / pack_id).exists()
    left = [p.name for p in backends.iterdir() if p.name.startswith((".staging", ".old"))]
    assert left == []
    downloads = backends / ".downloads"
    assert not downloads.exists() or not [p for p in downloads.iterdir()
                                          if not p.name.endswith(".part")]


# -- a build without a key ---------------------------------------------------------------

def test_a_build_without_a_feed_key_answers_no_feed_key(tmp_path: Path, feed: Feed) -> None:
    srv = start_server(tmp_path, "--feed-url", feed.url, "--hf-ca-file", feed.hub.cert,
                       wait_ready=False)
    try:
        status, _, body = srv.request("GET", "/api/backends")
        assert status == 200
        assert "CPU" in body["registered"] and body["target"] == TARGET
        assert body["feed"] is None and body["packs"] == [] and body["installed"] == []
        assert body["restart_required"] is False
        for method, path in [("GET", "/api/backends?refresh=1"), ("GET", "/api/update"),
                             ("POST", "/api/backends/good/install"),
                             ("POST", "/api/update/download")]:
            status, _, body = srv.request(method, path, {} if method == "POST" else None)
            assert (status, body["code"]) == (503, "no_feed_key"), (path, body)
            assert "--feed-key-file" in body["error"]
    finally:
        srv.stop()


def test_the_feed_url_must_be_https(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
                           str(tmp_path), "--feed-url", "http://127.0.0.1:9/feed.json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--feed-url" in done.stderr and "https" in done.stderr


def test_a_feed_key_that_is_not_one_is_refused_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "key"
    bad.write_text("not a key")
    done = subprocess.run([sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
                           str(tmp_path), "--feed-key-file", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "feed key" in done.stderr
    assert "Traceback" not in done.stderr


# -- the feed ----------------------------------------------------------------------------

def test_the_feed_is_read_only_when_asked_and_lists_this_targets_packs(
        feed: Feed, tmp_path: Path) -> None:
    before = len([r for r in feed.hub.requests if "feed.json" in r["path"]])
    srv = feed_server(tmp_path, feed)
    try:
        status, _, body = srv.request("GET", "/api/backends")
        assert status == 200 and body["feed"] is None       # nothing read at start
        assert len([r for r in feed.hub.requests if "feed.json" in r["path"]]) == before
        status, answer = install(srv, "good")
        assert (status, answer["code"]) == (409, "no_feed")
        status, _, body = srv.request("GET", "/api/backends?refresh=1")
        assert status == 200 and "feed_error" not in body
        assert body["feed"] == {"version": "99.0.0", "published": "2026-11-30"}
        rows = {p["id"]: p for p in body["packs"]}
        assert "other-os" not in rows                       # another target's pack
        assert rows["good"] == {"id": "good", "title": "Pack good", "version": "1.0.0",
                                "size": len(feed.packs["good"]), "applies": True,
                                "installed": False, "installed_version": None,
                                "current": False}
        assert rows["needs-driver"]["applies"] is False      # its driver does not load here
        status, body = install(srv, "nope")
        assert (status, body["code"]) == (404, "not_found")
        status, body = install(srv, "other-os")
        assert (status, body["code"]) == (404, "not_found")
        status, _, body = srv.request("POST", "/api/backends/good/install", {"force": "yes"})
        assert (status, body["code"]) == (400, "invalid_request")
    finally:
        srv.stop()


def test_a_tampered_feed_is_a_feed_error_and_nothing_from_it_is_used(
        feed: Feed, tmp_path: Path) -> None:
    srv = feed_server(tmp_path, feed)
    good = feed.document()
    evil_entry = pack_entry("evil", feed.hub.resolve_url(REPO, "good.tar.gz"),
                            feed.packs["good"], TARGET)
    try:
        # changed after signing, before any good feed was read: none is known
        feed.publish(tamper(good, packs=[evil_entry], version="100.0.0"))
        status, _, body = srv.request("GET", "/api/backends?refresh=1")
        assert status == 200 and "does not verify" in body["feed_error"]
        assert body["feed"] is None and body["packs"] == []
        status, body = install(srv, "evil")
        assert (status, body["code"]) == (409, "no_feed")
        status, _, body = srv.request("GET", "/api/update")
        assert (status, body["code"]) == (502, "feed") and "does not verify" in body["error"]
        # a good one, then one signed by another key: the good one still answers
        feed.publish(good)
        assert srv.request("GET", "/api/backends?refresh=1")[2]["feed"]["version"] == "99.0.0"
        other, _ = new_key(tmp_path)
        feed.publish(sign(other, {"version": "100.0.0", "published": "x",
                                  "packs": [evil_entry]}))
        status, _, body = srv.request("GET", "/api/backends?refresh=1")
        assert status == 200 and "does not verify" in body["feed_error"]
        assert body["feed"]["version"] == "99.0.0"
        assert "evil" not in {p["id"] for p in body["packs"]}
        status, body = install(srv, "evil")
        assert (status, body["code"]) == (404, "not_found")
        # signed, but not a feed; and not JSON at all
        feed.publish(sign(feed.key, {"version": "not a version", "published": "x"}))
        body = srv.request("GET", "/api/backends?refresh=1")[2]
        assert "version" in body["feed_error"] and body["feed"]["version"] == "99.0.0"
        feed.publish(b"<html>captive portal</html>")
        body = srv.request("GET", "/api/backends?refresh=1")[2]
        assert "not JSON" in body["feed_error"] and "Traceback" not in body["feed_error"]
        # the kept feed is checked again on disk: a changed copy is not used after a restart
        kept = tmp_path / "backends" / ".feed.json"
        assert kept.read_bytes() == good
    finally:
        feed.publish(feed.document())
        srv.stop()
    kept.write_bytes(tamper(good, packs=[evil_entry]))
    srv = feed_server(tmp_path, feed)
    try:
        body = srv.request("GET", "/api/backends")[2]
        assert body["feed"] is None and body["packs"] == []
    finally:
        srv.stop()


# -- installing ------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_every_unsafe_archive_is_refused_with_nothing_installed(
        server: ServerProcess, case: str) -> None:
    pid = f"unsafe-{case}"
    status, body = install(server, pid)
    assert (status, body["code"]) == (502, "failed"), body
    assert UNSAFE[case][1] in body["error"], body["error"]
    assert "Traceback" not in body["error"]
    nothing_installed(server.data_dir, pid)
    assert not Path("/tmp/bmoe-pack-escape").exists()


def test_a_pack_whose_bytes_are_not_the_feeds_is_refused(server: ServerProcess) -> None:
    status, body = install(server, "tampered")
    assert (status, body["code"]) == (502, "failed")
    assert "SHA-256" in body["error"] and "feed" in body["error"]
    nothing_installed(server.data_dir, "tampered")
    assert not list((server.data_dir / "backends" / ".downloads").glob("tampered*"))


def test_a_pack_without_a_library_is_refused(server: ServerProcess) -> None:
    status, body = install(server, "no-library")
    assert (status, body["code"]) == (502, "failed") and "no backend library" in body["error"]
    nothing_installed(server.data_dir, "no-library")


def test_a_pack_that_does_not_apply_needs_force(server: ServerProcess) -> None:
    status, body = install(server, "needs-driver")
    assert (status, body["code"]) == (409, "not_applicable")
    assert "libbmoe-no-such-driver.so.9" in body["error"] and "force" in body["error"]
    nothing_installed(server.data_dir, "needs-driver")
    status, body = install(server, "needs-driver", {"force": True})
    assert status == 200 and body["ok"] is True


def test_install_writes_the_pack_and_says_a_restart_is_needed(
        server: ServerProcess, feed: Feed) -> None:
    events = Events(server)
    try:
        status, body = install(server, "good")
        assert status == 200
        assert body == {"ok": True, "id": "good", "restart_required": True}
        events.wait("backend", lambda e: e["id"] == "good" and e["stage"] == "done")
    finally:
        events.close()
    stages = [e["stage"] for e in events.of("backend", lambda e: e["id"] == "good")]
    assert stages[0] == "download" and stages[-1] == "done"
    assert "check" in stages and "unpack" in stages and "error" not in stages
    folder = server.data_dir / "backends" / "good"
    meta = json.loads((folder / "pack.json").read_text())
    assert meta["id"] == "good" and meta["version"] == "1.0.0"
    assert meta["sha256"] == hashlib.sha256(feed.packs["good"]).hexdigest()
    assert (folder / "libggml-test.so").read_bytes() == LIB
    assert (folder / "lib" / "readme-link").resolve() == (folder / "README").resolve()
    body = server.request("GET", "/api/backends")[2]
    assert body["restart_required"] is True
    row = next(p for p in body["packs"] if p["id"] == "good")
    assert row["installed"] and row["current"] and row["installed_version"] == "1.0.0"
    assert {"id": "good", "version": "1.0.0", "offered": True} in body["installed"]
    # installing again replaces it whole
    assert install(server, "good")[0] == 200
    assert (folder / "pack.json").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith((".old", ".staging"))]


def test_one_install_at_a_time(server: ServerProcess, feed: Feed) -> None:
    feed.hub.fault(REPO, "good.tar.gz", rate=len(feed.packs["good"]) // 2)
    try:
        results: list[tuple[int, Any]] = []
        first = threading.Thread(target=lambda: results.append(install(server, "good")))
        first.start()
        events = Events(server)
        try:
            events.wait("backend", lambda e: e["id"] == "good" and e["stage"] == "download")
            status, body = install(server, "good")
            assert (status, body.get("code")) == (409, "busy"), (status, body)
        finally:
            events.close()
        first.join(60)
        assert results and results[0][0] == 200
    finally:
        feed.hub.faults.clear()


def test_a_pack_that_does_not_load_is_reported_at_the_next_start(
        feed: Feed, tmp_path: Path) -> None:
    srv = feed_server(tmp_path, feed)
    try:
        srv.request("GET", "/api/backends?refresh=1")
        assert install(srv, "good")[0] == 200
    finally:
        srv.stop()
    srv = feed_server(tmp_path, feed)      # starts: the broken library is not fatal
    try:
        body = srv.request("GET", "/api/backends")[2]
        assert body["restart_required"] is False
        assert body["feed"]["version"] == "99.0.0"          # the kept feed, checked again
        [load] = body["load"]
        assert load["id"] == "good" and load["library"] == "libggml-test.so"
        assert load["loaded"] is False and "ggml did not load it" in load["error"]
        assert "CPU" in body["registered"]
    finally:
        srv.stop()


# -- updates ---------------------------------------------------------------------------

def test_update_reads_the_feed_and_downloads_the_checked_installer(
        server: ServerProcess, feed: Feed) -> None:
    status, _, body = server.request("GET", "/api/update")
    assert status == 200
    assert body["current"] == __version__ and body["latest"] == "99.0.0"
    assert body["available"] is True and body["notes"] == "Faster and safer."
    assert body["target"] == TARGET and body["published"] == "2026-11-30"
    assert body["installer"]["size"] == len(feed.installer)
    events = Events(server)
    try:
        status, _, body = server.request("POST", "/api/update/download", {}, timeout=120)
        events.wait("update", lambda e: e["stage"] == "done")
    finally:
        events.close()
    assert status == 200 and body["ok"] is True and body["version"] == "99.0.0"
    path = Path(body["path"])
    assert path.parent == server.data_dir / "updates"
    assert path.read_bytes() == feed.installer


def test_update_refusals(server: ServerProcess, feed: Feed) -> None:
    try:
        # the installer the host serves is not the feed's
        feed.hub.add_file(REPO, "bmoe-99.0.0.whl", feed.installer + b"!")
        doc = feed.document()
        env = json.loads(doc)
        inner = json.loads(env["feed"])
        inner["installers"][f"wheel-{TARGET}"]["file"] = "other.whl"
        inner["installers"][f"wheel-{TARGET}"]["size"] = len(feed.installer) + 1
        feed.publish(sign(feed.key, inner))
        assert server.request("GET", "/api/update")[0] == 200
        status, _, body = server.request("POST", "/api/update/download", {}, timeout=120)
        assert (status, body["code"]) == (502, "failed") and "SHA-256" in body["error"]
        assert not (server.data_dir / "updates" / "other.whl").exists()
        # no installer for this server
        feed.publish(feed.document(installers={}))
        assert server.request("GET", "/api/update")[2]["installer"] is None
        status, _, body = server.request("POST", "/api/update/download", {})
        assert (status, body["code"]) == (409, "no_installer")
    finally:
        feed.hub.add_file(REPO, "bmoe-99.0.0.whl", feed.installer)
        feed.publish(feed.document())
        server.request("GET", "/api/backends?refresh=1")


def test_an_older_feed_is_not_used_and_this_release_is_up_to_date(
        feed: Feed, tmp_path: Path) -> None:
    srv = feed_server(tmp_path, feed)
    try:
        feed.publish(feed.document(version=__version__))
        body = srv.request("GET", "/api/update")[2]
        assert body["available"] is False and body["latest"] == __version__
        status, _, body = srv.request("POST", "/api/update/download", {})
        assert (status, body["code"]) == (409, "up_to_date")
        feed.publish(feed.document(version="0.0.1"))      # signed, but older: a replay
        status, _, body = srv.request("GET", "/api/update")
        assert (status, body["code"]) == (502, "feed") and "older" in body["error"]
        body = srv.request("GET", "/api/backends?refresh=1")[2]
        assert "older" in body["feed_error"] and body["feed"]["version"] == __version__
    finally:
        feed.publish(feed.document())
        srv.stop()


# -- a real pack -----------------------------------------------------------------------

def test_a_real_cpu_backend_pack_registers_after_a_restart(
        feed: Feed, tmp_path: Path, tiny_moe: Path) -> None:
    """ggml's CPU backend built as a loadable module for AVX (no AVX2) from the engine's
    own sdist, installed as a pack: after a restart ggml registers one more CPU backend,
    and the model still loads and answers."""
    library = cpu_backend_library()
    data = tar_pack([member("libggml-cpu.so", data=library.read_bytes(), mode=0o755)])
    feed.hub.add_file(REPO, "cpu-avx.tar.gz", data)
    entry = pack_entry("cpu-avx", feed.hub.resolve_url(REPO, "cpu-avx.tar.gz"), data, TARGET,
                       title="CPU (AVX)", libraries=["libggml-cpu.so"])
    feed.publish(feed.document(packs=[entry]))
    try:
        srv = feed_server(tmp_path, feed)
        try:
            before = srv.request("GET", "/api/backends?refresh=1")[2]
            assert before["load"] == []
            status, body = install(srv, "cpu-avx")
            assert status == 200, body
        finally:
            srv.stop()
        srv = feed_server(tmp_path, feed, "-m", str(tiny_moe), "-c", "512")
        try:
            body = srv.request("GET", "/api/backends")[2]
            assert body["load"] == [{"id": "cpu-avx", "library": "libggml-cpu.so",
                                     "loaded": True, "backend": "CPU", "error": ""}]
            assert len(body["registered"]) == len(before["registered"]) + 1
            assert body["registered"].count("CPU") == before["registered"].count("CPU") + 1
            assert srv.wait_state("ready", "error")["state"] == "ready"
            status, _, answer = srv.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert status == 200 and answer["choices"][0]["message"] is not None
        finally:
            srv.stop()
    finally:
        feed.publish(feed.document())


# -- the Settings screen -----------------------------------------------------------------

def test_the_settings_screen_lists_the_packs_and_installs_one(
        feed: Feed, tmp_path: Path) -> None:
    """The page itself (headless Chromium, as tests/test_ui_browser.py runs it): what ggml
    registered, the feed's packs once the person asks, an install with its progress, and
    the restart it needs."""
    import os
    if os.environ.get("CI"):
        import playwright.sync_api as sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
        if not Path("/usr/bin/chromium").exists():
            pytest.skip("needs Debian's chromium package (apt-get install chromium)")
    srv = feed_server(tmp_path, feed)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(srv.url + "/#settings")
                registered = page.locator("#backends-registered")
                registered.wait_for(timeout=30_000)
                assert "CPU" in registered.inner_text() and TARGET in registered.inner_text()
                assert page.locator("#backend-packs").count() == 0     # not read until asked
                page.click("#backends-check")
                row = page.locator('#backend-packs [data-id="good"]')
                row.wait_for(timeout=30_000)
                assert "Pack good" in row.inner_text()
                driver = page.locator('#backend-packs [data-id="needs-driver"]')
                assert "does not apply" in driver.inner_text()
                assert driver.locator("button").inner_text() == "Install anyway"
                row.locator("button").click()
                page.locator("#backends-restart").wait_for(timeout=60_000)
                row = page.locator('#backend-packs [data-id="good"]')
                assert "Installed" in row.locator(".backend-progress").inner_text()
                assert row.locator("button").inner_text() == "Install again"
                # a refusal is shown in the server's words
                page.locator('#backend-packs [data-id="tampered"] button').click()
                # a locator's own wait, not wait_for_function: that evaluates a string in
                # the page, which the page's CSP (no 'unsafe-eval') refuses
                sync_api.expect(page.locator(
                    '#backend-packs [data-id="tampered"] .backend-progress')).to_contain_text(
                        "SHA-256", timeout=60_000)
                assert errors == []
            finally:
                browser.close()
        assert (tmp_path / "backends" / "good" / "pack.json").is_file()
        assert not (tmp_path / "backends" / "tampered").exists()
    finally:
        srv.stop()
