"""A Hugging Face site (or a mirror) on the one endpoint the server was started with.

Only what the server validated reaches a URL: a repository id (``owner/name``, letters,
digits, ``.``, ``_``, ``-``), a revision of the same letters, and file paths of the
repository's own listing (folders of letters, digits, ``.``, ``_``, ``-``, ``+``, no
``..``). A client's text is read as one of those or refused (``not_a_repo``); it never
becomes a URL itself. Every request goes through ``curl`` (``curl.py``).

The site's API shapes used: ``/api/models?search=...&expand[]=...`` (search),
``/api/models/<repo>/tree/<revision>?recursive=true`` (the files, with the LFS object id
that is the file's SHA-256), ``/<repo>/resolve/<revision>/<path>`` (the bytes; range
requests for a header).

A header is read as a download is fetched: each range read continues from the bytes
already held, and a failed line is tried again under the downloads' own policy
(``curl.should_retry``, ``curl.retry_wait``); a host that will not resume is read from
its first byte again, whole prefixes from then on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import trio

from .catalog import SHA256, CatalogFile, Entry, is_safe_name, quant_of
from .errors import ModelsError
from .curl import (RANGE_REFUSED_EXIT, CurlConfig, CurlError, RangeRead, exit_words,
                   get_bytes, get_range, retry_wait, should_retry)
from .probe import (FIRST_READ, HEADER_CAP, MIB, Header, ModelProbe, Truncated, Unreadable,
                    parse_header, shard_name, split_parts)

DEFAULT_ENDPOINT = "https://huggingface.co"
SEARCH_LIMIT = 20
MAX_QUERY = 200

_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
REVISION = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]*$")


class HfError(ModelsError):
    """A refusal or a failure of the site, with the status and code the route answers."""


def valid_repo(repo: Any) -> bool:
    return isinstance(repo, str) and bool(REPO_ID.match(repo)) and ".." not in repo


def valid_revision(rev: Any) -> bool:
    return isinstance(rev, str) and bool(REVISION.match(rev)) and ".." not in rev


def valid_path(path: Any) -> bool:
    """A repository file path the server may put in a URL."""
    if not isinstance(path, str) or not path or len(path) > 512:
        return False
    return all(_SEGMENT.match(s) and ".." not in s for s in path.split("/"))


@dataclass(frozen=True)
class RepoRef:
    repo: str
    revision: str = "main"
    file: str = ""


def parse_repo_text(text: Any, endpoint: str) -> RepoRef:
    """A repository id, or a URL on the site naming one (tree, blob or resolve)."""
    if not isinstance(text, str) or not text.strip():
        raise HfError(400, "not_a_repo", "Give a repository id (owner/name) or a link to "
                      "one on the site.")
    text = text.strip()
    if valid_repo(text):
        return RepoRef(text)
    site = urlsplit(endpoint)
    hosts = {site.hostname}
    if endpoint.rstrip("/") == DEFAULT_ENDPOINT:
        hosts |= {"hf.co", "www.huggingface.co"}
    try:
        u = urlsplit(text if "://" in text else "https://" + text)
        host = u.hostname
        port_ok = (u.port or 443) == (site.port or (443 if site.scheme == "https" else 80)) \
            or u.port is None
    except ValueError:
        raise _not_a_repo(text) from None
    if host not in hosts or not port_ok or u.username or u.password:
        raise _not_a_repo(text)
    parts = [unquote(p) for p in u.path.strip("/").split("/") if p]
    if len(parts) < 2 or not valid_repo("/".join(parts[:2])):
        raise _not_a_repo(text)
    repo = "/".join(parts[:2])
    if len(parts) == 2:
        return RepoRef(repo)
    if parts[2] not in ("tree", "blob", "resolve") or len(parts) < 4:
        raise _not_a_repo(text)
    rev = parts[3]
    path = "/".join(parts[4:])
    if not valid_revision(rev) or (path and not valid_path(path)):
        raise _not_a_repo(text)
    return RepoRef(repo, rev, path if parts[2] != "tree" else "")


def _not_a_repo(text: str) -> HfError:
    return HfError(400, "not_a_repo", f"{text[:200]!r} is neither a repository id (owner/name) "
                   "nor a link to one on the site: search for it instead.")


def name_role(path: str) -> str:
    base = path.rsplit("/", 1)[-1].lower()
    if "mmproj" in base:
        return "projector"
    if base.startswith(("mtp-", "dflash-", "draft-")):
        return "draft"
    return "model"


@dataclass
class RepoFile:
    path: str
    bytes: int
    sha256: str = ""


@dataclass
class RepoModel:
    name: str                       # the repository path of its first file (shard 1)
    files: list[RepoFile]           # present, in shard order
    count: int                      # shards the name says
    role: str = "model"

    @property
    def complete(self) -> bool:
        return len(self.files) == self.count

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "quant": quant_of(self.name.rsplit("/", 1)[-1]),
                "bytes": self.bytes, "role": self.role, "count": self.count,
                "complete": self.complete,
                "files": [{"path": f.path, "bytes": f.bytes} for f in self.files]}


def group_files(tree: list[RepoFile]) -> list[RepoModel]:
    sets: dict[tuple[str, int], dict[int, RepoFile]] = {}
    models: list[RepoModel] = []
    for f in tree:
        folder, _, base = f.path.rpartition("/")
        parts = split_parts(base)
        if parts is None or parts[2] == 1:
            models.append(RepoModel(f.path, [f], 1, name_role(f.path)))
            continue
        stem, no, count = parts
        key = (f"{folder}/{stem}" if folder else stem, count)
        sets.setdefault(key, {})[no] = f
    for (stem, count), shards in sets.items():
        folder, _, base_stem = stem.rpartition("/")
        first = shard_name(base_stem, 1, count)
        name = f"{folder}/{first}" if folder else first
        models.append(RepoModel(name, [shards[n] for n in sorted(shards)], count,
                                name_role(name)))
    order = {"model": 0, "draft": 1, "projector": 2}
    models.sort(key=lambda m: (order.get(m.role, 3), m.name.lower()))
    return models


def _tree_files(items: Any) -> list[RepoFile]:
    out = []
    for it in items if isinstance(items, list) else []:
        if not isinstance(it, dict) or it.get("type") != "file":
            continue
        path = it.get("path")
        if not isinstance(path, str) or not path.lower().endswith(".gguf") or not valid_path(path):
            continue
        lfs_raw = it.get("lfs")
        lfs: dict[str, Any] = lfs_raw if isinstance(lfs_raw, dict) else {}
        size = lfs.get("size", it.get("size", 0))
        sha = lfs.get("oid") or lfs.get("sha256") or ""
        out.append(RepoFile(path, size if isinstance(size, int) and size >= 0 else 0,
                            sha if isinstance(sha, str) and SHA256.match(sha) else ""))
    return out


@dataclass
class HfSite:
    endpoint: str
    curl: CurlConfig = field(default_factory=CurlConfig)

    @property
    def base(self) -> str:
        return self.endpoint.rstrip("/")

    def resolve_url(self, repo: str, revision: str, path: str) -> str:
        return f"{self.base}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"

    async def _get_json(self, url: str, token: str) -> Any:
        try:
            status, body = await get_bytes(self.curl, url, token)
        except CurlError as e:
            raise HfError(502, "hf_unreachable", f"The site could not be reached: {e.message}.") \
                from None
        if status in (401, 403):
            raise HfError(401, "hf_unauthorized", "The site refused: the repository does not "
                          "exist, or it needs a token (a gated model) and none or a wrong one "
                          "was given.")
        if status >= 400 or status == 0:
            raise HfError(404, "hf_error", f"The site answered HTTP {status}.")
        try:
            return json.loads(body)
        except ValueError:
            raise HfError(502, "hf_unreadable", "The site's answer was not JSON.") from None

    async def search(self, query: str, token: str) -> list[dict[str, Any]]:
        q = quote(query, safe="")
        url = (f"{self.base}/api/models?search={q}&filter=gguf&sort=downloads&direction=-1"
               f"&limit={SEARCH_LIMIT}" + "".join(
                   f"&expand%5B%5D={k}" for k in ("downloads", "likes", "lastModified", "gated")))
        data = await self._get_json(url, token)
        out = []
        for r in data if isinstance(data, list) else []:
            if not isinstance(r, dict) or not valid_repo(r.get("id")):
                continue
            out.append({"id": r["id"], "downloads": _num(r.get("downloads")),
                        "likes": _num(r.get("likes")),
                        "modified": r.get("lastModified") if isinstance(
                            r.get("lastModified"), str) else "",
                        "gated": bool(r.get("gated")) and r.get("gated") != "false"})
        return out[:SEARCH_LIMIT]

    async def files(self, repo: str, revision: str, token: str) -> list[RepoFile]:
        url = (f"{self.base}/api/models/{repo}/tree/{quote(revision, safe='')}"
               "?recursive=true")
        return _tree_files(await self._get_json(url, token))

    async def models(self, repo: str, revision: str, token: str) -> list[RepoModel]:
        return group_files(await self.files(repo, revision, token))

    async def header(self, repo: str, revision: str, path: str, token: str) -> Header:
        """A file's header by range requests, growing while it goes on. Each read continues
        from the bytes held; a cut line is tried again as a download's is, and bytes that
        already hold the whole header end it however the line ended."""
        url = self.resolve_url(repo, revision, path)
        held = b""
        want, failures, resumes = FIRST_READ, 0, True
        while True:
            start = len(held) if resumes else 0
            read = await self._read(url, path, start, want - start, token)
            if read.exit_code == RANGE_REFUSED_EXIT and start:   # a continuation refused
                held, resumes = b"", False
                continue
            held = held[:start] + read.data
            try:
                return parse_header(held)
            except Truncated as t:
                needed = t.needed
            if read.failed:
                failures += 1
                if not should_retry(read.exit_code, failures):
                    raise _unfetched(path, read, failures)
                await trio.sleep(retry_wait(failures))
                continue
            if len(held) < want:
                raise Unreadable("the file ends inside its header")
            if needed > HEADER_CAP or want >= HEADER_CAP:
                raise Unreadable(f"the header is larger than {HEADER_CAP // MIB} MiB")
            want = min(HEADER_CAP, max(want * 2, needed + MIB))

    async def _read(self, url: str, path: str, start: int, n: int, token: str) -> RangeRead:
        try:
            return await get_range(self.curl, url, start, n, token)
        except CurlError as e:
            raise HfError(502, "hf_unreachable", f"The header of {path} could not be "
                          f"fetched: {e.message}") from None

    async def probe(self, repo: str, revision: str, model: RepoModel, token: str) -> ModelProbe:
        headers = []
        for f in model.files:
            try:
                headers.append(await self.header(repo, revision, f.path, token))
            except Unreadable as e:
                return ModelProbe.unreadable(e.reason)
        try:
            return ModelProbe.of(headers)
        except Exception:  # noqa: BLE001 - a hostile header never takes a request down
            return ModelProbe.unreadable("the header could not be read")

    def entry(self, repo: str, revision: str, model: RepoModel) -> Entry:
        files = []
        for f in model.files:
            base = f.path.rsplit("/", 1)[-1]
            if not is_safe_name(base):
                raise HfError(400, "invalid_name", f"{base!r} is not a file name this server "
                              "writes (letters, digits, . _ - +).")
            files.append(CatalogFile(base, f.bytes, self.resolve_url(repo, revision, f.path),
                                     f.sha256))
        title = model.name.rsplit("/", 1)[-1]
        parts = split_parts(title)
        title = parts[0] if parts else title[:-5]
        return Entry(id=f"hf:{repo}/{model.name}", title=title, files=files,
                     quant=quant_of(model.name.rsplit("/", 1)[-1]),
                     blurb=f"From {repo} on {self.base}", added=True, repo=repo,
                     revision=revision)


def _unfetched(path: str, read: RangeRead, attempts: int) -> HfError:
    words = exit_words(read.exit_code, read.http_status)
    after = f" (after {attempts} attempts)" if attempts > 1 else ""
    return HfError(502, "hf_unreachable", f"The header of {path} could not be fetched: "
                   f"{words}{after}.")


def _num(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
