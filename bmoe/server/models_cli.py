"""`bmoe-server models list | pull REPO[:QUANT] | rm NAME | inspect REPO[:QUANT] |
pack-experts MODEL`.

The Models screen's operations in a terminal. When a bmoe-server answers on the
configured `--host`/`--port` (`GET /api/info`), every operation goes through its API
(`pulling.RemoteBackend`) with its key (`--api-key-file`, `--api-key`, else the
`api-key` file the service keeps in the data folder), so its UI sees the download; when
none answers, the operations work on the data folder directly (`pulling.LocalBackend`,
the same models service a server runs). `--local` skips the question.

Exit codes: 0 done, 1 refused (the sentence on stderr), 130 interrupted (a download's
`.part` kept, and the server's download cancelled, for the next `pull`).

`pack-experts` works on the file alone, here: it writes the model's packed experts file
beside it (`bmoe.engine.experts.packed`), which a server loading the model reads its
MXFP4 experts from.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from ..models.errors import ModelsError
from ..models.service import ModelsService
from ..runtime.config import default_data_dir
from ..runtime.events import EventBus
from . import models_routes
from .models_routes import check_flags
from .progress import mb
from .pulling import (
    INTERRUPTED_EXIT,
    Backend,
    LocalBackend,
    Puller,
    RemoteBackend,
    is_interrupt,
    models_error_of,
    with_service,
)

PROBE_TIMEOUT_S = 2.0          # whether a server answers on the configured address
KEY_FILE = "api-key"           # the service's key file in the data folder (service/args.py)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bmoe-server models",
        description="List, fetch, remove and inspect models, through the running server "
                    "when one answers on --host/--port (its UI sees the download), else in "
                    "the data folder directly.")
    p.add_argument("--host", default="127.0.0.1", help="the server's address (default "
                   "127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="the server's port (default 8765)")
    p.add_argument("--data-dir", type=Path, default=None, help="the data folder (default "
                   "$XDG_DATA_HOME/bmoe or ~/.local/share/bmoe)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="where models are kept (default <data-dir>/models)")
    p.add_argument("--scan-dir", type=Path, action="append", default=[],
                   help="another folder models are listed from (repeatable)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", type=Path, help="the running server's key, from a file")
    key.add_argument("--api-key", help="the running server's key")
    p.add_argument("--local", action="store_true",
                   help="work on the data folder even if a server answers")
    p.add_argument("-hft", "--hf-token", default=None, metavar="TOKEN",
                   help="the Hugging Face token a gated repository needs (default: HF_TOKEN)")
    models_routes.add_flags(p)
    verbs = p.add_subparsers(dest="verb", required=True,
                             metavar="list|pull|rm|inspect|pack-experts")
    verbs.add_parser("list", help="the models in the folders, and downloads under way")
    pull = verbs.add_parser("pull", help="fetch a repository's model into the models folder")
    pull.add_argument("ref", metavar="REPO[:QUANT]")
    pull.add_argument("-hff", "--hf-file", default="", help="the repository's file to fetch "
                      "(instead of a quantization)")
    pull.add_argument("--no-mmproj", action="store_true",
                      help="do not fetch the repository's image projector")
    rm = verbs.add_parser("rm", help="delete a model (every shard) from the models folder")
    rm.add_argument("name", metavar="NAME", help="the name `list` shows")
    inspect = verbs.add_parser("inspect", help="whether a repository's model fits here, "
                               "fetching only its header")
    inspect.add_argument("ref", metavar="REPO[:QUANT]")
    inspect.add_argument("-hff", "--hf-file", default="")
    pack = verbs.add_parser(
        "pack-experts", help="write a copy of a model's MXFP4 experts (gpt-oss) beside it "
        "in the layout llama.cpp's repacked kernels run, which streaming reads instead "
        "of permuting each expert as it lands (costs the experts' bytes again on disk)")
    pack.add_argument("model", metavar="MODEL", help="the model file, or its name in the "
                      "models folder")
    return p


def main(argv: list[str]) -> int:
    import os
    args = build_parser().parse_args(argv)
    check_flags(args)
    if args.verb == "pack-experts":
        return pack_experts(args)
    token = str(args.hf_token or os.environ.get("HF_TOKEN", "")).strip()
    remote = None if args.local else running_server(args)
    if remote is not None:
        return _run(args, remote, token, None)
    service = local_service(args)
    return _run(args, LocalBackend(service), token, service)


def _run(args: argparse.Namespace, backend: Backend, token: str,
         service: ModelsService | None) -> int:
    puller = Puller(backend, token, sys.stdout, pair=not getattr(args, "no_mmproj", False))
    verb = VERBS[args.verb]
    job = partial(verb, args, puller)
    try:
        if service is not None:
            trio.run(with_service, service, job)
        else:
            trio.run(job)
    except BaseException as e:
        if is_interrupt(e):
            print(puller.interrupted(), file=sys.stderr, flush=True)
            return INTERRUPTED_EXIT
        refused = models_error_of(e)
        if refused is None:
            raise
        print(f"bmoe-server models {args.verb}: {refused.message}", file=sys.stderr)
        return 1
    return 0


# -- where the operations run -----------------------------------------------------------

def data_dir_of(args: argparse.Namespace) -> Path:
    return (args.data_dir or default_data_dir()).expanduser().resolve()


def server_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return str(args.api_key).strip()
    path = args.api_key_file or data_dir_of(args) / KEY_FILE
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        if args.api_key_file is not None:
            raise SystemExit(f"bmoe-server models: cannot read the key file {path}.") from None
        return None


def running_server(args: argparse.Namespace) -> RemoteBackend | None:
    """The server answering on --host/--port, or None when nothing does."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{'[' + host + ']' if ':' in host else host}:{args.port}"
    key = server_key(args)
    req = urllib.request.Request(url + "/api/info", headers=(
        {"Authorization": f"Bearer {key}"} if key else {}))
    try:
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as resp:
            info = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise SystemExit(f"bmoe-server models: the server at {url}/ needs its key: pass "
                             "--api-key-file PATH (or --local to work on the data folder).") \
                from None
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "state" not in info:
        return None
    return RemoteBackend(url, key)


