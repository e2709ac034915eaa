"""Fetching a repository's model from the command line: `-hf REPO[:QUANT]` at start and
`bmoe-server models pull`.

Theory of operation
-------------------
One flow (`Puller`) over the Models screen's operations, reached through a `Backend`:
`LocalBackend` calls the models service of this process (`bmoe/models/service.py`, the
data folder directly), `RemoteBackend` the same operations of a running server over its
HTTP API (`bmoe/server/models_routes.py`), so that server's UI sees the download. Both
answer with the API's JSON bodies and refuse with `ModelsError`.

`pull`: the repository's listing (`hf/models`), the model the command line means
(`bmoe/models/choose.py`, said with the reason), and for each file set (the model, then
its projector): already whole in the models folder, said and not fetched; else the
inspect verdict said (`hf/inspect`: fits / streams / will not fit, and the disk), a set
the disk cannot hold refused before a byte moves, then the catalog entry (`hf/add`), the
download (`models/download`: resume, retries, SHA-256 are the downloader's) and its
progress (`progress.py`) until it ends.

`Puller.current` names the set being fetched, so an interrupted caller can say which
`.part` files are kept for the next run (`interrupted`).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import quote

import trio

from ..models.choose import Choice, choose, projector, split_ref
from ..models.errors import ModelsError
from ..models.hf import valid_repo
from ..models.service import ModelsService
from .progress import mb, open_view

POLL_S = 0.5                     # how often a download's bytes are read for its progress
HTTP_TIMEOUT_S = 60.0            # one request to a running server (a listing probes files)
INTERRUPTED_EXIT = 130           # a shell's code for a command ended by Ctrl-C


class Backend(Protocol):
    where: str

    async def listing(self) -> dict[str, Any]: ...
    async def hf_models(self, repo: str, token: str) -> dict[str, Any]: ...
    async def hf_inspect(self, repo: str, name: str, token: str) -> dict[str, Any]: ...
    async def hf_add(self, repo: str, name: str, token: str) -> dict[str, Any]: ...
    async def start_download(self, eid: str, token: str) -> dict[str, Any]: ...
    async def wait(self, eid: str, seconds: float) -> dict[str, Any]: ...
    async def delete_local(self, key: str) -> dict[str, Any]: ...
    def cancel_now(self, eid: str) -> None: ...


class LocalBackend:
    """The models service of this process (it must be running: `service.run`)."""

    def __init__(self, service: ModelsService) -> None:
        self.service = service
        self.where = f"the data folder {service.options.data_dir}"

    async def listing(self) -> dict[str, Any]:
        return await self.service.listing_async()

    async def hf_models(self, repo: str, token: str) -> dict[str, Any]:
        return await self.service.hf_models({"repo": repo, "token": token})

    async def hf_inspect(self, repo: str, name: str, token: str) -> dict[str, Any]:
        return await self.service.hf_inspect({"repo": repo, "name": name, "token": token})

    async def hf_add(self, repo: str, name: str, token: str) -> dict[str, Any]:
        return await self.service.hf_add({"repo": repo, "name": name, "token": token})

    async def start_download(self, eid: str, token: str) -> dict[str, Any]:
        return await self.service.start_download(eid, token)

    async def wait(self, eid: str, seconds: float) -> dict[str, Any]:
        job = self.service.downloads.jobs[eid]
        with trio.move_on_after(seconds):
            await job.finished.wait()
        return job.event()

    async def delete_local(self, key: str) -> dict[str, Any]:
        return await self.service.delete_local(key)

    def cancel_now(self, eid: str) -> None:
        self.service.downloads.cancel(eid)   # the job's curl ends with this process anyway


class RemoteBackend:
    """A running bmoe-server's models API, with its key when it has one."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.where = f"the server at {self.url}/"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float = HTTP_TIMEOUT_S) -> Any:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raise _http_refusal(e) from None
        except (OSError, ValueError) as e:
            raise ModelsError(502, "server_unreachable", f"{self.where} did not answer "
                              f"({getattr(e, 'reason', e)}).") from None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return await trio.to_thread.run_sync(self.call, method, path, body)

    async def listing(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/api/models"))

    async def hf_models(self, repo: str, token: str) -> dict[str, Any]:
        return dict(await self._call("POST", "/api/hf/models", {"repo": repo, "token": token}))

    async def hf_inspect(self, repo: str, name: str, token: str) -> dict[str, Any]:
        return dict(await self._call("POST", "/api/hf/inspect",
                                     {"repo": repo, "name": name, "token": token}))

    async def hf_add(self, repo: str, name: str, token: str) -> dict[str, Any]:
        return dict(await self._call("POST", "/api/hf/add",
                                     {"repo": repo, "name": name, "token": token}))

    async def start_download(self, eid: str, token: str) -> dict[str, Any]:
        return dict(await self._call("POST", "/api/models/download", {"id": eid, "token": token}))

    async def wait(self, eid: str, seconds: float) -> dict[str, Any]:
        await trio.sleep(seconds)
        row = next((r for r in (await self.listing())["catalog"] if r["id"] == eid), None)
        if row is None:
            return {"state": "error", "received": 0, "error": "the server forgot the entry"}
        state = {"downloading": "running", "on_disk": "done"}.get(row["status"])
        if state is None:
            state = "error" if row.get("note") else "cancelled"
        return {"state": state, "received": row["received"],
                "error": str(row.get("note", "")).removeprefix("The last download stopped: ")}

    async def delete_local(self, key: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/api/models/local/{quote(key)}", {}))

    def cancel_now(self, eid: str) -> None:
        try:
            self.call("DELETE", f"/api/models/download/{quote(eid, safe='')}", {}, timeout=10)
        except ModelsError:
            pass


def _http_refusal(e: urllib.error.HTTPError) -> ModelsError:
    try:
        body = json.loads(e.read())
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    message = body.get("error")
    if isinstance(message, dict):                 # another route's shape
        message = message.get("message")
    return ModelsError(e.code, str(body.get("code") or "http_error"),
                       str(message or f"the server answered HTTP {e.code}"))


@dataclass
class Fetching:
    folder: Path
    names: list[str]
    eid: str


class Puller:
    def __init__(self, backend: Backend, token: str, stream: IO[str], *, prefix: str = "",
                 pair: bool = True) -> None:
        self.backend, self.token, self.stream = backend, token, stream
        self.prefix, self.pair = prefix, pair
        self.current: Fetching | None = None

    def say(self, line: str) -> None:
        print(f"{self.prefix}{line}", file=self.stream, flush=True)

    async def resolve(self, text: str, file: str = "") -> tuple[str, list[dict[str, Any]],
                                                                 Choice]:
        repo, quant = split_ref(text)
        if not valid_repo(repo):
            raise ModelsError(400, "not_a_repo", f"{repo!r} is not a repository id "
                              "(<user>/<model>[:quant]).")
        try:
            rows = (await self.backend.hf_models(repo, self.token))["models"]
        except ModelsError as e:
            raise self._gated(repo, e) from None
        return repo, rows, choose(repo, rows, quant, file)

    def _gated(self, repo: str, e: ModelsError) -> ModelsError:
        if e.code != "hf_unauthorized":
            return e
        if not self.token:
            return ModelsError(401, e.code, f"the site refused {repo}: it is gated (or does not "
                               "exist), and no token was given. Pass --hf-token TOKEN or set "
                               "HF_TOKEN (a token with access to the repository).")
        return ModelsError(401, e.code, f"the site refused {repo} with the token given: the "
                           "token has no access to this gated repository (or it does not "
                           "exist).")

    async def pull(self, text: str, file: str = "") -> dict[str, str]:
        """The `model` (and `mmproj`) paths of `REPO[:QUANT]`, fetched if need be."""
        repo, rows, choice = await self.resolve(text, file)
        self.say(choice.why)
        out = {"model": str(await self.fetch(repo, choice.model, inspect=True))}
        proj = projector(rows, choice.model) if self.pair else None
        if proj is not None:
            self.say(f"{repo}: its image projector {proj['name']} goes with it")
            out["mmproj"] = str(await self.fetch(repo, proj, inspect=False))
        return out

    async def fetch(self, repo: str, row: dict[str, Any], *, inspect: bool) -> Path:
        listing = await self.backend.listing()
        folder = Path(listing["models_dir"])
        files = [(f["path"].rsplit("/", 1)[-1], int(f["bytes"])) for f in row["files"]]
        first = files[0][0]
        if any(m["name"] == first and m["complete"] and m["folder"] == ""
               and Path(m["dir"]) == folder for m in listing["local"]):
            self.say(f"{first} is already in {folder}; not fetched.")
            return folder / first
        if inspect:
            self.tell_verdict(await self.backend.hf_inspect(repo, row["name"], self.token))
        added = await self.backend.hf_add(repo, row["name"], self.token)
        return await self.download(added["id"], folder, files)

    def tell_verdict(self, found: dict[str, Any]) -> None:
        v = found["verdict"]
        self.say(f"{found['name']}: {v['headline']}.")
        if v.get("memory"):
            self.say(f"  memory: {v['memory']}.")
        self.say(f"  disk: {v['disk']}.")
        if v.get("fit") == "no_disk":
            raise ModelsError(507, "no_space", f"{found['name']} was not fetched: {v['disk']}.")

    async def download(self, eid: str, folder: Path, files: list[tuple[str, int]]) -> Path:
        self.current = Fetching(folder, [n for n, _ in files], eid)
        total = sum(size for _, size in files)
        shards = f" in {len(files)} files" if len(files) > 1 else ""
        await self.backend.start_download(eid, self.token)
        self.say(f"fetching {files[0][0]} ({mb(total)}{shards}) into {folder} ...")
        view = open_view(self.stream, files, prefix=self.prefix)
        try:
            while True:
                ev = await self.backend.wait(eid, POLL_S)
                view.update(int(ev.get("received") or 0), str(ev.get("error") or ""))
                if ev["state"] != "running":
                    break
        finally:
            view.close()
        if ev["state"] != "done":
            kept = any((folder / f"{n}.part").is_file() for n, _ in files)
            raise ModelsError(502, "download_failed", f"{files[0][0]} could not be fetched: "
                              f"{ev.get('error') or ev['state']}." + (
                                  " What came is kept; the same command resumes it."
                                  if kept else ""))
        self.current = None
        self.say(f"fetched {files[0][0]}.")
        return folder / files[0][0]

    def interrupted(self) -> str:
        """What an interrupt leaves, in words (and the running server's download
        cancelled, which keeps its part too)."""
        fetching = self.current
        if fetching is None:
            return "interrupted; nothing was being fetched."
        self.backend.cancel_now(fetching.eid)
        kept = []
        for name in fetching.names:
            part = fetching.folder / f"{name}.part"
            if part.is_file():
                kept.append(f"{part.name} ({mb(os.path.getsize(part))})")
        if not kept:
            return f"interrupted; nothing of {fetching.names[0]} had come yet."
        return (f"interrupted: kept {', '.join(kept)} in {fetching.folder}; the same command "
                "resumes from there.")


def is_interrupt(e: BaseException) -> bool:
    """A Ctrl-C, as trio.run raises it (alone, or in a nursery's group)."""
    if isinstance(e, KeyboardInterrupt):
        return True
    return isinstance(e, BaseExceptionGroup) and e.subgroup(KeyboardInterrupt) is not None


def models_error_of(e: BaseException) -> ModelsError | None:
    """The refusal a run ended with (alone, or in a nursery's group)."""
    if isinstance(e, ModelsError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            found = models_error_of(inner)
            if found is not None:
                return found
    return None


async def with_service(service: ModelsService, fn: Any) -> Any:
    """`await fn()` while the models service runs (its downloads need its nursery)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        try:
            return await fn()
        finally:
            nursery.cancel_scope.cancel()
