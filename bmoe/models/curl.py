"""The one way the server reaches the network: the system ``curl`` as a child process.

Every call builds an argument list (never a shell line) with ``--proto =https
--proto-redir =https`` (a plain-http mirror named with ``--hf-endpoint`` is the only
exception), ``--globoff`` (no URL globbing) and ``--`` before the URL, so no URL is read
as an option. A token reaches curl only as a header file (``-H @file``) in a folder
only this process may read, removed as soon as curl is done; curl drops a custom
``Authorization`` header on a redirect to another host by itself. ``--hf-ca-file``
adds a CA bundle (a private mirror's, or the tests' own hub): it is the only way to
trust another certificate, and https stays required.

Failures are ``CurlError`` with a sentence for a person and curl's exit code. What a
failed line is, how often it is tried again and how long is waited in between
(``RETRY_EXIT_CODES``, ``should_retry``, ``retry_wait``) is stated here once, for the two
readers that resume: a download (``download.py``) and a header read (``hf.py``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

CONNECT_TIMEOUT_S = 20
MAX_REDIRECTS = 10
API_BODY_LIMIT = 32 << 20          # the most of an API answer read (a tree listing)
HEAD_LIMIT = 64 << 10

_EXIT_WORDS = {
    5: "the proxy's name could not be resolved",
    6: "the host's name could not be resolved",
    7: "the host could not be reached",
    16: "the HTTP/2 connection failed",
    18: "the connection ended before the file did",
    22: "the host answered with an HTTP error",
    23: "the file could not be written (is the disk full?)",
    28: "the connection stalled and timed out",
    33: "the host does not resume a download from where it stopped",
    35: "the secure connection could not be set up",
    47: "the host redirected too many times",
    52: "the host closed the connection without answering",
    55: "sending to the host failed",
    56: "the connection was cut off while receiving",
    60: "the host's certificate could not be verified",
    63: "the file is larger than allowed",
    92: "the HTTP/2 stream was reset",
    1: "the link uses a protocol other than https",
}


# The retry policy: a failed line (not a refusal of the request) is tried again from the
# bytes already held, up to MAX_ATTEMPTS times, waiting 2 s, 4 s, ... at most 60 s.
RETRY_EXIT_CODES = frozenset({6, 7, 16, 18, 28, 35, 52, 55, 56, 92})
RANGE_REFUSED_EXIT = 33            # the host does not resume: start again from the first byte
MAX_ATTEMPTS = 6
FIRST_WAIT_S = 2.0
MAX_WAIT_S = 60.0


def retry_wait(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    return min(FIRST_WAIT_S * 2 ** (attempt - 1), MAX_WAIT_S)


def should_retry(exit_code: int, attempt: int) -> bool:
    return exit_code in RETRY_EXIT_CODES and attempt < MAX_ATTEMPTS


class CurlError(Exception):
    def __init__(self, message: str, exit_code: int = 0, http_status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.http_status = http_status


class NoCurl(CurlError):
    pass


def exit_words(code: int, http_status: int = 0) -> str:
    if code == 22 and http_status:
        return f"the host answered HTTP {http_status}"
    return _EXIT_WORDS.get(code, f"curl failed (exit status {code})")


@dataclass(frozen=True)
class CurlConfig:
    ca_file: str = ""          # --hf-ca-file: an extra CA bundle
    http_origin: str = ""      # a plain-http --hf-endpoint, the one http origin allowed
    stall_s: int = 30          # below 1 byte/s for this long is a stall (exit 28)

    def exe(self) -> str:
        exe = shutil.which("curl")
        if exe is None:
            raise NoCurl("This server downloads with the system's curl, and none was found "
                         "on PATH: install curl.")
        return exe

    def base(self, url: str) -> list[str]:
        protos = "=https"
        if self.http_origin and url.startswith(self.http_origin.rstrip("/") + "/"):
            protos = "=http,https"
        args = [self.exe(), "--silent", "--show-error", "--globoff", "--location",
                "--max-redirs", str(MAX_REDIRECTS), "--proto", protos, "--proto-redir", protos,
                "--connect-timeout", str(CONNECT_TIMEOUT_S)]
        if self.ca_file:
            args += ["--cacert", self.ca_file]
        return args


def check_token(token: object) -> str:
    """The token as a header value may carry it: printable ASCII, no blanks (else "")."""
    if not isinstance(token, str) or not token:
        return ""
    if len(token) > 4096 or not all(33 <= ord(c) < 127 for c in token):
        raise ValueError("The token is not one: it must be printable ASCII without blanks.")
    return token


@contextmanager
def token_file(token: str) -> Iterator[list[str]]:
    """``-H @file`` arguments carrying the token, or none; the file lives in a 0700
    folder of its own, is 0600, and is removed when the block ends."""
    if not token:
        yield []
        return
    folder = tempfile.mkdtemp(prefix="bmoe-token-")
    path = Path(folder) / "header"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"Authorization: Bearer {token}\n")
        yield ["--header", f"@{path}"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _read_some(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    buf = bytearray()
    while len(buf) < limit:
        chunk = await stream.receive_some(min(65536, limit - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


_PR_SET_PDEATHSIG = 1


def _die_with_server(server_pid: int) -> None:
    """In the forked child before curl starts (Linux): be killed when the server ends,
    however it ends (kill -9 too), so no curl of a dead server goes on writing a `.part`
    that the next server resumes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != server_pid:       # the server ended before the prctl
        os._exit(1)


