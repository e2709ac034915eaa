"""`bmoe-server`: the command line, startup checks, and the server's nursery."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from ..agent import api as agent_api
from ..engine import params, rpc
from ..engine.experts import streamer_factory
from ..http import access
from ..http.parent import process_alive
from ..http.routes import RouteTable
from ..http.server import HttpApp, serve_http, watch_parent
from ..modelmaker import ensure_demo_model
from ..runtime.config import ConfigStore, default_data_dir
from ..runtime.events import EventBus
from ..runtime.state import Runtime, ServerOptions
from ..service import cli as service_cli
from ..service import logtee
from ..service.autoload import AutoloadState, with_autoload
from ..service.stopping import watch_signals
from . import (backends_routes, launch_files, llama_compat, llama_flags, models_cli, models_routes,
               plan_routes, sleep, trim)
from .routes import build_routes
from .shapes import error_shaper


def assets_dir() -> Path | None:
    here = Path(__file__).resolve().parents[2] / "assets"
    for candidate in (here, Path(sys.prefix) / "share" / "bmoe" / "assets"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bmoe-server",
        description="Serve one local model (streaming its experts) over a web UI, a JSON API "
                    "and the OpenAI / Anthropic wire formats.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; beyond loopback needs a key)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = any free port)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="settings and models folder (default $XDG_DATA_HOME/bmoe or "
                        "~/.local/share/bmoe)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="where models are kept (default <data-dir>/models)")
    p.add_argument("--scan-dir", type=Path, action="append", default=[],
                   help="another folder models are listed from (repeatable)")
    p.add_argument("--models-only", action="store_true",
                   help="every client, local ones too, may open models only in the model folders")
    p.add_argument("--demo", action="store_true",
                   help="write the built-in tiny MoE demo model (if missing) and load it")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", type=Path, help="read the API key from this file")
    key.add_argument("--api-key", help="the API key (visible in the process list: prefer "
                                       "--api-key-file)")
    p.add_argument("--no-api-key", action="store_true",
                   help="allow --host beyond loopback without a key (an open server)")
    p.add_argument("--allow-origin", action="append", default=[],
                   help="admit one more browser origin (e.g. a UI dev server)")
    p.add_argument("--parent-pid", type=int,
                   help="stop when this process ends (also read from BMOE_PARENT_PID, so a "
                        "test run's servers all end with it)")
    p.add_argument("--open", action="store_true", help="open the UI in the system's browser")
    p.add_argument("--autoload", action="store_true",
                   help="load the saved model at start, and again when a request finds none "
                        "loaded (the request waits for it)")
    p.add_argument("--log-file", type=Path, default=None,
                   help="also write every line of stderr, timestamped, to this file (moved "
                        "to FILE.1 at 16 MiB)")
    params.add_cli_flags(p, server=True)
    models_routes.add_flags(p)
    backends_routes.add_flags(p)
    plan_routes.add_flags(p)
    llama_compat.add_flags(p)
    agent_api.add_flags(p)
    return p


def read_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SystemExit(f"bmoe-server: cannot read the key file {args.api_key_file}: "
                             f"{e.strerror or 'it could not be read'}.") from None
        if not key:
            raise SystemExit(f"bmoe-server: the key file {args.api_key_file} is empty.")
        return key
    if args.api_key is not None:
        if not args.api_key.strip():
            raise SystemExit("bmoe-server: --api-key is empty.")
        return args.api_key.strip()
    return None


def check_binding(host: str, key: str | None, no_key: bool) -> None:
    if access.is_loopback_binding(host):
        return
    if key is None and not no_key:
        raise SystemExit(
            f"bmoe-server: refusing to listen on {host} without a key: anyone who can reach the "
            "port could use the model. Pass --api-key-file PATH, or --no-api-key if an open "
            "server is really meant.")
    if key is None:
        print(f"bmoe-server: warning: listening on {host} with no key; anyone who reaches the "
              "port can use this server.", file=sys.stderr)


def open_browser(url: str) -> None:
    opener = "open" if sys.platform == "darwin" else "xdg-open"
    exe = shutil.which(opener)
    if exe is None:
        print(f"bmoe-server: no {opener} to open {url}", file=sys.stderr)
        return
    subprocess.Popen([exe, url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rpc_worker_main(argv: list[str]) -> int:
    """`bmoe-server rpc-worker`: lend this machine's CPU and memory to a bmoe server's
    `--rpc` (llama.cpp's RPC server; see bmoe/engine/rpc.py and docs/security.md)."""
    parser = argparse.ArgumentParser(
        prog="bmoe-server rpc-worker",
        description="Serve this machine's CPU and memory to one bmoe server at a time "
                    "(llama.cpp's RPC backend): that server's --rpc HOST:PORT puts some of "
                    "the model's layers here. The protocol has no authentication.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; any other needs "
                             "--allow-network)")
    parser.add_argument("--port", type=int, default=rpc.DEFAULT_PORT,
                        help=f"port (default {rpc.DEFAULT_PORT})")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="threads of the CPU device (default: half the cores)")
    parser.add_argument("--cache-dir", default=None,
                        help="keep received tensors in this folder, so a reload sends only "
                             "their hashes (llama.cpp's rpc-server --cache)")
    parser.add_argument("--allow-network", action="store_true",
                        help="allow a --host other than loopback: anyone who reaches the "
                             "port can use this machine's memory and CPU")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error("--port must be from 1 to 65535")
    return rpc.run_worker(args.host, args.port, args.threads, args.cache_dir,
                          args.allow_network)


PARENT_ENV = "BMOE_PARENT_PID"


