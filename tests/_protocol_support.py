"""What the Messages and Responses tests share: their servers, streams and SSE reading."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any, Iterator

from bmoe.modelmaker import make_model
from conftest import ServerProcess, start_server

def think_server_at(root: Path) -> Iterator[ServerProcess]:
    """A model whose template opens the reasoning span when thinking is on, so a thinking
    turn is all reasoning, whatever the random weights write."""
    model = make_model(root / "tiny-think.gguf", think_prefill=True)
    srv = start_server(root / "data", "-m", str(model), "-c", "1024")
    yield srv
    srv.stop()


def keyed_server_at(root: Path, model: Path, key: str) -> Iterator[ServerProcess]:
    """A small context (2048) behind `key`: full-context refusals and access errors."""
    key_file = root / "key"
    key_file.write_text(key + "\n")
    srv = start_server(root / "data", "-m", str(model), "-c", "2048",
                       "--api-key-file", str(key_file), wait_ready=False)
    srv.key = key
    srv.wait_state("ready")
    yield srv
    srv.stop()


def sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, data) for each event; comments as ("comment", text)."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line.startswith(": "):
                out.append(("comment", line[2:]))
        if name is not None or data is not None:
            out.append((name, data))
    return out


def open_stream(server: ServerProcess, path: str, body: dict[str, Any], *,
                key_header: str = "Authorization"
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST `body` to `path` and return the open response (the server's key, if it has
    one, in `key_header`: ``Authorization`` as a bearer token, or ``X-Api-Key``)."""
    host, port = server.url.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    if server.key:
        headers[key_header] = (f"Bearer {server.key}" if key_header == "Authorization"
                               else server.key)
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    return conn, conn.getresponse()


def wait_generating(server: ServerProcess, value: bool, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while server.info()["generating"] is not value:
        assert time.monotonic() < deadline, f"generating never became {value}"
        time.sleep(0.01)
