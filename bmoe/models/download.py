"""Downloads: one job per catalog entry, each file through curl into ``NAME.part``.

Theory of operation
-------------------
``Downloads.start`` checks the disk (``507`` before a byte moves) and starts a ``Job`` in
the service's own nursery, so a job outlives the request that started it and the client
that sent it. A job fetches its entry's files in order. For each one: a complete file is
counted and skipped; otherwise curl continues ``NAME.part`` from its size (``-C -``),
and, once curl is done, the part is checked against the catalog's SHA-256 (when there is
one) and renamed to ``NAME``. A watcher polls the part's size twice a second and
publishes a ``download`` event with the entry's bytes, the rate and the time left.

The retry policy is curl.py's (``retry_wait``, ``should_retry``), the one the header reads
of ``hf.py`` follow too: a failed line (curl's exit 6, 7, 16, 18, 28, 35, 52, 55, 56, 92)
is retried from the part, up to ``MAX_ATTEMPTS`` per file, waiting 2 s, 4 s, ... at most
60 s, the event staying ``running`` with the failure in ``error``. A host that will not
resume (exit 33) has the part discarded and the file fetched again from its start, as
one more attempt. Anything else ends the job in ``error`` with the part kept; a digest
that differs deletes the part, since resuming it could only give the same bytes again.
A cancel kills curl and keeps the part.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from .catalog import CatalogFile, Entry
from .curl import (MAX_ATTEMPTS, RANGE_REFUSED_EXIT, CurlConfig, CurlError, child_setup,
                   download_args, exit_words, retry_wait, should_retry, token_file)

log = logging.getLogger("bmoe.models")

PROGRESS_EVERY_S = 0.5
HASH_CHUNK = 4 << 20
GB = 1e9


def part_of(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def on_disk(entry: Entry, folder: Path) -> tuple[int, bool, bool]:
    """(bytes of the entry in ``folder``, complete files and parts; every file whole;
    a part present)."""
    received, whole, partial = 0, True, False
    for f in entry.files:
        target = folder / f.name
        if target.is_file():
            received += size_of(target)
            continue
        whole = False
        part = part_of(target)
        if part.is_file():
            partial = True
            received += size_of(part)
    return received, whole, partial


def disk_free(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def sha256_of(path: Path, cancelled: Callable[[], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            if cancelled is not None:
                cancelled()
    return h.hexdigest()


class JobFailed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class Job:
    entry: Entry
    folder: Path
    token: str
    publish: Callable[[dict[str, Any]], None]
    curl: CurlConfig
    state: str = "running"
    file: str = ""
    error: str = ""
    received: int = 0
    done_bytes: int = 0
    rate: float = 0.0
    attempts: dict[str, int] = field(default_factory=dict)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    finished: trio.Event = field(default_factory=trio.Event)

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def total(self) -> int:
        return self.entry.bytes

    def targets(self) -> list[Path]:
        return [self.folder / f.name for f in self.entry.files]

    def event(self) -> dict[str, Any]:
        left = self.total - self.received
        eta = round(left / self.rate, 1) if self.rate > 0 and self.total and left > 0 else None
        return {"id": self.id, "file": self.file, "received": self.received,
                "total": self.total, "state": self.state, "error": self.error,
                "rate": round(self.rate), "eta_s": eta}

    def emit(self) -> None:
        self.publish(self.event())

    async def run(self) -> None:
        try:
            with self.scope:
                await self._run()
            if self.scope.cancelled_caught:
                self.state, self.error = "cancelled", ""
        except JobFailed as e:
            self.state, self.error = "error", e.message
        except CurlError as e:
            self.state, self.error = "error", e.message
        except OSError as e:
            self.state, self.error = "error", f"the file could not be written ({e.strerror})"
        except Exception:  # noqa: BLE001 - one download's fault must not stop the server
            log.exception("download %s failed", self.id)
            self.state, self.error = "error", "the download failed: the server's log says why"
        finally:
            self.received = on_disk(self.entry, self.folder)[0]
            self.rate = 0.0
            self.finished.set()
            self.emit()

    async def _run(self) -> None:
        self.file = self.entry.files[0].name
        self.emit()
        for f in self.entry.files:
            self.file = f.name
            target = self.folder / f.name
            if not target.is_file():
                await self._fetch(f, target)
            self.done_bytes += size_of(target)
        self.received = self.done_bytes
        self.state, self.error = "done", ""

    async def _fetch(self, f: CatalogFile, target: Path) -> None:
        part = part_of(target)
        attempt = 0
        while True:
            attempt += 1
            self.attempts[f.name] = attempt
            if f.bytes and size_of(part) > f.bytes:
                part.unlink()
            if f.bytes and size_of(part) == f.bytes:
                break
            code, status = await self._curl(f, part)
            if code == 0 or (code == 22 and status == 416 and size_of(part) > 0):
                break
            words = exit_words(code, status)
            if code == RANGE_REFUSED_EXIT and attempt < MAX_ATTEMPTS:
                part.unlink(missing_ok=True)
                self.received = self.done_bytes
                self.error = f"{words}: starting {f.name} again from its first byte"
                self.emit()
                continue
            if not should_retry(code, attempt):
                raise JobFailed(f"{f.name}: {words}" + (
                    f" (after {attempt} attempts)" if attempt > 1 else ""))
            wait = retry_wait(attempt)
            self.received = self.done_bytes + size_of(part)
            self.error = f"{words}; trying again in {wait:.0f} s (attempt {attempt + 1} of " \
                         f"{MAX_ATTEMPTS})"
            self.rate = 0.0
            self.emit()
            await trio.sleep(wait)
        if f.bytes and size_of(part) != f.bytes:
            raise JobFailed(f"{f.name}: the host sent {size_of(part)} bytes where the catalog "
                            f"says {f.bytes}; the partial file is kept")
        if f.sha256:
            self.received = self.done_bytes + size_of(part)
            self.error = f"checking the SHA-256 of {f.name}"
            self.emit()
            digest = await trio.to_thread.run_sync(
                sha256_of, part, trio.from_thread.check_cancelled, abandon_on_cancel=False)
            if digest != f.sha256:
                part.unlink(missing_ok=True)
                raise JobFailed(f"{f.name}: its SHA-256 does not match the catalog's, so the "
                                "download was deleted; download it again")
            self.error = ""
        os.replace(part, target)

    async def _curl(self, f: CatalogFile, part: Path) -> tuple[int, int]:
        with token_file(self.token) as auth:
            args = download_args(self.curl, f.url, part, auth)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, part)
                result = await trio.run_process(args, check=False, capture_stdout=True,
                                                stderr=subprocess.DEVNULL,
                                                stdin=subprocess.DEVNULL,
                                                preexec_fn=child_setup())
                nursery.cancel_scope.cancel()
        out = result.stdout.decode("latin-1").strip()
        return result.returncode, int(out) if out.isdigit() else 0

    async def _watch(self, part: Path) -> None:
        last_bytes, last_t = size_of(part), time.monotonic()
        while True:
            await trio.sleep(PROGRESS_EVERY_S)
            now_bytes, now_t = size_of(part), time.monotonic()
            inst = max(0, now_bytes - last_bytes) / max(1e-6, now_t - last_t)
            self.rate = inst if self.rate == 0 else 0.7 * self.rate + 0.3 * inst
            last_bytes, last_t = now_bytes, now_t
            self.received = self.done_bytes + now_bytes
            if now_bytes and self.error and not self.error.startswith("checking"):
                self.error = ""
            self.emit()


class Downloads:
    """The running jobs, one per entry; jobs run in ``nursery`` (the service's)."""

    def __init__(self, publish: Callable[[dict[str, Any]], None], curl: CurlConfig) -> None:
        self.publish = publish
        self.curl = curl
        self.jobs: dict[str, Job] = {}
        self.nursery: trio.Nursery | None = None

    def running(self, eid: str | None = None) -> bool:
        jobs = [self.jobs[eid]] if eid in self.jobs else ([] if eid else list(self.jobs.values()))
        return any(not j.finished.is_set() for j in jobs)

    def writing(self, paths: list[Path]) -> bool:
        """Whether a running job writes one of ``paths`` (or its part)."""
        wanted = {os.path.realpath(p) for p in paths}
        wanted |= {os.path.realpath(part_of(Path(p))) for p in paths}
        for job in self.jobs.values():
            if job.finished.is_set():
                continue
            for t in job.targets():
                if os.path.realpath(t) in wanted or os.path.realpath(part_of(t)) in wanted:
                    return True
        return False

    def check_disk(self, entry: Entry, folder: Path) -> str:
        """The 507 sentence when the disk cannot take the rest of ``entry`` ("" if it can)."""
        received = on_disk(entry, folder)[0]
        need = max(0, entry.bytes - received)
        free = disk_free(folder)
        if need > free:
            return f"needs {need / GB:.1f} GB more, only {free / GB:.1f} GB free"
        return ""

    def start(self, entry: Entry, folder: Path, token: str) -> Job:
        assert self.nursery is not None, "the models service is not running"
        job = Job(entry, folder, token, self.publish, self.curl)
        job.received = on_disk(entry, folder)[0]
        self.jobs[entry.id] = job
        self.nursery.start_soon(job.run)
        return job

    def cancel(self, eid: str) -> bool:
        job = self.jobs.get(eid)
        if job is None or job.finished.is_set():
            return False
        job.scope.cancel()
        return True