def parent_from_env(value: str) -> int | None:
    """``BMOE_PARENT_PID``'s process, when it names one that is running."""
    if not value.strip().isdigit() or not 1 < int(value) < 1 << 22:   # pid_max's ceiling
        return None
    pid = int(value)
    return pid if process_alive(pid) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["service"]:
        return service_cli.main(argv[1:], sys.modules[__name__])  # its parser and checks
    if argv[:1] == ["rpc-worker"]:
        return rpc_worker_main(argv[1:])
    if argv[:1] == ["models"]:
        return models_cli.main(argv[1:])
    parser = build_parser()
    argv = llama_flags.respell(argv, parser)
    argv, file_lines = llama_compat.config_argv(argv, parser)
    argv, env_lines = llama_compat.env_argv(argv, dict(os.environ), parser)
    args = build_parser().parse_args(argv)
    if args.parent_pid is None:
        args.parent_pid = parent_from_env(os.environ.get(PARENT_ENV, ""))
    for line in [*file_lines, *env_lines, *llama_compat.check_flags(args)]:
        print(f"bmoe-server: {line}", file=sys.stderr)
    if llama_flags.given(args, llama_flags.BY_LONG["--log-verbose"]):
        logging.basicConfig(level=logging.DEBUG, format="bmoe-server: %(name)s: %(message)s")
    if args.log_file is not None:
        logtee.start(args.log_file.expanduser().absolute())
    key = read_key(args)
    check_binding(args.host, key, args.no_api_key)
    backends_routes.check_flags(args)
    data_dir = (args.data_dir or default_data_dir()).expanduser().resolve()
    models_dir = (args.models_dir or data_dir / "models").expanduser().resolve()
    models_dir.mkdir(parents=True, exist_ok=True)
    launch = params.values_from_namespace(args)
    refused = params.validate(launch)
    if refused:
        raise SystemExit(f"bmoe-server: {params.render(refused, 'flag')}")
    if args.demo and not launch.get("model"):
        launch["model"] = str(ensure_demo_model(data_dir))
    launch.update(launch_files.fetch(args, data_dir, models_dir))
    options = ServerOptions(host=args.host, port=args.port, data_dir=data_dir,
                            models_dir=models_dir,
                            scan_dirs=[d.expanduser().resolve() for d in args.scan_dir],
                            models_only=args.models_only, launch_model=launch.get("model"))
    policy = access.AccessPolicy(bound_host=args.host, api_key=key,
                                 allow_origins=list(args.allow_origin))
    try:
        trio.run(serve, options, launch, policy, args)
    except KeyboardInterrupt:
        pass
    return 0


def all_routes(state: Runtime) -> RouteTable:
    """Every route of bmoe-server: the server's own and the agent's (a package above it,
    so wired in here, the composition root)."""
    return build_routes(state, extra=(agent_api.register,))


def route_table(state: Runtime, args: argparse.Namespace) -> RouteTable:
    """The routes ``serve`` answers for this command line. With ``--autoload`` (``state``
    is then an ``AutoloadState``) a request to a route that runs the model loads it first."""
    routes = all_routes(state)
    if args.autoload:
        routes = with_autoload(routes, state)
    if sleep.seconds(args):           # outermost: a sleeping model is awake before autoload
        routes = sleep.with_sleep(routes, state)
    return routes


async def serve(options: ServerOptions, launch: dict[str, Any], policy: access.AccessPolicy,
                args: argparse.Namespace) -> None:
    config = ConfigStore(options.data_dir, launch)
    bus = EventBus()
    kind = AutoloadState if args.autoload else Runtime
    state = kind(options, config, bus, streamer_factory=streamer_factory)
    backends_routes.attach(state, args)       # installed packs load before any model
    models_routes.attach(state, args)
    plan_routes.attach(state, args)
    llama_compat.attach(state, args)
    agent_api.attach(state, args)
    ui = assets_dir() if llama_compat.llama_options(state).ui else None   # --no-ui: 404 at /
    app = HttpApp(route_table(state, args), policy, ui, error_shaper=error_shaper)
    running = trio.CancelScope()
    async with trio.open_nursery() as outer:
        await outer.start(watch_signals, state, running)   # SIGTERM / SIGINT: a clean stop
        try:
            with running:
                async with trio.open_nursery() as nursery:
                    state.attach(nursery)
                    await nursery.start(models_routes.run, state)
                    await nursery.start(plan_routes.run, state)
                    await nursery.start(agent_api.run, state)
                    await nursery.start(trim.run, state)
                    if sleep.seconds(args):
                        await nursery.start(sleep.run, state, sleep.seconds(args))
                    await _start(nursery, state, app, policy, options, args)
        finally:
            with trio.CancelScope(shield=True):
                await state.aclose()
            outer.cancel_scope.cancel()


async def _start(nursery: trio.Nursery, state: Runtime, app: HttpApp,
                 policy: access.AccessPolicy, options: ServerOptions,
                 args: argparse.Namespace) -> None:
    port = await nursery.start(serve_http, app, options.host, options.port)
    policy.port = port
    first = options.host.split(",")[0].strip().strip("[]") or options.host
    shown = "127.0.0.1" if first in ("0.0.0.0", "::") else first
    url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}/"
    print(f"bmoe-server listening on {url}", flush=True)
    if args.log_file is not None:
        print(f"bmoe: listening on {url}", file=sys.stderr, flush=True)
    if args.parent_pid:
        nursery.start_soon(watch_parent, args.parent_pid, nursery.cancel_scope)
    if args.autoload:
        state.start_autoload()                 # type: ignore[attr-defined]
    elif options.launch_model:                 # without --autoload only -m loads at start
        state.begin_load(str(state.config.values["model"]), state.config.values)
    if args.open:
        open_browser(url)
