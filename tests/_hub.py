"""A local Hugging Face hub for the tests: HTTPS on a free port, the site's API shapes.

It answers what the server's client asks: the search (``/api/models?search=`` with
``expand[]``), the tree listing with LFS object ids, ``/<repo>/resolve/<rev>/<path>``
(a redirect to ``/cdn/...``, as the site redirects to its CDN) with ``HEAD`` and
``Range``, and ``401`` for a gated repository asked without its token. It serves files
the model maker wrote, and "virtual" files: a real header followed by zeros, as large as
the test says (a model larger than this machine, whose header alone is ever fetched).

Faults, per file path, so resume, retry, digests and timeouts are proven with real curl:
``drop_at`` (a fraction: the connection is closed there, ``times`` times), ``drop_after``
(bytes: each answer is cut that far into its body, ``times`` times, so a read resumed past
the first cut is cut again), ``stall_at`` (the answer stops there for ``stall_s``),
``wrong`` (every byte answered is corrupted), ``no_ranges`` (a range request gets the
whole file, ``200``), ``rate`` (bytes per second).
``sent`` counts the body bytes answered per path.

The certificate is made at start with the ``openssl`` command (self-signed, for
127.0.0.1); the server under test trusts it through ``--hf-ca-file``.
"""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hub-secret-token"


