"""The models service: folders, listing, catalog, downloads and the site, as routes use them.

One object per server, created at start (``ModelsService.create``) and run in the server's
nursery (``run``), where the download jobs live, so a download outlives the request and
the client that started it. What it needs of the server is small and passed in: the
options whose ``models_dir`` / ``scan_dirs`` it keeps current (confinement reads the
same fields), the config store (``model_folders`` and the saved ``model``), the event
bus, and a way to ask which files the session holds.

Every refusal is a ``ModelsError`` carrying its status, code and sentence.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import trio

from .catalog import (AddedEntries, CatalogFile, Entry, is_bare_name, is_safe_name,
                      load_shipped, quant_of, url_problem)
from .curl import CurlConfig, CurlError, NoCurl, check_token, head_size
from .download import Downloads, disk_free, on_disk, part_of, size_of
from .errors import ModelsError
from .hf import DEFAULT_ENDPOINT, HfSite, RepoModel, parse_repo_text, valid_repo, valid_revision
from .listing import ProbeCache, companions, group, scan, scan_dir
from .probe import shard_name, split_parts
from .verdict import machine_now, verdict

log = logging.getLogger("bmoe.models")

URL_SIZE_DEADLINE_S = 120.0     # kUrlSizeDeadline: every shard's HEAD, in all
MAX_URL_SHARDS = 128            # kMaxUrlShards


def bad(message: str, code: str = "invalid_request") -> ModelsError:
    return ModelsError(400, code, message)


@dataclass
class Folders:
    default_models_dir: Path
    launch_models_dir: Path | None
    launch_scan_dirs: list[Path]
    chosen_models_dir: str = ""
    chosen_scan_dirs: list[str] = field(default_factory=list)

    def models_dir(self) -> Path:
        if self.launch_models_dir is not None:
            return self.launch_models_dir
        if self.chosen_models_dir and Path(self.chosen_models_dir).is_dir():
            return Path(self.chosen_models_dir)
        return self.default_models_dir

    def scan_dirs(self) -> list[Path]:
        chosen = [Path(d) for d in self.chosen_scan_dirs if Path(d).is_dir()]
        out: list[Path] = []
        for d in [*self.launch_scan_dirs, *chosen]:
            if d not in out:
                out.append(d)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"default_models_dir": str(self.default_models_dir),
                "chosen_models_dir": self.chosen_models_dir,
                "models_dir_at_launch": self.launch_models_dir is not None,
                "launch_scan_dirs": [str(d) for d in self.launch_scan_dirs],
                "chosen_scan_dirs": list(self.chosen_scan_dirs)}


class ModelsService:
    def __init__(self, *, options: Any, config: Any, bus: Any, folders: Folders,
                 endpoint: str, curl: CurlConfig,
                 held_paths: Callable[[], list[str]],
                 held_bytes: Callable[[], int] = lambda: 0) -> None:
        self.options = options
        self.config = config
        self.bus = bus
        self.folders = folders
        self.curl = curl
        self.site = HfSite(endpoint, curl)
        self.held_paths = held_paths
        self.held_bytes = held_bytes      # what the loaded model holds (the planner's figure)
        http_origin = curl.http_origin
        self.shipped = load_shipped(http_origin=http_origin)
        self.added = AddedEntries(options.data_dir, http_origin)
        self.probes = ProbeCache()
        self.downloads = Downloads(lambda ev: bus.publish("download", ev), curl)
        self.apply_folders()

    # -- start --------------------------------------------------------------------------

    @classmethod
    def create(cls, options: Any, config: Any, bus: Any, *, models_dir_at_launch: bool,
               endpoint: str = DEFAULT_ENDPOINT, ca_file: str = "", stall_s: int = 30,
               held_paths: Callable[[], list[str]] = list,
               held_bytes: Callable[[], int] = lambda: 0) -> ModelsService:
        saved = config.extra("model_folders") if config is not None else None
        saved = saved if isinstance(saved, dict) else {}
        default = Path(options.data_dir) / "models"
        folders = Folders(default, Path(options.models_dir) if models_dir_at_launch else None,
                          list(options.scan_dirs))
        chosen = saved.get("models_dir")
        if isinstance(chosen, str) and chosen:
            folders.chosen_models_dir = chosen
            if not Path(chosen).is_dir() and not models_dir_at_launch:
                bus.log("warn", f"the chosen models folder {chosen} is not there; using "
                        f"{default} for this run")
        scans = saved.get("scan_dirs")
        if isinstance(scans, list):
            folders.chosen_scan_dirs = [s for s in scans if isinstance(s, str) and s]
            for s in folders.chosen_scan_dirs:
                if not Path(s).is_dir():
                    bus.log("warn", f"the chosen scan folder {s} is not there; it is set aside "
                            "for this run")
        http_origin = endpoint.rstrip("/") if endpoint.startswith("http://") else ""
        return cls(options=options, config=config, bus=bus, folders=folders,
                   endpoint=endpoint, curl=CurlConfig(ca_file, http_origin, stall_s),
                   held_paths=held_paths, held_bytes=held_bytes)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.downloads.nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def apply_folders(self) -> None:
        """Make the options (which confinement reads) follow the folders."""
        models_dir = self.folders.models_dir()
        models_dir.mkdir(parents=True, exist_ok=True)
        self.options.models_dir = models_dir
        self.options.scan_dirs = self.folders.scan_dirs()

    @property
    def models_dir(self) -> Path:
        return Path(self.options.models_dir)

    # -- the catalog --------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        return [*self.shipped, *self.added.entries]

    def entry(self, eid: Any) -> Entry:
        if not isinstance(eid, str) or not eid:
            raise bad("`id` must be a catalog id (a string).")
        found = next((e for e in self.entries() if e.id == eid), None)
        if found is None:
            raise ModelsError(404, "not_found", f"The catalog has no entry {eid[:200]!r}.")
        return found

    def catalog_row(self, e: Entry) -> dict[str, Any]:
        received, whole, partial = on_disk(e, self.models_dir)
        job = self.downloads.jobs.get(e.id)
        running = self.downloads.running(e.id)
        status = "downloading" if running else ("on_disk" if whole else "available")
        note = ""
        if job is not None and job.state == "error" and not running and not whole:
            note = f"The last download stopped: {job.error}"
        return {**e.to_json(), "status": status, "received": received,
                "partial": status == "available" and partial, "note": note}

    # -- the listing --------------------------------------------------------------------

    def listing(self) -> dict[str, Any]:
        dirs = [self.models_dir, *[Path(d) for d in self.options.scan_dirs]]
        local = scan(dirs, self.probes)
        return {"models_dir": str(self.models_dir),
                "scan_dirs": [str(d) for d in self.options.scan_dirs],
                "folders": self.folders.to_json(),
                "local": [m.to_json() for m in local],
                "catalog": [self.catalog_row(e) for e in self.entries()]}

    async def listing_async(self) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.listing)

    # -- folders ------------------------------------------------------------------------

    async def put_folders(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.downloads.running():
            raise ModelsError(409, "downloading", "A download is running: its files are being "
                              "written to the folder it started in. Cancel it or let it end "
                              "first.")
        models_dir = body.get("models_dir")
        scans = body.get("scan_dirs")
        if models_dir is not None:
            if not isinstance(models_dir, str):
                raise bad("`models_dir` must be a path (a string), or \"\" for the default.")
            if self.folders.launch_models_dir is not None:
                raise ModelsError(409, "models_dir_at_launch", "The server was started with "
                                  "--models-dir, which decides the models folder for this run.")
            if models_dir:
                _check_models_dir(models_dir)
        if scans is not None:
            if not isinstance(scans, list) or not all(isinstance(s, str) for s in scans):
                raise bad("`scan_dirs` must be a list of paths.")
            for s in scans:
                if not os.path.isabs(s):
                    raise bad(f"{s!r} is not an absolute path.")
                if not Path(s).is_dir():
                    raise bad(f"The folder {s} does not exist.")
        if models_dir is not None:
            self.folders.chosen_models_dir = models_dir
        if scans is not None:
            self.folders.chosen_scan_dirs = list(dict.fromkeys(scans))
        self.config.set_extra("model_folders", {"models_dir": self.folders.chosen_models_dir,
                                                "scan_dirs": self.folders.chosen_scan_dirs})
        self.apply_folders()
        listing = await self.listing_async()
        self.bus.publish("models_folders", listing)
        return listing

    # -- deleting -----------------------------------------------------------------------

    async def delete_local(self, key: str) -> dict[str, Any]:
        parts = key.split("/")
        if len(parts) > 2 or not all(is_bare_name(p) for p in parts):
            raise bad(f"{key[:200]!r} is not a model's name as the listing gives it.")
        folder = self.models_dir
        found = await trio.to_thread.run_sync(lambda: group(scan_dir(folder)))
        model = next((m for m in found if m.key == key), None)
        if model is None:
            raise ModelsError(404, "not_found", f"The models folder has no model {key!r}.")
        real = {os.path.realpath(f) for f in model.files} | {str(f) for f in model.files}
        if any(p and (p in real or os.path.realpath(p) in real) for p in self.held_paths()):
            raise ModelsError(409, "in_use", f"{model.name} is loaded (or loading): unload it "
                              "first.")
        if self.downloads.writing(model.files):
            raise ModelsError(409, "in_use", f"A running download is writing {model.name}: "
                              "cancel it first.")
        files = list(model.files) + companions(list(model.files))
        freed = await trio.to_thread.run_sync(_delete_set, files)
        if model.folder:
            try:
                (folder / model.folder).rmdir()
            except OSError:
                pass
        if self.config is not None and self.config.forget_missing_model():
            self.bus.publish("config", self.config.state(None))
        return {"ok": True, "freed": freed}

    def delete_partial(self, eid: str) -> dict[str, Any]:
        entry = self.entry(eid)
        if self.downloads.running(eid):
            raise ModelsError(409, "downloading", "This entry is downloading: cancel it first.")
        freed = 0
        for f in entry.files:
            if not is_bare_name(f.name):
                raise bad(f"{f.name!r} is not a plain file name.")
            part = part_of(self.models_dir / f.name)
            if part.is_symlink() or part.is_file():
                freed += 0 if part.is_symlink() else size_of(part)
                part.unlink()
        return {"ok": True, "freed": freed}

    # -- downloads ----------------------------------------------------------------------

    async def start_download(self, eid: Any, token: Any) -> dict[str, Any]:
        entry = self.entry(eid)
        token = self._token(token)
        if self.downloads.running(entry.id):
            return self.downloads.jobs[entry.id].event()
        folder = self.models_dir
        if self.downloads.writing([folder / f.name for f in entry.files]):
            raise ModelsError(409, "in_use", "Another download is writing a file of this "
                              "entry.")
        try:
            self.curl.exe()
        except NoCurl as e:
            raise ModelsError(503, "no_curl", e.message) from None
        await self._learn_sizes(entry, token)
        short = self.downloads.check_disk(entry, folder)
        if short:
            raise ModelsError(507, "no_space", f"Not enough disk: {short}.")
        token_here = token if all(self._on_site(f.url) for f in entry.files) else ""
        return self.downloads.start(entry, folder, token_here).event()

    def cancel_download(self, eid: str) -> dict[str, Any]:
        self.entry(eid)
        return {"cancelled": self.downloads.cancel(eid)}

    async def _learn_sizes(self, entry: Entry, token: str) -> None:
        """Ask the host for sizes the catalog does not record (best effort)."""
        unknown = [f for f in entry.files if not f.bytes]
        with trio.move_on_after(URL_SIZE_DEADLINE_S):
            for f in unknown:
                try:
                    f.bytes = await head_size(self.curl, f.url,
                                              token if self._on_site(f.url) else "")
                except CurlError:
                    return

    def _on_site(self, url: str) -> bool:
        return url.startswith(self.site.base + "/")

    @staticmethod
    def _token(token: Any) -> str:
        if token is not None and not isinstance(token, str):
            raise bad("`token` must be a string.")
        try:
            return check_token(token)
        except ValueError as e:
            raise bad(str(e)) from None

    # -- a link ---------------------------------------------------------------------------

    async def add_url(self, url: Any) -> dict[str, Any]:
        base_url, names = url_shards(url, self.curl.http_origin)
        files = []
        with trio.move_on_after(URL_SIZE_DEADLINE_S) as deadline:
            for name in names:
                shard_url = with_last_segment(base_url, name)
                try:
                    size = await head_size(self.curl, shard_url)
                except NoCurl:
                    size = 0
                except CurlError as e:
                    raise ModelsError(502, "bad_gateway", f"The host of {name} refused: "
                                      f"{e.message}.") from None
                files.append(CatalogFile(name, size, shard_url))
        if deadline.cancelled_caught:
            raise ModelsError(504, "timeout", f"The host did not give the sizes within "
                              f"{URL_SIZE_DEADLINE_S:.0f} s; no entry was made.")
        first = names[0]
        eid = f"url:{first}"
        if any(e.id == eid for e in self.shipped):
            raise ModelsError(409, "shipped", "The shipped catalog already has this entry.")
        parts = split_parts(first)
        title = parts[0] if parts else first[:-5]
        entry = Entry(eid, title, files, quant=quant_of(first), added=True,
                      blurb=f"From {urlsplit(base_url).hostname}")
        self.added.put(entry)
        return {"id": entry.id, "title": entry.title, "quant": entry.quant,
                "bytes": entry.bytes}

    def forget_entry(self, eid: str) -> dict[str, Any]:
        if not (eid.startswith("hf:") or eid.startswith("url:")) or not self.added.remove(eid):
            raise ModelsError(404, "not_found", f"{eid[:200]!r} is not an added entry.")
        return {"ok": True}

    # -- Hugging Face -------------------------------------------------------------------

    async def hf_search(self, body: dict[str, Any]) -> dict[str, Any]:
        query = body.get("query")
        if not isinstance(query, str) or not query.strip() or len(query) > 200:
            raise bad("`query` must be the text to search for (at most 200 characters).")
        repos = await self.site.search(query.strip(), self._token(body.get("token")))
        return {"query": query.strip(), "repos": repos}

    def _ref(self, body: dict[str, Any]) -> tuple[str, str, str]:
        ref = parse_repo_text(body.get("repo"), self.site.base)
        rev = body.get("revision")
        if rev is not None and rev != "":
            if not valid_revision(rev):
                raise bad("`revision` is not a branch, tag or commit name.")
            return ref.repo, rev, ref.file
        return ref.repo, ref.revision, ref.file

    async def hf_models(self, body: dict[str, Any]) -> dict[str, Any]:
        repo, rev, file = self._ref(body)
        models = await self.site.models(repo, rev, self._token(body.get("token")))
        chosen = next((m.name for m in models if any(f.path == file for f in m.files)), "")
        return {"repo": repo, "revision": rev, "file": chosen,
                "models": [m.to_json() for m in models]}

    async def _model(self, body: dict[str, Any]) -> tuple[str, str, RepoModel, str]:
        repo, rev, _ = self._ref(body)
        if not valid_repo(repo):
            raise bad("`repo` is not a repository id.")
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("`name` must be a model's name as the repository listing gives it.")
        token = self._token(body.get("token"))
        models = await self.site.models(repo, rev, token)
        model = next((m for m in models if m.name == name), None)
        if model is None:
            raise ModelsError(404, "not_found", f"{repo} has no model {name[:200]!r}.")
        return repo, rev, model, token

    async def hf_inspect(self, body: dict[str, Any]) -> dict[str, Any]:
        repo, rev, model, token = await self._model(body)
        probe = await self.site.probe(repo, rev, model, token)
        present = sum(size_of(self.models_dir / f.path.rsplit("/", 1)[-1])
                      for f in model.files
                      if (self.models_dir / f.path.rsplit("/", 1)[-1]).is_file())
        held = [p for p in self.held_paths() if p]
        held_bytes = self.held_bytes() if held else 0
        machine = await trio.to_thread.run_sync(lambda: machine_now(
            loaded_model=Path(held[0]).name if held else "",
            disk_free=disk_free(self.models_dir), present_bytes=present,
            loaded_held=held_bytes))
        return {"repo": repo, "revision": rev, "name": model.name,
                "quant": quant_of(model.name.rsplit("/", 1)[-1]), "bytes": model.bytes,
                "files": len(model.files), "complete": model.complete,
                "model": probe.to_json() if probe.readable else {"readable": False},
                "machine": machine.to_json(),
                "verdict": verdict(probe, model.bytes, machine)}

    async def hf_add(self, body: dict[str, Any]) -> dict[str, Any]:
        repo, rev, model, _ = await self._model(body)
        if not model.complete:
            raise ModelsError(409, "incomplete", f"{model.name} is a split set with shards "
                              f"missing: the repository has {len(model.files)} of "
                              f"{model.count}.")
        entry = self.site.entry(repo, rev, model)
        if any(e.id == entry.id for e in self.shipped):
            raise ModelsError(409, "shipped", "The shipped catalog already has this entry.")
        self.added.put(entry)
        return {"id": entry.id, "title": entry.title, "quant": entry.quant,
                "bytes": entry.bytes}


def _check_models_dir(path: str) -> None:
    if not os.path.isabs(path):
        raise bad(f"{path!r} is not an absolute path.")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".bmoe-write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise bad(f"The folder {path} cannot take a new file ({e.strerror}).") from None


def _delete_set(files: list[Path]) -> int:
    """Every file renamed aside first (all or none), then deleted; the bytes freed."""
    moved: list[tuple[Path, Path]] = []
    for f in files:
        aside = f.with_name(f".{f.name}.deleting-{os.getpid()}")
        try:
            os.rename(f, aside)
        except OSError:
            for src, dst in reversed(moved):
                try:
                    os.rename(dst, src)
                except OSError:
                    pass
            raise ModelsError(500, "delete_failed", f"{f.name} could not be moved aside (is it "
                              "open elsewhere?); nothing was deleted.") from None
        moved.append((f, aside))
    freed = 0
    for _, aside in moved:
        freed += 0 if aside.is_symlink() else size_of(aside)
        aside.unlink()
    return freed


def url_shards(url: Any, http_origin: str = "") -> tuple[str, list[str]]:
    """The link without its fragment and every file name it names (a split set whole)."""
    if not isinstance(url, str) or len(url) > 4096:
        raise bad("`url` must be a link to a .gguf file.", "invalid_url")
    problem = url_problem(url, http_origin)
    if problem:
        raise bad(f"The link cannot be used: {problem}.", "invalid_url")
    u = urlsplit(url)
    clean = urlunsplit((u.scheme, u.netloc, u.path, u.query, ""))
    last = unquote(u.path.rsplit("/", 1)[-1])
    if not last.lower().endswith(".gguf") or not is_safe_name(last) or last[0] in ".-":
        raise bad("The link must end in a .gguf file name made of letters, digits, . _ - +.",
                  "invalid_url")
    parts = split_parts(last)
    if parts is None:
        return clean, [last]
    stem, _, count = parts
    if count > MAX_URL_SHARDS:
        raise bad(f"The link names a set of {count} files; at most {MAX_URL_SHARDS} are "
                  "taken.", "invalid_url")
    return clean, [shard_name(stem, n, count) for n in range(1, count + 1)]


def with_last_segment(url: str, name: str) -> str:
    u = urlsplit(url)
    head = u.path.rsplit("/", 1)[0]
    from urllib.parse import quote
    return urlunsplit((u.scheme, u.netloc, f"{head}/{quote(name)}", u.query, ""))
