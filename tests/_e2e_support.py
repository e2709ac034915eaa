"""Raw HTTP/1.1 over real sockets, for the end-to-end tests against a real bmoe-server.

A test often needs what a friendly client will not send (a foreign ``Host``, no
``Content-Type``, a body cut short) or must hold a connection open, so these helpers
write the bytes themselves and read the answer with a small parser.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The spec's policy, written out here rather than imported, so a change shows.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
    "connect-src 'self'; media-src 'none'; object-src 'none'; frame-src 'self' blob:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}
JSON_TYPE = ("Content-Type", "application/json")


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]          # names lower-cased
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        """The error's machine code, in the server's shape or a protocol's."""
        try:
            body = self.json()
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
        if isinstance(body.get("code"), str):
            return body["code"]
        err = body.get("error")
        if isinstance(err, dict):
            return err.get("code") or err.get("type")
        return None


def request_bytes(method: str, target: str, *, host: str | None,
                  headers: Sequence[tuple[str, str]] = (), body: bytes | None = None, close: bool = True) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


class Conn:
    """One client connection, read with a small HTTP/1.1 response parser."""

    def __init__(self, port: int, addr: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((addr, port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def _more(self) -> bytes:
        data = self.sock.recv(65536)
        self.buf += data
        return data

    def read_until(self, marker: bytes, limit: int = 1 << 20) -> bytes:
        """Everything up to and including ``marker`` (EOFError if the server closed first)."""
        while marker not in self.buf:
            if not self._more():
                raise EOFError(f"closed before {marker!r}: {self.buf[-300:]!r}")
            if len(self.buf) > limit:
                raise AssertionError("no marker in the first MiB")
        head, _, self.buf = self.buf.partition(marker)
        return head + marker

    def read_head(self) -> tuple[int, list[tuple[str, str]]]:
        head = self.read_until(b"\r\n\r\n").decode("latin-1")
        lines = head.split("\r\n")
        status = int(lines[0].split()[1])
        headers = [(k.strip().lower(), v.strip()) for k, _, v in (l.partition(":") for l in lines[1:] if l)]
        return status, headers

    def read_reply(self, *, head_only: bool = False) -> Reply:
        status, headers = self.read_head()
        while 100 <= status < 200:                 # an interim answer (100 Continue)
            status, headers = self.read_head()
        names = dict(headers)
        if head_only or status in (204, 304):
            return Reply(status, headers, b"")
        if "content-length" in names:
            n = int(names["content-length"])
            while len(self.buf) < n:
                if not self._more():
                    raise EOFError("body cut short")
            body, self.buf = self.buf[:n], self.buf[n:]
        elif names.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked()
        else:
            while self._more():
                pass
            body, self.buf = self.buf, b""
        return Reply(status, headers, body)

    def _read_chunked(self) -> bytes:
        body = b""
        while True:
            size = int(self.read_until(b"\r\n")[:-2].split(b";")[0], 16)
            while len(self.buf) < size + 2:
                if not self._more():
                    raise EOFError("chunk cut short")
            body += self.buf[:size]
            self.buf = self.buf[size + 2:]
            if size == 0:
                return body

    def closed_by_server(self, within: float) -> bool:
        """True when the server closes (EOF or reset) within ``within`` s without a byte."""
        self.sock.settimeout(within)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def answers_within(self, seconds: float) -> bool:
        """Whether a byte arrives within ``seconds`` (kept for the next read)."""
        self.sock.settimeout(seconds)
        try:
            return bool(self._more())
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(30.0)


def call(port: int, method: str, path: str, *, body: Any = None, raw: bytes | None = None,
         headers: list[tuple[str, str]] | None = None, host: str | None = "", key: str | None = None,
         json_type: bool | None = None, addr: str = "127.0.0.1", timeout: float = 60.0) -> Reply:
    """One request on its own connection. ``host=""`` sends the server's own
    ``addr:port``; ``json_type`` defaults to on for everything but GET and HEAD."""
    if host == "":
        host = f"{addr}:{port}"
    extra: list[tuple[str, str]] = []
    if key is not None:
        extra.append(("Authorization", f"Bearer {key}"))
    if json_type if json_type is not None else method not in ("GET", "HEAD"):
        extra.append(JSON_TYPE)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if data is None and method not in ("GET", "HEAD"):
        data = b""
    conn = Conn(port, addr, timeout)
    try:
        conn.send(request_bytes(method, path, host=host, headers=[*extra, *(headers or [])], body=data))
        return conn.read_reply(head_only=method == "HEAD")
    finally:
        conn.close()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def port_of(server: Any) -> int:
    return int(server.url.rsplit(":", 1)[1])