def local_service(args: argparse.Namespace) -> ModelsService:
    data_dir = data_dir_of(args)
    models_dir = (args.models_dir or data_dir / "models").expanduser().resolve()
    options = SimpleNamespace(data_dir=data_dir, models_dir=models_dir,
                              scan_dirs=[Path(d).expanduser().resolve() for d in args.scan_dir])
    data_dir.mkdir(parents=True, exist_ok=True)
    return ModelsService.create(options, None, EventBus(),
                                models_dir_at_launch=args.models_dir is not None,
                                endpoint=args.hf_endpoint.rstrip("/"), ca_file=args.hf_ca_file,
                                stall_s=args.download_stall_s)


# -- the verbs ---------------------------------------------------------------------------

async def list_models(args: argparse.Namespace, puller: Puller) -> None:
    listing = await puller.backend.listing()
    say = puller.say
    say(f"Models in {listing['models_dir']} (from {puller.backend.where}):")
    local = listing["local"]
    if not local:
        say("  none")
    width = max([len(_key(m)) for m in local] + [4])
    for m in local:
        say(f"  {_key(m):<{width}}  {mb(m['bytes']):>10}  {_kind(m)}")
    under_way = [r for r in listing["catalog"]
                 if r["status"] == "downloading" or r.get("partial")]
    if under_way:
        say("Downloads:")
    for r in under_way:
        state = "downloading" if r["status"] == "downloading" else "stopped"
        ref = f"{r['repo']}:{r['quant']}" if r.get("repo") and r.get("quant") else r["id"]
        say(f"  {r['file']}: {mb(r['received'])} of {mb(r['bytes'])}, {state}"
            + (f" (`bmoe-server models pull {ref}` resumes it)" if state == "stopped" else ""))


def _key(m: dict[str, Any]) -> str:
    return f"{m['folder']}/{m['name']}" if m.get("folder") else str(m["name"])


def _kind(m: dict[str, Any]) -> str:
    if m.get("error"):
        return m["error"]
    words = [m.get("role") or "?", m.get("arch") or "?"]
    if m.get("role") == "model":
        words.append("streams its experts" if m.get("streamable") else "runs whole")
    if m.get("shards", 1) > 1:
        words.append(f"{m['shards']} shards" + ("" if m["complete"] else ", some missing"))
    if m.get("projector"):
        words.append(f"projector {m['projector']}")
    return ", ".join(words)


async def pull(args: argparse.Namespace, puller: Puller) -> None:
    got = await puller.pull(args.ref, args.hf_file)
    puller.say(f"ready: {got['model']}" + (f" (projector {got['mmproj']})"
                                           if got.get("mmproj") else ""))


async def remove(args: argparse.Namespace, puller: Puller) -> None:
    done = await puller.backend.delete_local(args.name)
    puller.say(f"removed {args.name} ({mb(int(done.get('freed', 0)))} freed).")


async def inspect(args: argparse.Namespace, puller: Puller) -> None:
    repo, rows, choice = await puller.resolve(args.ref, args.hf_file)
    puller.say(choice.why)
    found = await puller.backend.hf_inspect(repo, choice.name, puller.token)
    try:
        puller.tell_verdict(found)
    except ModelsError:
        pass                                 # inspect only says it
    v = found["verdict"]
    puller.say(f"  verdict: {v['fit']} ({v['mode']}); {mb(found['bytes'])} in "
               f"{found['files']} file{'s' if found['files'] != 1 else ''}.")


def pack_experts(args: argparse.Namespace) -> int:
    """Write the model's packed experts file; 0 done, 1 refused, 130 interrupted (no
    file left behind)."""
    from ..engine.experts import packed

    path = Path(args.model).expanduser()
    if not path.is_file():
        in_folder = (args.models_dir or data_dir_of(args) / "models").expanduser() / args.model
        if in_folder.is_file():
            path = in_folder
    if not path.is_file():
        print(f"bmoe-server models pack-experts: {args.model} is neither a file nor a model "
              "in the models folder", file=sys.stderr)
        return 1
    shown = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(1, total)
        if pct != shown[0]:
            shown[0] = pct
            print(f"\rpacking experts: {pct}% of {mb(total)}", end="", file=sys.stderr,
                  flush=True)

    try:
        out = packed.write(path, progress)
    except KeyboardInterrupt:
        print("\npack-experts: interrupted; nothing was written", file=sys.stderr)
        return INTERRUPTED_EXIT
    except packed.PackError as e:
        print(f"\nbmoe-server models pack-experts: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"\nbmoe-server models pack-experts: could not write beside {path.name} "
              f"({e.strerror})", file=sys.stderr)
        return 1
    print(f"\nwrote {out} ({mb(out.stat().st_blocks * 512)} on disk)")
    return 0


VERBS = {"list": list_models, "pull": pull, "rm": remove, "inspect": inspect}
