"""``bmoe-server service install [server args...] | status | start | stop | uninstall``."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

from . import NAME, args, units
from .args import ServerLine
from .managers import Install, Manager, ServiceError, find_manager

USAGE = """usage: bmoe-server service install [server options and engine parameters...]
       bmoe-server service status | start | stop | uninstall

install    register the server as a service of your own init system, started at login
           and again after a failure; the options are the server's, checked as a start
           checks them (--data-dir, --log-file and --autoload are added)
status     registered or not, running or not, the URL, and the log's last lines
start      start the registered service;  stop: stop it (it stays registered)
uninstall  remove the registration; settings, models and the key file stay"""

LOG_TAIL_LINES = 10            # the log lines status shows
LOG_TAIL_BYTES = 64 * 1024     # how far from the end status reads for them


def main(argv: list[str], server: ServerLine) -> int:
    """`bmoe-server service ...`; `server` is bmoe-server's command line (its parser and
    launch checks), given by the composition root."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"bmoe-server service: unknown command {verb!r}.\n{USAGE}", file=sys.stderr)
        return 2
    if verb != "install" and rest:
        print(f"bmoe-server service {verb} takes no arguments (the ones given at install "
              "stay registered).", file=sys.stderr)
        return 2
    try:
        return VERBS[verb](rest, server)
    except ServiceError as e:
        print(f"bmoe-server service {verb}: {e.message}", file=sys.stderr)
        return 1


def install(argv: list[str], server: ServerLine) -> int:
    prepared = args.service_argv(argv, server)       # SystemExit with a start's reason
    manager = find_manager()
    cmd = units.command(prepared.argv)
    notes = manager.install(Install(cmd, units.workdir(), prepared.data_dir, prepared.log_file))
    print(f"Registered {NAME} with {manager.title}, started at login and again after a "
          "failure.")
    print(f"  command: {' '.join(cmd)}")
    print(f"  URL:     {prepared.url}")
    print(f"  log:     {prepared.log_file}")
    if prepared.new_key is not None:
        key_file = prepared.data_dir / args.KEY_FILE
        print(f"  key:     {prepared.new_key}")
        print(f"The key is shown this once; it is kept in {key_file} (readable by you only). "
              "Clients send it as `Authorization: Bearer KEY`.")
    for note in prepared.notes + notes:
        print(note)
    return 0


def start(_: list[str], server: ServerLine) -> int:
    manager = _registered()
    manager.start()
    print(f"Started {NAME}.")
    return 0


def stop(_: list[str], server: ServerLine) -> int:
    manager = _registered()
    manager.stop()
    print(f"Stopped {NAME}; it stays registered and starts again at the next login.")
    return 0


def uninstall(_: list[str], server: ServerLine) -> int:
    manager = find_manager()
    status = manager.status()
    if not status.registered:
        print(f"{NAME} is not registered; nothing to remove.")
        return 0
    manager.uninstall()
    options = _server_args(status.command, server)
    data_dir = options.data_dir if options is not None else None
    if data_dir is not None:
        (Path(data_dir) / f"{NAME}.xml").unlink(missing_ok=True)
    print(f"Removed {NAME} from {manager.title}.")
    if data_dir is not None:
        print(f"Settings, models and the key file stay in {data_dir}.")
    return 0


def status(_: list[str], server: ServerLine) -> int:
    manager = find_manager()
    st = manager.status()
    if not st.registered:
        print(f"{NAME}: not registered with {manager.title}. "
              "Register it with: bmoe-server service install [server options]")
        return 4
    print(f"{NAME}: registered with {manager.title}")
    running = f"yes (pid {st.pid})" if st.running and st.pid else "yes" if st.running else "no"
    print(f"  running: {running}{'' if st.running else f' ({st.detail})'}")
    options = _server_args(st.command, server)
    log_file = Path(options.log_file) if options is not None and options.log_file else None
    url = _url(options, log_file if st.running else None)
    if url:
        print(f"  URL:     {url}")
    if log_file is not None:
        print(f"  log:     {log_file}")
        lines = tail(log_file)
        print("  last log lines:" if lines else "  the log is empty so far")
        for line in lines:
            print(f"    {line}")
    return 0 if st.running else 3


VERBS = {"install": install, "status": status, "start": start, "stop": stop,
         "uninstall": uninstall}


def _registered() -> Manager:
    manager = find_manager()
    if not manager.status().registered:
        raise ServiceError(f"{NAME} is not registered. Register it with: "
                           "bmoe-server service install [server options]")
    return manager


def _server_args(cmd: list[str], server: ServerLine) -> argparse.Namespace | None:
    """The server's options in a registered command line (None if they no longer parse)."""
    if len(cmd) < 3 or cmd[1:3] != ["-m", "bmoe.server"]:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return args.parse(cmd[3:], server)
    except SystemExit:
        return None


def _url(server: argparse.Namespace | None, log_file: Path | None) -> str:
    """The URL the server said it listens on (from its log), else the one its options name."""
    for line in reversed(tail(log_file, lines=1000) if log_file else []):
        if "listening on " in line:
            return line.rsplit("listening on ", 1)[1].strip()
    return args.url_for(server.host, server.port) if server is not None else ""


def tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> list[str]:
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]
