"""An MCP server for the tests, written with the official SDK (`MCPServer`, stdio).

`python mcp_test_server.py [mode]`: mode `good` (the default) serves the tools below;
`hang-init` never answers `initialize`; `garbage` writes lines that are not JSON-RPC
and nothing else; `die` exits at once with status 7; `http PORT` and `sse PORT` serve
the same tools over streamable HTTP (`/mcp`) or SSE (`/sse`) on 127.0.0.1. The tools misbehave on demand:
`hang` never answers, `crash` exits mid-call, `garbage` writes non-JSON lines on stdout,
`flood` writes a stdout line with no end and megabytes on stderr.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

app = MCPServer("bmoe-test")
WIRE = os.dup(1)     # the SDK moves the protocol off fd 1; this stays the pipe bmoe reads


@app.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return f"{a} + {b} = {a + b} (pid {os.getpid()})"


@app.tool()
def hang(seconds: int = 3600) -> str:
    """Never answers (sleeps)."""
    time.sleep(seconds)
    return "woke up"


@app.tool()
def crash() -> str:
    """Exits in the middle of the call."""
    sys.stderr.write("about to crash on purpose\n")
    sys.stderr.flush()
    os._exit(3)


@app.tool()
def garbage() -> str:
    """Writes lines that are not MCP messages on stdout."""
    for i in range(100):
        os.write(WIRE, f"this is not json {i}\n".encode())
    time.sleep(3600)
    return "unreachable"


@app.tool()
def flood() -> str:
    """Megabytes on stderr, then a stdout line that never ends."""
    chunk = b"e" * 65536
    for _ in range(64):
        os.write(2, chunk)
    chunk = b"x" * 65536
    for _ in range(200):
        os.write(WIRE, chunk)
    time.sleep(3600)
    return "unreachable"


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "good"
    if mode == "hang-init":
        time.sleep(3600)
    elif mode == "garbage":
        for i in range(1000):
            print(f"hello, I am not an MCP server ({i})", flush=True)
        time.sleep(3600)
    elif mode == "die":
        sys.stderr.write("cannot start: no configuration\n")
        sys.exit(7)
    elif mode in ("http", "sse"):                  # `http PORT`: streamable HTTP at /mcp
        port = int(sys.argv[2])
        if mode == "http":
            app.run("streamable-http", host="127.0.0.1", port=port)
        else:
            app.run("sse", host="127.0.0.1", port=port)
        return
    app.run("stdio")


if __name__ == "__main__":
    main()
