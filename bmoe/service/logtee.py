"""``--log-file PATH``: every line the server writes to stderr, with a timestamp, in a file.

Theory of operation
-------------------
The server's file descriptor 2 becomes a pipe to a small child process, this module
run as ``python -m bmoe.service.logtee PATH``. So the server's own lines, Python's
warnings and tracebacks, and whatever llama.cpp writes to fd 2 all arrive in one pipe,
in the order written. The child echoes what it reads to its own stderr (the server's
original one: a terminal, or the init system's journal; not when that is PATH itself,
as under launchd) and appends each line to PATH
with a timestamp, one ``os.write`` per line on an ``O_APPEND`` descriptor: nothing waits
in a buffer of ours.

The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C and an init system's stop
reach the whole group) and ends when the pipe does. When the server exits, crashes or
is killed, the child still reads what the server had written, so a crash loses at most
the line it had not finished, and that part is written too, as it stands.

Rotation: PATH is moved to PATH.1 (replacing an earlier one) when it reaches
``ROTATE_BYTES``, at start or after a line, so a log never grows past two such files.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROTATE_BYTES = 16 * 2**20      # a log file is moved to PATH.1 at this size
READ_BYTES = 65536             # one read from the pipe


def stamp() -> bytes:
    """The local time with its offset, to the millisecond, and a space."""
    return datetime.now().astimezone().isoformat(timespec="milliseconds").encode() + b" "


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


class LogFile:
    """A log file written a whole line at a time, rotated at ``limit`` bytes."""

    def __init__(self, path: Path, limit: int = ROTATE_BYTES) -> None:
        self.path = path
        self.limit = limit
        self.fd = -1
        self.size = 0
        self._open()
        if self.size >= self.limit:
            self._rotate()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self.fd).st_size

    def _rotate(self) -> None:
        os.close(self.fd)
        os.replace(self.path, rotated(self.path))
        self._open()

    def write_line(self, line: bytes) -> None:
        """One line (without its line break), stamped; rotated after it once full."""
        data = stamp() + line.rstrip(b"\r") + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(data)
        if self.size >= self.limit:
            self._rotate()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def copy(source: int, echo: int | None, log: LogFile) -> None:
    """Read ``source`` to its end: echo each read to ``echo``, each line to ``log``."""
    pending = b""
    while True:
        data = os.read(source, READ_BYTES)
        if not data:
            break
        if echo is not None:
            echo = _echo(echo, data)
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            log.write_line(line)
    if pending:
        log.write_line(pending)


def _echo(fd: int, data: bytes) -> int | None:
    """Write ``data`` to ``fd``; None once that fails (the log goes on without it)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return fd
    except OSError:
        return None


def check_writable(path: Path) -> None:
    """Refuse to start, with a sentence, when the log file cannot be written."""
    try:
        LogFile(path).close()
    except OSError as e:
        raise SystemExit(f"bmoe-server: cannot write the log file {path}: "
                         f"{e.strerror or 'refused'}.") from None


def start(path: Path) -> subprocess.Popen[bytes]:
    """Start the child and make this process's stderr its pipe."""
    check_writable(path)
    child = subprocess.Popen([sys.executable, "-m", "bmoe.service.logtee", os.fspath(path)],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert child.stdin is not None
    sys.stderr.flush()
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    faulthandler.enable(file=sys.stderr)    # a crash leaves its Python stack in the log
    return child


def _same_file(a: int, b: int) -> bool:
    """Whether two descriptors are one file (launchd sends stderr to the log file too)."""
    try:
        x, y = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    log = LogFile(Path(argv[0]))
    try:
        copy(0, None if _same_file(2, log.fd) else 2, log)
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
