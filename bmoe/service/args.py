"""A start's command line made into a service's.

Theory of operation
-------------------
``service_argv`` parses the arguments with the server's own parser and runs the same
launch checks a start runs (``read_key``, ``check_binding``), so a mistake is refused
now, with the reason a start would give, and not at the next login with nobody
reading. The parsed namespace is then written back out as a command line
(``namespace_to_argv``, from the parser's own actions, so an option added to the
server later comes along), with every path made absolute, ``--open`` dropped, and
what a service needs added: ``--data-dir``, ``--log-file``, ``--autoload`` and, for a
server beyond loopback that was given no key and no ``--no-api-key``, ``--api-key-file``
naming a key the install made (``ensure_key``). The result is parsed and checked once
more, so what is registered is what a start accepts.
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..engine import params
from ..http import access

KEY_FILE = "api-key"
LOG_FILE = "bmoe-server.log"
KEY_BYTES = 32                  # random bytes in a generated key (43 URL-safe characters)

DROPPED = {"open": "--open is dropped: a service has no browser to open."}
REFUSED = {"parent_pid": "--parent-pid ties the server to one process, which a service "
                         "outlives; leave it out of a service's command line."}


@dataclass
class ServiceArgs:
    argv: list[str]                  # the server's command line, without the program
    data_dir: Path
    log_file: Path
    url: str
    notes: list[str] = field(default_factory=list)
    new_key: str | None = None       # a key made by this install, to print once


class ServerLine(Protocol):
    """What a service needs of bmoe-server's command line: its parser (every family's
    flags) and its launch checks. The composition root that dispatches `bmoe-server
    service` here (bmoe/server/main.py) passes itself, so this package never imports it."""

    def build_parser(self) -> argparse.ArgumentParser: ...
    def read_key(self, args: argparse.Namespace) -> str | None: ...
    def check_binding(self, host: str, key: str | None, no_key: bool) -> None: ...
    def default_data_dir(self) -> Path: ...


def parse(argv: list[str], server: ServerLine) -> argparse.Namespace:
    """Parse as a start parses (argparse's usage and exit 2 on a mistake)."""
    return server.build_parser().parse_args(argv)


def check_launch(ns: argparse.Namespace, server: ServerLine) -> str | None:
    """The launch checks a start runs (SystemExit with the reason); returns the key."""
    key = server.read_key(ns)
    server.check_binding(ns.host, key, ns.no_api_key)
    return key


def _path_dests(parser: argparse.ArgumentParser) -> set[str]:
    dests = {a.dest for a in parser._actions if a.type is Path}
    dests |= {p.dest for p in params.table() if p.type == "path"}
    return dests


def absolute(value: Any, cwd: Path) -> Any:
    """A path (or a list of them) made absolute against ``cwd``, of the type it came as
    (the table's path parameters are text, the server's own options ``Path``); "" stays ""."""
    if isinstance(value, list):
        return [absolute(v, cwd) for v in value]
    if value in (None, ""):
        return value
    path = Path(os.path.normpath(cwd / os.path.expanduser(os.fspath(value))))
    return os.fspath(path) if isinstance(value, str) else path


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return os.fspath(value) if isinstance(value, Path) else str(value)


def _option(flag: str, value: Any) -> list[str]:
    text = _text(value)
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def namespace_to_argv(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                      skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The command line that parses back to ``ns`` (options only; defaults left out).

    Written from the parser's own actions (argparse's action classes name their kind),
    so an option added to the server later is written out with no change here.
    """
    out: list[str] = []
    done: set[str] = set()
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in skip or dest in done or not hasattr(ns, dest):
            continue
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        value = getattr(ns, dest)
        if action.default is not argparse.SUPPRESS and value == action.default:
            continue
        flag = next((f for f in action.option_strings if f.startswith("--")),
                    action.option_strings[0])
        if action.nargs == 0:
            if value == action.const:
                out.append(flag)
                done.add(dest)
        elif isinstance(action, argparse._AppendAction):
            for item in value or []:
                out += _option(flag, item)
            done.add(dest)
        else:
            out += _option(flag, value)
            done.add(dest)
    return out


def ensure_key(data_dir: Path) -> tuple[Path, str | None]:
    """The install's key file: kept when an earlier install wrote one, else made (0600).

    Returns the file and the new key (None when an existing one was kept).
    """
    path = data_dir / KEY_FILE
    try:
        if path.read_text(encoding="utf-8").strip():
            return path, None
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SystemExit(f"bmoe-server: cannot read the key file {path}: "
                         f"{e.strerror or 'refused'}.") from None
    key = secrets.token_urlsafe(KEY_BYTES)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path, key


def url_for(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}/"


def service_argv(argv: list[str], server: ServerLine, cwd: Path | None = None) -> ServiceArgs:
    """Check ``argv`` as a start would and make it a service's command line."""
    cwd = cwd or Path.cwd()
    parser = server.build_parser()
    ns = parser.parse_args(argv)
    for dest, why in REFUSED.items():
        if getattr(ns, dest, None):
            raise SystemExit(f"bmoe-server: {why}")
    server.read_key(ns)                  # the key as given, refused as a start refuses it
    notes = [why for dest, why in DROPPED.items() if getattr(ns, dest, False)]
    for dest in _path_dests(parser):
        if hasattr(ns, dest):
            setattr(ns, dest, absolute(getattr(ns, dest), cwd))
    data_dir = ns.data_dir or absolute(server.default_data_dir(), cwd)
    ns.data_dir = data_dir
    ns.log_file = ns.log_file or data_dir / LOG_FILE
    ns.autoload = True
    new_key = None
    if not access.is_loopback_binding(ns.host) and ns.api_key_file is None \
            and ns.api_key is None and not ns.no_api_key:
        ns.api_key_file, new_key = ensure_key(data_dir)
        if new_key is None:
            notes.append(f"Kept the key an earlier install wrote: {ns.api_key_file}.")
    model = getattr(ns, "model", None)
    if model and not Path(model).is_file():
        notes.append(f"Note: the model {model} is not there yet; the service will say so in "
                     "its log until it is.")
    if ns.api_key is not None:
        notes.append("--api-key puts the key in the service's command line, which every "
                      "local user can list; --api-key-file is the way to pass one.")
    out = namespace_to_argv(parser, ns, skip=set(DROPPED))
    again = parser.parse_args(out)
    lost = [k for k, v in vars(ns).items() if k not in DROPPED and getattr(again, k, None) != v]
    if lost:
        raise SystemExit("bmoe-server: the service's command line would not keep "
                         f"{', '.join('--' + k.replace('_', '-') for k in lost)}: a fault in "
                         "bmoe, not in what you typed; please report it.")
    check_launch(again, server)
    return ServiceArgs(out, data_dir, ns.log_file, url_for(ns.host, ns.port), notes, new_key)