def child_setup() -> Callable[[], None] | None:
    """`preexec_fn` for starting curl: it dies with the server (see `_die_with_server`)."""
    if not sys.platform.startswith("linux"):
        return None
    pid = os.getpid()
    return lambda: _die_with_server(pid)


async def _run(args: list[str], limit: int) -> tuple[int, bytes, bool]:
    """Run curl, reading at most ``limit`` bytes of stdout: (exit, output, cut short)."""
    proc = await trio.lowlevel.open_process(args, stdout=-1, stderr=-3, stdin=-3,
                                            preexec_fn=child_setup())
    try:
        assert proc.stdout is not None
        out = await _read_some(proc.stdout, limit)
        cut = False
        if len(out) >= limit and proc.poll() is None:
            more = await proc.stdout.receive_some(1)
            cut = bool(more)
            if cut:
                proc.kill()
        code = await proc.wait()
        return code, out, cut
    finally:
        if proc.poll() is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        if proc.stdout is not None:
            with trio.CancelScope(shield=True):
                await proc.stdout.aclose()


async def get_bytes(cfg: CurlConfig, url: str, token: str = "", *,
                    limit: int = API_BODY_LIMIT) -> tuple[int, bytes]:
    """GET ``url``: (HTTP status of the last answer, body). CurlError on a failed line."""
    with token_file(token) as auth:
        args = cfg.base(url) + auth + ["--write-out", "\n%{http_code}"] + ["--", url]
        code, out, cut = await _run(args, limit + 16)
    if cut:
        raise CurlError("The answer was larger than this server reads.", 63)
    if code != 0:
        raise CurlError(exit_words(code), code)
    body, _, status = out.rpartition(b"\n")
    try:
        return int(status), body
    except ValueError:
        raise CurlError("The host's answer could not be read.") from None


TRAILER = len(b"\n000")            # what a range read has curl write after the body


@dataclass(frozen=True)
class RangeRead:
    """What one range read received: the bytes from its start (never more than asked),
    curl's exit code and the last answer's HTTP status (0 when not known)."""
    data: bytes
    exit_code: int
    http_status: int

    @property
    def at_end(self) -> bool:
        """The host said the file ends at the read's start (``416``)."""
        return self.exit_code == 22 and self.http_status == 416

    @property
    def failed(self) -> bool:
        """The line failed, or the host refused, before the read was whole."""
        return self.exit_code != 0 and not self.at_end


async def get_range(cfg: CurlConfig, url: str, start: int, n: int,
                    token: str = "") -> RangeRead:
    """Up to ``n`` bytes of ``url`` from byte ``start`` (fewer when the file ends first).

    The first read (``start`` 0) is ``--range 0-(n-1)``: a host that ignores the range and
    sends the whole file is cut off after ``n`` bytes, so the answer is the same prefix
    either way. A read further on continues with ``--continue-at start``, which curl
    refuses (exit 33) when the host answers without the range, rather than hand back
    bytes from the wrong place. The bytes a failed line delivered are kept in ``data``.
    """
    where = ["--range", f"0-{n - 1}"] if start == 0 else ["--continue-at", str(start)]
    with token_file(token) as auth:
        args = cfg.base(url) + auth + ["--fail", *where, "--write-out", "\n%{http_code}",
                                       "--", url]
        code, out, cut = await _run(args, n + TRAILER + 1)
    if cut or len(out) > n + TRAILER:   # more than asked (the whole file): its first n bytes
        return RangeRead(out[:n], 0, 0)
    # curl writes the status on every exit of its own; without it (a signal) what is left
    # of the body is still a prefix of the bytes from ``start``.
    body, _, status = out.rpartition(b"\n")
    return RangeRead(body, code, int(status) if status.isdigit() else 0)


async def head_size(cfg: CurlConfig, url: str, token: str = "") -> int:
    """The size the last answer to a HEAD (redirects followed) gives; 0 when none does.
    CurlError with ``http_status`` when the host answers an HTTP error."""
    with token_file(token) as auth:
        args = cfg.base(url) + auth + ["--head", "--write-out", "%{http_code}", "--", url]
        code, out, _ = await _run(args, HEAD_LIMIT)
    if code != 0:
        raise CurlError(exit_words(code), code)
    text = out.decode("latin-1")
    body, _, status_text = text.rpartition("\n")
    status = int(status_text) if status_text.strip().isdigit() else 0
    if status >= 400:
        raise CurlError(exit_words(22, status), 22, status)
    blocks = [b for b in body.replace("\r\n", "\n").split("\n\n") if b.strip()]
    if not blocks:
        return 0
    last = blocks[-1]
    for line in last.split("\n"):
        k, _, v = line.partition(":")
        if k.strip().lower() in ("x-linked-size", "content-length") and v.strip().isdigit():
            return int(v.strip())
    return 0


def download_args(cfg: CurlConfig, url: str, part: Path, auth: list[str]) -> list[str]:
    """curl's arguments to continue ``part`` from ``url`` (``-C -``: resume from its size)."""
    return cfg.base(url) + auth + [
        "--fail", "--continue-at", "-", "--output", str(part),
        "--speed-limit", "1", "--speed-time", str(cfg.stall_s),
        "--write-out", "%{http_code}", "--", url]
