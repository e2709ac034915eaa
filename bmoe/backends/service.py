"""What the backend-pack and update routes answer from: the feed last read (kept in
``<data>/backends/.feed.json`` and checked again whenever it is used), the packs installed,
what ggml registered and loaded at start, and the one download of each kind under way.

The feed is read from the network only when a person asks (``GET /api/backends?refresh=1``,
``GET /api/update``). A build without a feed key (``feed.FEED_PUBLIC_KEY``) answers ``503
no_feed_key`` wherever it would need the feed. A feed that cannot be read or does not
verify replaces nothing: the feed kept before still answers. Nor does a signed feed of an
older release than the kept one's (an old feed replayed to offer what was since replaced).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .. import __version__, atomicfile
from ..models.catalog import CatalogFile
from ..models.curl import CurlConfig, CurlError, get_bytes
from . import feed as feedmod
from . import packs, registry
from .errors import BackendsError, FeedError
from .feed import Feed

FEED_FILE = ".feed.json"


def _no_key() -> BackendsError:
    return BackendsError(503, "no_feed_key", "This build carries no key to check the release "
                         "feed with, so it cannot read packs or updates from one. A release "
                         "build has one; to test, start the server with --feed-key-file and "
                         "--feed-url.")


@dataclass
class BackendsService:
    data_dir: Path
    publish: Callable[[str, dict[str, Any]], None]
    curl: CurlConfig
    key: Ed25519PublicKey | None
    url: str
    registered: list[str] | None = None   # what ggml registered at start (None: not asked yet)
    loads: list[registry.LoadResult] = field(default_factory=list)
    restart_required: bool = False
    _document: bytes | None = None
    _pack_busy: bool = False
    _update_busy: bool = False
    _applies: dict[tuple[str, ...], bool] = field(default_factory=dict)

    @property
    def backends_dir(self) -> Path:
        return self.data_dir / "backends"

    @property
    def updates_dir(self) -> Path:
        return self.data_dir / "updates"

    # -- the feed ------------------------------------------------------------------------

    def _need_key(self) -> Ed25519PublicKey:
        if self.key is None or not self.url:
            raise _no_key()
        return self.key

    async def read_feed(self) -> Feed:
        """Read the feed from the network, check it and keep it; FeedError saying why not."""
        key = self._need_key()
        try:
            status, body = await get_bytes(self.curl, self.url, limit=feedmod.FEED_LIMIT)
        except CurlError as e:
            raise FeedError(f"The feed could not be read: {e.message}.") from None
        if status != 200:
            raise FeedError(f"The feed could not be read: its host answered HTTP {status}.")
        feed, document = feedmod.verify(body, key)
        kept = self.kept_feed()
        if kept is not None and feedmod.newer(kept.version, feed.version):
            raise FeedError(f"The feed says release {feed.version}, older than the "
                            f"{kept.version} of the feed read before: an old feed sent again "
                            "is not used.")
        await trio.to_thread.run_sync(atomicfile.write_bytes,
                                      self.backends_dir / FEED_FILE, document)
        self._document = document
        self._applies.clear()       # a person who asks again may have added a driver
        return feed

    def kept_feed(self) -> Feed | None:
        """The feed last read, checked again (from disk after a restart); None when there
        is none, or no key, or it no longer verifies."""
        if self.key is None:
            return None
        if self._document is None:
            try:
                self._document = (self.backends_dir / FEED_FILE).read_bytes()
            except OSError:
                return None
        try:
            return feedmod.verify(self._document, self.key)[0]
        except FeedError:
            self._document = None
            return None

    # -- GET /api/backends -----------------------------------------------------------------

    async def applies(self, drivers: list[str]) -> bool:
        key = tuple(drivers)
        if key not in self._applies:
            self._applies[key] = await trio.to_thread.run_sync(registry.applies, drivers)
        return self._applies[key]

    async def listing(self, refresh: bool) -> dict[str, Any]:
        feed_error = None
        if refresh:
            try:
                await self.read_feed()
            except FeedError as e:
                feed_error = e.message
        feed = self.kept_feed()
        target = feedmod.target()
        installed = {meta["id"]: meta for _, meta in
                     registry.installed_packs(self.backends_dir)}
        offered = feed.packs_for(target) if feed is not None else []
        pack_rows = []
        for p in offered:
            have = installed.get(p.id)
            pack_rows.append({
                "id": p.id, "title": p.title, "size": p.size, "version": p.version,
                "applies": await self.applies(list(p.drivers)),
                "installed": have is not None,
                "installed_version": have.get("version") if have else None,
                "current": bool(have and have.get("sha256") == p.sha256)})
        offered_ids = {p.id for p in offered}
        if self.registered is None:      # asked of a child once (registry.registered_at_start)
            self.registered = await trio.to_thread.run_sync(
                registry.registered_at_start, any(r.loaded for r in self.loads))
        out: dict[str, Any] = {
            "registered": list(self.registered), "target": target,
            "feed": {"version": feed.version, "published": feed.published}
            if feed is not None else None,
            "packs": pack_rows,
            "installed": [{"id": i, "version": m.get("version"), "offered": i in offered_ids}
                          for i, m in installed.items()],
            "restart_required": self.restart_required,
            "load": [r.to_json() for r in self.loads]}
        if feed_error is not None:
            out["feed_error"] = feed_error
        return out

    # -- POST /api/backends/<id>/install -----------------------------------------------------

    async def install(self, pack_id: str, force: bool) -> dict[str, Any]:
        self._need_key()
        feed = self.kept_feed()
        if feed is None:
            raise BackendsError(409, "no_feed", "No feed has been read yet: list the packs "
                                "with refresh first (GET /api/backends?refresh=1).")
        pack = feed.pack(feedmod.target(), pack_id)
        if pack is None:
            raise BackendsError(404, "not_found", f"The feed offers no pack {pack_id!r} for "
                                f"{feedmod.target()}.")
        if self._pack_busy:
            raise BackendsError(409, "busy", "Another pack is being installed: wait for it "
                                "to finish.")
        self._pack_busy = True
        try:
            if not force and not await self.applies(list(pack.drivers)):
                raise BackendsError(409, "not_applicable", f"The pack {pack.id} needs "
                                    f"{' or '.join(pack.drivers)}, which does not load on this "
                                    "machine; send {\"force\": true} to install it anyway.")
            await packs.install(pack, self.backends_dir, self.curl,
                                lambda ev: self.publish("backend", ev))
        finally:
            self._pack_busy = False
        self.restart_required = True
        return {"ok": True, "id": pack.id, "restart_required": True}

    # -- updates --------------------------------------------------------------------------

    def installer_key(self) -> str:
        """The feed's installer for this server: a pip install's is the release's wheel
        for this target (``wheel-linux-x64``)."""
        return f"wheel-{feedmod.target()}"

    async def update(self) -> dict[str, Any]:
        try:
            feed = await self.read_feed()
        except FeedError as e:
            raise BackendsError(502, "feed", e.message) from None
        installer = feed.installers.get(self.installer_key())
        return {"current": __version__, "latest": feed.version,
                "available": feedmod.newer(feed.version, __version__),
                "notes": feed.notes, "published": feed.published, "target": feedmod.target(),
                "installer": installer.model_dump() if installer is not None else None}

    async def download_update(self) -> dict[str, Any]:
        self._need_key()
        feed = self.kept_feed()
        if feed is None:
            raise BackendsError(409, "no_feed", "No feed has been read yet: check for an "
                                "update first (GET /api/update).")
        if not feedmod.newer(feed.version, __version__):
            raise BackendsError(409, "up_to_date", f"This server ({__version__}) is the feed's "
                                f"release ({feed.version}) or newer.")
        installer = feed.installers.get(self.installer_key())
        if installer is None:
            raise BackendsError(409, "no_installer", f"The feed carries no installer for this "
                                f"server ({self.installer_key()}); its notes say where the "
                                "release is.")
        if self._update_busy:
            raise BackendsError(409, "busy", "The installer is already being downloaded.")
        self._update_busy = True
        version = feed.version

        def progress(ev: dict[str, Any]) -> None:
            if ev.get("state") == "running":
                self.publish("update", {"version": version, "stage": "download",
                                        "received": ev.get("received", 0),
                                        "total": installer.size, "rate": ev.get("rate", 0),
                                        "error": ev.get("error", "")})
        try:
            self.publish("update", {"version": version, "stage": "download", "received": 0,
                                    "total": installer.size, "error": ""})
            file = CatalogFile(installer.file, installer.size, installer.url, installer.sha256)
            try:
                path = await packs.fetch(file, self.updates_dir, self.curl, progress,
                                         "installer")
            except BackendsError as e:
                self.publish("update", {"version": version, "stage": "error", "received": 0,
                                        "total": installer.size, "error": e.message})
                raise
        finally:
            self._update_busy = False
        self.publish("update", {"version": version, "stage": "done",
                                "received": installer.size, "total": installer.size,
                                "error": ""})
        return {"ok": True, "version": version, "path": str(path)}
