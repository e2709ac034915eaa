"""The model files a llama-server command line names by where they come from.

`--hf-repo <user>/<model>[:quant]` (with `--hf-file`), `--model-url URL` and
`--mmproj-url URL` name a file by its origin, not by its path. Before the server listens
(as llama-server fetches before it listens), each is found in the models folders by its
file name, or fetched into the models folder through the models service (the same
downloads, site and checks as the Models page: `bmoe/models/service.py`), then loaded as
`-m` / `--mmproj` would load it. A fetched entry joins the catalog (`added-models.json`),
so the next start with `--offline` finds it without the site.

`--hf-repo` goes through `pulling.Puller`, as `bmoe-server models pull` does: the tag's
quantization exactly, else the preference order's first (`bmoe/models/choose.py`), said
with the reason; the inspect verdict said before the download and a set the disk cannot
hold refused; every shard fetched with its progress on stderr (stdout's first line
stays the listening address); the repository's image projector beside it unless
`--no-mmproj` or `--mmproj` says otherwise. `--hf-token`, else `HF_TOKEN`, is sent to
the site. Ctrl-C keeps each `.part` for the next start and exits 130. With `--offline`
nothing is fetched: a file the folders do not have ends the start, by name.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import trio

from ..models.catalog import Entry
from ..models.download import on_disk
from ..models.errors import ModelsError
from ..models.hf import name_role, valid_repo
from ..models.service import ModelsService
from ..runtime.events import EventBus
from . import llama_flags
from .pulling import INTERRUPTED_EXIT, LocalBackend, Puller, is_interrupt, models_error_of, with_service


def fetch(args: argparse.Namespace, data_dir: Path, models_dir: Path) -> dict[str, str]:
    """The `model` / `mmproj` values the command line's origins name (SystemExit, by
    name, when one cannot be had; exit 130 on Ctrl-C, the parts kept); {} when it names
    none."""
    F, given = llama_flags.BY_LONG, llama_flags.given
    repo, url = given(args, F["--hf-repo"]), given(args, F["--model-url"])
    mm_url = given(args, F["--mmproj-url"])
    if not (repo or url or mm_url):
        return {}
    if given(args, F["--hf-file"]) and not repo:
        raise SystemExit("bmoe-server: --hf-file needs --hf-repo (the repository it is in).")
    named = [n for n, v in (("-m", getattr(args, "model", None)), ("--hf-repo", repo),
                            ("--model-url", url)) if v]
    if len(named) > 1:
        raise SystemExit(f"bmoe-server: {' and '.join(named)} both name the model: give one.")
    if mm_url and getattr(args, "mmproj", None):
        raise SystemExit("bmoe-server: --mmproj and --mmproj-url both name the projector: "
                         "give one.")
    want = Wanted(repo or "", given(args, F["--hf-file"]) or "", url or "", mm_url or "",
                  pair=getattr(args, "mmproj_auto", True) is not False
                  and not getattr(args, "mmproj", None),
                  offline=bool(given(args, F["--offline"])))
    service = _service(args, data_dir, models_dir)
    puller = Puller(LocalBackend(service), token_of(args), sys.stderr, prefix="bmoe-server: ",
                    pair=want.pair)
    try:
        return trio.run(with_service, service, partial(_fetch_all, service, want, puller))
    except BaseException as e:
        if is_interrupt(e):
            _say(puller.interrupted())
            raise SystemExit(INTERRUPTED_EXIT) from None
        refused = models_error_of(e)
        if refused is None:
            raise
        raise SystemExit(f"bmoe-server: {want.origin()}: {refused.message}") from None


def token_of(args: argparse.Namespace) -> str:
    """--hf-token, else HF_TOKEN (as llama-server reads it)."""
    token = llama_flags.given(args, llama_flags.BY_LONG["--hf-token"])
    return str(token or os.environ.get("HF_TOKEN", "")).strip()


class Wanted(SimpleNamespace):
    def __init__(self, repo: str, file: str, url: str, mm_url: str, *, pair: bool,
                 offline: bool) -> None:
        super().__init__(repo=repo, file=file, url=url, mm_url=mm_url, pair=pair,
                         offline=offline)

    def origin(self) -> str:
        if self.repo:
            return f"--hf-repo {self.repo}" + (f" --hf-file {self.file}" if self.file else "")
        return f"--model-url {self.url}" if self.url else f"--mmproj-url {self.mm_url}"


def _service(args: argparse.Namespace, data_dir: Path, models_dir: Path) -> ModelsService:
    options = SimpleNamespace(data_dir=data_dir, models_dir=models_dir,
                              scan_dirs=[Path(d).expanduser().resolve() for d in args.scan_dir])
    return ModelsService.create(options, None, EventBus(),
                                models_dir_at_launch=args.models_dir is not None,
                                endpoint=args.hf_endpoint.rstrip("/"), ca_file=args.hf_ca_file,
                                stall_s=args.download_stall_s)


async def _fetch_all(service: ModelsService, want: Wanted, puller: Puller) -> dict[str, str]:
    out: dict[str, str] = {}
    if want.repo:
        out.update(await _from_repo(service, want, puller))
    elif want.url:
        out["model"] = str(await _from_url(service, want.url, want.offline, puller))
    if want.mm_url:
        out["mmproj"] = str(await _from_url(service, want.mm_url, want.offline, puller))
    return out


def _on_hand(service: ModelsService, name: str) -> Path | None:
    for folder in (service.models_dir, *service.options.scan_dirs):
        path = Path(folder) / name
        if path.is_file():
            return path
    return None


def _say(line: str) -> None:
    print(f"bmoe-server: {line}", file=sys.stderr, flush=True)


async def _from_repo(service: ModelsService, want: Wanted, puller: Puller) -> dict[str, str]:
    repo, _, quant = want.repo.partition(":")
    if not valid_repo(repo):
        raise ModelsError(400, "not_a_repo", f"{repo!r} is not a repository id "
                          "(<user>/<model>[:quant]).")
    if want.file:
        path = _on_hand(service, want.file.rsplit("/", 1)[-1])
        if path is not None:
            _say(f"--hf-repo {want.repo}: {want.file} is in {path.parent}; not fetched.")
            return {"model": str(path)}
    known = _known_entry(service, repo, quant, want.file)
    if known is not None and on_disk(known, service.models_dir)[1]:
        path = service.models_dir / known.files[0].name
        _say(f"--hf-repo {want.repo}: {path.name} is in {path.parent}; not fetched.")
        return {"model": str(path)}
    if want.offline:
        raise ModelsError(404, "offline", "the models folders do not have it, and --offline "
                          "fetches nothing.")
    return await puller.pull(want.repo, want.file)


def _known_entry(service: ModelsService, repo: str, quant: str, file: str) -> Entry | None:
    """A model an earlier fetch of this repository added, of the file or quant asked."""
    for e in service.added.entries:
        name = e.id.removeprefix(f"hf:{repo}/")
        if e.repo != repo or not e.files or name_role(name) != "model":
            continue
        if file and name != file:
            continue
        if not file and quant and (e.quant or "").lower() != quant.lower():
            continue
        return e
    return None


async def _from_url(service: ModelsService, url: str, offline: bool, puller: Puller) -> Path:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    path = _on_hand(service, name) if name else None
    if path is not None:
        _say(f"{url}: {name} is in {path.parent}; not fetched.")
        return path
    if offline:
        raise ModelsError(404, "offline", f"the models folders have no {name or 'such file'}, "
                          "and --offline fetches nothing.")
    added = await service.add_url(url)
    return await _download(service, service.entry(added["id"]), puller)


async def _download(service: ModelsService, entry: Entry, puller: Puller) -> Path:
    target = service.models_dir / entry.files[0].name
    if on_disk(entry, service.models_dir)[1]:
        _say(f"{entry.files[0].name} is in {service.models_dir}; not fetched.")
        return target
    return await puller.download(entry.id, service.models_dir,
                                 [(f.name, f.bytes) for f in entry.files])