@dataclass
class HubFile:
    data: bytes                 # the bytes served (a virtual file: the header only)
    size: int                   # the size declared and served (zeros past ``data``)
    sha256: str

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file."""
        head = self.data[start:min(end, len(self.data))]
        return head + b"\0" * max(0, end - max(start, len(self.data)))


@dataclass
class Repo:
    files: dict[str, HubFile] = field(default_factory=dict)
    gated: bool = False
    downloads: int = 0
    likes: int = 0


class Hub:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.repos: dict[str, Repo] = {}
        self.faults: dict[str, dict[str, Any]] = {}
        self.sent: dict[str, int] = {}
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.cert, key = _make_cert(folder)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, key)
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.hub = self
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- content ---------------------------------------------------------------------

    def add_file(self, repo: str, path: str, source: Path | bytes, *, size: int = 0,
                 gated: bool = False, downloads: int = 0, likes: int = 0) -> HubFile:
        data = source.read_bytes() if isinstance(source, Path) else source
        full = size or len(data)
        digest = hashlib.sha256(data).hexdigest() if full == len(data) else \
            hashlib.sha256(data + b"\0" * (full - len(data))).hexdigest() if full < 1 << 26 \
            else hashlib.sha256(data).hexdigest()
        r = self.repos.setdefault(repo, Repo())
        r.gated = r.gated or gated
        r.downloads, r.likes = max(r.downloads, downloads), max(r.likes, likes)
        f = HubFile(data, full, digest)
        r.files[path] = f
        return f

    def fault(self, repo: str, path: str, **kw: Any) -> None:
        self.faults[f"{repo}/{path}"] = dict(kw)

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.sent.clear()
            self.requests.clear()

    def resolve_url(self, repo: str, path: str, rev: str = "main") -> str:
        return f"{self.url}/{repo}/resolve/{rev}/{path}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: Hub

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass   # a client that leaves mid-answer is expected here


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def hub(self) -> Hub:
        return self.server.hub

    def do_HEAD(self) -> None:
        self.route(head=True)

    def do_GET(self) -> None:
        self.route(head=False)

    def authorised(self) -> bool:
        return self.headers.get("Authorization", "") == f"Bearer {TOKEN}"

    def route(self, head: bool) -> None:
        u = urlsplit(self.path)
        parts = [unquote(p) for p in u.path.strip("/").split("/")]
        with self.hub.lock:
            self.hub.requests.append({"method": self.command, "path": u.path, "query": u.query,
                                      "range": self.headers.get("Range"),
                                      "auth": self.headers.get("Authorization")})
        if parts[:2] == ["api", "models"] and len(parts) == 2:
            return self.search(parse_qs(u.query))
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self.tree("/".join(parts[2:4]), parts[5])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        if parts[0] == "cdn" and len(parts) >= 4:
            return self.cdn("/".join(parts[1:3]), "/".join(parts[3:]), head)
        self.answer(404, {"error": "Not found"})

    def answer(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def search(self, q: dict[str, list[str]]) -> None:
        text = (q.get("search") or [""])[0].lower()
        with self.hub.lock:
            self.hub.requests[-1]["expand"] = q.get("expand[]", [])
        out = []
        for rid, r in sorted(self.hub.repos.items(), key=lambda kv: -kv[1].downloads):
            if text in rid.lower():
                out.append({"id": rid, "downloads": r.downloads, "likes": r.likes,
                            "lastModified": "2026-11-01T10:00:00.000Z",
                            "gated": "manual" if r.gated else False})
        self.answer(200, out[:int((q.get("limit") or ["20"])[0])])

    def repo_or_refuse(self, repo: str) -> Repo | None:
        r = self.hub.repos.get(repo)
        if r is None or (r.gated and not self.authorised()):
            self.answer(401, {"error": "Invalid username or password."})
            return None
        return r

    def tree(self, repo: str, rev: str) -> None:
        r = self.repo_or_refuse(repo)
        if r is None:
            return
        if rev != "main":
            return self.answer(404, {"error": f"Invalid rev id: {rev}"})
        items: list[dict[str, Any]] = [
            {"type": "file", "oid": "1" * 40, "size": 12, "path": "README.md"},
            {"type": "directory", "oid": "2" * 40, "size": 0, "path": "sub"}]
        for path, f in r.files.items():
            items.append({"type": "file", "oid": "3" * 40, "size": f.size, "path": path,
                          "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}})
        self.answer(200, items)

    def resolve(self, repo: str, rev: str, path: str) -> None:
        r = self.repo_or_refuse(repo)
        if r is None:
            return
        f = r.files.get(path)
        if f is None or rev != "main":
            return self.answer(404, {"error": "Entry not found"})
        self.send_response(302)
        self.send_header("Location", f"/cdn/{repo}/{path}")
        self.send_header("X-Linked-Size", str(f.size))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def cdn(self, repo: str, path: str, head: bool) -> None:
        r = self.hub.repos.get(repo)
        f = r.files.get(path) if r else None
        if f is None:
            return self.answer(404, {"error": "Entry not found"})
        fault = self.hub.faults.get(f"{repo}/{path}", {})
        start, end, status = 0, f.size, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and not fault.get("no_ranges"):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else 0
            end = min(f.size, int(b) + 1) if b else f.size
            if start >= f.size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{f.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "none" if fault.get("no_ranges") else "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        self.end_headers()
        if not head:
            self.body(f, start, end, f"{repo}/{path}", fault)

    def body(self, f: HubFile, start: int, end: int, key: str, fault: dict[str, Any]) -> None:
        drop = stall = None
        if fault.get("drop_at") is not None and fault.get("times", 1) > 0:
            drop = int(f.size * fault["drop_at"])
        if fault.get("drop_after") is not None and fault.get("times", 1) > 0:
            drop = start + fault["drop_after"]
        if fault.get("stall_at") is not None and fault.get("times", 1) > 0:
            stall = int(f.size * fault["stall_at"])
        rate = fault.get("rate", 0)
        pos = start
        t0 = time.monotonic()
        while pos < end:
            # with a rate, a chunk is at most a twentieth of a second's bytes and is held
            # back until its time: a file smaller than one chunk is slow too (written at
            # once, it would be whole at the client before the first sleep)
            n = min(65536, end - pos, max(1, rate // 20) if rate else 65536)
            for cut in (drop, stall):
                if cut is not None and pos < cut < pos + n:
                    n = cut - pos
            if rate:
                ahead = (pos + n - start) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            chunk = f.read(pos, pos + n)
            if fault.get("wrong"):
                chunk = bytes(b ^ 0x5A for b in chunk)
            try:
                self.wfile.write(chunk)
                self.wfile.flush()
            except OSError:
                return
            pos += n
            with self.hub.lock:
                self.hub.sent[key] = self.hub.sent.get(key, 0) + n
            if pos == drop:
                fault["times"] = fault.get("times", 1) - 1
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if pos == stall:
                fault["times"] = fault.get("times", 1) - 1
                time.sleep(fault.get("stall_s", 5))
                return


def _make_cert(folder: Path) -> tuple[str, str]:
    cert, key = folder / "hub-cert.pem", folder / "hub-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)
