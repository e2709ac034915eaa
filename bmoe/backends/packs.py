"""Installing a backend pack, and fetching one checked file (a pack, an installer).

``fetch`` downloads through the models' downloader (``bmoe/models/download.py``: curl
into ``NAME.part``, resumed from its size, the size and the SHA-256 checked before the
part is renamed), so a pack or an installer that stopped half-way continues from where
it stopped. A file already there is used only when its size and SHA-256 are the feed's.

``install`` then lists the archive (``archive.py``) and refuses an unsafe entry, unpacks
into ``<data>/backends/.staging-<id>-<random>/``, checks the tree again, writes
``pack.json`` there and renames the folder to ``<data>/backends/<id>/`` (an earlier copy
is renamed aside first and removed after). Whatever fails, nothing is left installed
but what was there before: the staging folder and the archive are removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .. import atomicfile
from ..models.catalog import CatalogFile, Entry
from ..models.curl import CurlConfig
from ..models.download import Job, disk_free, sha256_of, size_of
from . import archive, registry
from .errors import BackendsError
from .feed import Pack

GB = 1e9


def _failed(reason: str) -> BackendsError:
    return BackendsError(502, "failed", reason)


async def fetch(file: CatalogFile, folder: Path, curl: CurlConfig,
                publish: Callable[[dict[str, Any]], None], what: str) -> Path:
    """``file`` downloaded whole into ``folder`` (its size and SHA-256 checked); 502
    ``failed`` with the reason otherwise. ``publish`` gets the downloader's progress."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / file.name
    if target.exists():
        same = size_of(target) == file.bytes and await trio.to_thread.run_sync(
            sha256_of, target) == file.sha256
        if same:
            return target
        target.unlink()
    need = file.bytes - size_of(folder / (file.name + ".part"))
    if need > disk_free(folder):
        raise _failed(f"The {what} needs {need / GB:.2f} GB more and the disk has "
                      f"{disk_free(folder) / GB:.2f} GB free.")
    job = Job(Entry(id=file.name, title=file.name, files=[file]), folder, "", publish, curl)
    await job.run()
    if job.state != "done" or not target.is_file():
        reason = job.error.replace("the catalog's", "the feed's").replace(
            "the catalog says", "the feed says") or "it did not arrive"
        raise _failed(f"The {what} could not be downloaded: {reason}.")
    return target


def _installed_meta(pack: Pack) -> dict[str, Any]:
    return {"id": pack.id, "version": pack.version, "title": pack.title,
            "target": pack.target, "sha256": pack.sha256, "size": pack.size, "url": pack.url,
            "libraries": list(pack.libraries), "installed_at": int(time.time())}


async def install(pack: Pack, backends_dir: Path, curl: CurlConfig,
                  publish: Callable[[dict[str, Any]], None]) -> Path:
    """Download, check, unpack and move ``pack`` into ``backends_dir/<id>/``; its folder.
    ``publish`` gets ``backend`` events; BackendsError 502 ``failed`` when anything fails
    (nothing is installed then)."""
    def event(stage: str, **kw: Any) -> None:
        publish({"id": pack.id, "stage": stage, "received": kw.get("received", 0),
                 "total": pack.size, "error": kw.get("error", "")})

    def progress(ev: dict[str, Any]) -> None:
        if ev.get("state") == "running":
            publish({"id": pack.id, "stage": "download", "received": ev.get("received", 0),
                     "total": pack.size, "rate": ev.get("rate", 0), "eta_s": ev.get("eta_s"),
                     "error": ev.get("error", "")})

    downloads = backends_dir / ".downloads"
    file = CatalogFile(f"{pack.id}-{pack.version}.pack", pack.size, pack.url, pack.sha256)
    event("download")
    try:
        path = await fetch(file, downloads, curl, progress, "pack")
    except BackendsError as e:
        event("error", error=e.message)
        raise
    staging = backends_dir / f".staging-{pack.id}-{secrets.token_hex(4)}"
    try:
        event("check", received=pack.size)
        try:
            entries = await archive.list_entries(path)
            archive.check_entries(entries)
            staging.mkdir(parents=True)
            event("unpack", received=pack.size)
            await archive.unpack(path, staging)
            await trio.to_thread.run_sync(archive.check_tree, staging)
        except archive.UnsafeArchive as e:
            raise _failed(e.message) from None
        _check_libraries(pack, staging)
        atomicfile.write_text(staging / registry.PACK_FILE,
                              json.dumps(_installed_meta(pack), indent=2) + "\n")
        dest = _move_into_place(staging, backends_dir / pack.id)
    except BackendsError as e:
        event("error", error=e.message)
        raise
    except OSError as e:
        reason = f"The pack could not be written ({e.strerror or 'a file operation failed'})."
        event("error", error=reason)
        raise _failed(reason) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        path.unlink(missing_ok=True)
    event("done", received=pack.size)
    return dest


def _check_libraries(pack: Pack, staging: Path) -> None:
    libraries = registry.pack_libraries(staging, list(pack.libraries))
    if not libraries:
        raise _failed("The pack holds no backend library (a libggml-*.so at its top).")
    for lib in libraries:
        if lib.is_symlink() or not lib.is_file():
            rel = os.path.relpath(lib, staging)
            raise _failed(f"The pack's library {rel}, which its feed entry names, is not a "
                          "file in the pack.")


def _move_into_place(staging: Path, dest: Path) -> Path:
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".old-{dest.name}-{secrets.token_hex(4)}")
        os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except OSError:
        if old is not None:
            os.rename(old, dest)
        raise
    atomicfile.fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest
