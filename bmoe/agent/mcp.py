"""MCP servers (`docs/agent.md`, "MCP servers"): other programs' tools, offered to the model.

Theory of operation
-------------------
`<data>/mcp.json` (or the file `--mcp-servers-config` names) lists the servers in the
`{"mcpServers": {...}}` format Claude Desktop and Claude Code read: a stdio server is a
command with args, env and cwd; an HTTP server is a url with headers (`type` "http",
streamable HTTP, or "sse"). `parse_config` checks it without I/O: a file that is not
that shape is refused whole (`McpServers.config_error`), an entry that is wrong is a
server in state `failed` saying why; the rest run.

Each server has one supervisor task in the agent service's nursery. It sleeps until the
server is first wanted (a conversation needs the tool list, `GET /api/agent`, a
restart), then holds one session at a time: the transport (our own stdio pipe pump for
a command, the SDK's streamable HTTP or SSE client for a url), the SDK's
`ClientSession`, `initialize` and `tools/list` under `MCP_START_TIMEOUT_S`, then
`running` until the session ends: the process exits, its stdout is garbage or floods
a line past `MCP_LINE_MAX_BYTES`, a call outlives the server's time limit, or a restart
is asked for. Then `failed` with a sentence for the person, and a new session after a
back-off (1 s, 2 s, 4 s, ... `MCP_BACKOFF_MAX_S`; a restart asked for skips the wait).

A call (`McpServers.call`) runs in the conversation's task against the running
session under `trio.fail_after(timeout)`; it never waits for a server that is not
up longer than `MCP_START_TIMEOUT_S`. Its result's text becomes the tool item's output
(images, audio and resources summarized as a line each), cut at `MCP_OUTPUT_CHARS`.

The model sees each tool as `mcp__<server>__<tool>` (Claude Code's naming) with its
input schema checked by the same grammar machinery as any tool's (`grammar.
normalize_schema`: depth, bounds, references, the grammar guard) and capped in size; a
tool whose schema is refused is left out, with a line in the server's `error`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
import httpx2
import trio
from pydantic import ValidationError

from .. import __version__
from ..engine import grammar
from ..server.chatreq import MAX_SCHEMA_DEPTH, nesting_depth

# The MCP SDK takes most of a second to import, and every server start would pay it: its
# modules are imported where a server is started, called or read (the functions below).
if TYPE_CHECKING:
    import mcp_types as types
    from mcp import ClientSession

log = logging.getLogger("bmoe.agent.mcp")

MCP_CALL_TIMEOUT_S = 60.0          # one tool call, unless the server's entry sets `timeout`
MCP_TIMEOUT_MAX_S = 600.0          # the longest `timeout` an entry may set
MCP_START_TIMEOUT_S = 20.0         # spawn or connect, initialize and list the tools
MCP_BACKOFF_MIN_S = 1.0            # the first wait before a failed server is started again
MCP_BACKOFF_MAX_S = 60.0           # the longest; a session that lasted this long resets it
MCP_STOP_GRACE_S = 2.0             # a stdio server's time to exit once its stdin closes
MCP_LINE_MAX_BYTES = 8 * 2**20     # one message line on a stdio server's stdout
MCP_GARBAGE_MAX = 20               # lines in a row that are not JSON-RPC before it fails
MCP_STDERR_TAIL_BYTES = 4096       # what is kept of a server's stderr (its last words)
MCP_OUTPUT_CHARS = 64 * 1024       # a call's output as the model sees it (head and tail)
MCP_SERVERS_MAX = 32               # servers one config may list
MCP_TOOLS_MAX = 64                 # tools taken from one server
MCP_OFFERED_MAX = 128              # MCP tools offered to the model in all
MCP_SCHEMA_MAX_BYTES = 16 * 1024   # one tool's input schema, as JSON
MCP_DESCRIPTION_MAX_CHARS = 1024   # one tool's description, as offered
MCP_CONFIG_MAX_BYTES = 2**20       # mcp.json
MCP_LIST_PAGES_MAX = 10            # tools/list pages read
QUALIFIED_MAX_CHARS = 64           # a tool's name as offered (OpenAI's and Anthropic's limit)

NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_)){0,31}\Z")   # no "__": it separates
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
PREFIX = "mcp__"
STATES = ("stopped", "starting", "running", "failed")


class ConfigError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class McpCallError(Exception):
    """A call that did not give a result; `message` is a sentence for the tool item."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Ended(Exception):
    """The session ended; `reason` says why (None: a restart was asked for)."""


# -- the config file (no I/O) ---------------------------------------------------------

@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: str                      # "stdio" or "http"
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    sse: bool = False
    timeout: float = MCP_CALL_TIMEOUT_S
    problem: str | None = None          # the entry cannot run: why


def _str_map(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise ConfigError(f"`{what}` must be an object of strings.")
    if any("\x00" in k + v or "=" in k and what == "env" for k, v in value.items()):
        raise ConfigError(f"`{what}` holds a name or value that cannot be used.")
    return tuple(value.items())


def _entry(name: str, raw: Any) -> ServerConfig:
    if not isinstance(raw, dict):
        raise ConfigError("The entry must be a JSON object.")
    kind = raw.get("type", "stdio" if "command" in raw else "http")
    timeout = raw.get("timeout", MCP_CALL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 1 <= timeout <= MCP_TIMEOUT_MAX_S:
        raise ConfigError(f"`timeout` must be a number of seconds from 1 to "
                          f"{MCP_TIMEOUT_MAX_S:.0f}.")
    if kind == "stdio":
        command, args, cwd = raw.get("command"), raw.get("args", []), raw.get("cwd")
        if not isinstance(command, str) or not command.strip() or "\x00" in command:
            raise ConfigError("`command` must name the program to run.")
        if not isinstance(args, list) or not all(isinstance(a, str) and "\x00" not in a
                                                 for a in args):
            raise ConfigError("`args` must be a list of strings.")
        if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
            raise ConfigError("`cwd` must be an absolute path to a folder.")
        return ServerConfig(name, "stdio", command=command, args=tuple(args),
                            env=_str_map(raw.get("env"), "env"), cwd=cwd, timeout=float(timeout))
    if kind in ("http", "streamable-http", "sse"):
        url = raw.get("url")
        if not isinstance(url, str) or not re.match(r"https?://[^\s/]+", url):
            raise ConfigError("`url` must be an http or https URL.")
        return ServerConfig(name, "http", url=url, headers=_str_map(raw.get("headers"), "headers"),
                            sse=kind == "sse", timeout=float(timeout))
    raise ConfigError("`type` must be \"stdio\", \"http\" or \"sse\".")


def parse_config(text: str) -> dict[str, ServerConfig]:
    """The servers a config lists; an entry that cannot run has its `problem` set.
    ConfigError for a file that is not `{"mcpServers": {...}}` at all."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"It is not valid JSON (line {getattr(e, 'lineno', '?')}).") from None
    servers = raw.get("mcpServers") if isinstance(raw, dict) else None
    if not isinstance(servers, dict):
        raise ConfigError('It must be a JSON object with an "mcpServers" object in it.')
    if len(servers) > MCP_SERVERS_MAX:
        raise ConfigError(f"It lists {len(servers)} servers; at most {MCP_SERVERS_MAX} are run.")
    out: dict[str, ServerConfig] = {}
    for name, entry in servers.items():
        if not NAME_RE.match(name):
            raise ConfigError(f"The server name {name[:40]!r} is not allowed: use letters, "
                              "digits, `-` and single `_`, at most 32.")
        try:
            out[name] = _entry(name, entry)
        except ConfigError as e:
            transport = "stdio" if isinstance(entry, dict) and "command" in entry else "http"
            out[name] = ServerConfig(name, transport, problem=f"Its entry in the MCP config "
                                     f"cannot be used: {e.message}")
    return out


def read_config(path: Path) -> dict[str, ServerConfig]:
    """The file's servers; none when it does not exist. ConfigError otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(MCP_CONFIG_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"It could not be read ({e.strerror or 'refused'}).") from None
    if len(data) > MCP_CONFIG_MAX_BYTES:
        raise ConfigError(f"It is larger than {MCP_CONFIG_MAX_BYTES // 1024} KiB.")
    return parse_config(data.decode("utf-8", "replace"))


# -- tools and results (no I/O) ----------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    server: str
    name: str
    description: str
    schema: dict[str, Any]

    @property
    def qualified(self) -> str:
        return f"{PREFIX}{self.server}__{self.name}"

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.qualified, "description": self.description, "parameters": self.schema}}


def bounded_tool(server: str, raw: types.Tool) -> Tool:
    """The tool as offered, or ValueError saying why it cannot be."""
    if not TOOL_NAME_RE.match(raw.name):
        raise ValueError(f"the tool name {raw.name[:40]!r} is not letters, digits, `_` and `-`")
    if len(PREFIX) + len(server) + 2 + len(raw.name) > QUALIFIED_MAX_CHARS:
        raise ValueError(f"the tool name {raw.name} is too long: with the server's name it "
                         f"passes {QUALIFIED_MAX_CHARS} characters")
    schema = raw.input_schema or {"type": "object"}
    size = len(json.dumps(schema))
    if size > MCP_SCHEMA_MAX_BYTES:
        raise ValueError(f"the tool {raw.name} has an input schema of {size} bytes (at most "
                         f"{MCP_SCHEMA_MAX_BYTES})")
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the tool {raw.name}'s input schema nests too deeply")
    try:
        checked = grammar.normalize_schema(schema, f"the tool {raw.name}'s input schema")
    except RecursionError:
        raise ValueError(f"the tool {raw.name}'s input schema nests too deeply") from None
    if checked.get("type") != "object":
        raise ValueError(f"the tool {raw.name}'s input schema does not describe an object")
    desc = (raw.description or raw.title or "")[:MCP_DESCRIPTION_MAX_CHARS]
    return Tool(server, raw.name, desc, checked)


def _clip(text: str, limit: int = MCP_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return (text[:half] + f"\n…({len(text) - 2 * half} characters of output not shown)…\n"
            + text[-half:])


def render(result: types.CallToolResult) -> tuple[bool, str]:
    """(the call succeeded, its output as text for the model)."""
    import mcp_types as types
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.ImageContent):
            parts.append(f"[an image, {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif isinstance(block, types.AudioContent):
            parts.append(f"[audio, {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[a resource: {block.uri}" + (f", {block.name}" if block.name else "") + "]")
        elif isinstance(block, types.EmbeddedResource):
            res = block.resource
            if isinstance(res, types.TextResourceContents):
                parts.append(f"[resource {res.uri}]\n{res.text}")
            else:
                parts.append(f"[resource {res.uri}: {res.mime_type or 'binary'} data]")
        else:
            parts.append(f"[{getattr(block, 'type', 'unknown')} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = _clip("\n".join(parts).replace("\x00", ""))
    if result.is_error:
        return False, "The tool reported an error: " + (text or "(no details)")
    return True, text or "(no output)"


# -- the stdio transport ---------------------------------------------------------------

class Tail:
    """The last bytes of a stream (a server's stderr)."""

    def __init__(self) -> None:
        self.data = b""

    def add(self, chunk: bytes | bytearray) -> None:
        self.data = (self.data + bytes(chunk))[-MCP_STDERR_TAIL_BYTES:]

    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.data.decode("utf-8", "replace").splitlines()]
        last = next((ln for ln in reversed(lines) if ln), "")
        return last[:300]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@asynccontextmanager
async def stdio_transport(cfg: ServerConfig, end: Callable[[str], None],
                          tail: Tail) -> AsyncIterator[tuple[Any, Any]]:
    """The server's process (a new process group) and the two message streams the
    session reads and writes. Lines are JSON-RPC messages, one at most
    `MCP_LINE_MAX_BYTES`; a line that is not one is skipped, `MCP_GARBAGE_MAX` in a row
    end the session, as does the end of stdout. The group is killed on the way out."""
    import mcp_types as types
    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage
    env = get_default_environment() | dict(cfg.env)
    proc = await trio.lowlevel.open_process(
        [cfg.command, *cfg.args], cwd=cfg.cwd, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)

    async def exited() -> str:
        with trio.move_on_after(1.0):
            await proc.wait()
        said = tail.last_line()
        status = proc.returncode
        how = ("Its process ended" + (f" with exit status {status}" if status is not None and
                                      status >= 0 else
                                      f" on signal {-status}" if status is not None else ""))
        return how + (f"; its last words: {said}" if said else "") + "."

    async def read() -> None:
        buf, garbage = bytearray(), 0
        assert proc.stdout is not None
        async with to_session:
            try:
                async for chunk in proc.stdout:
                    buf += chunk
                    while (i := buf.find(b"\n")) >= 0:
                        line = bytes(buf[:i])
                        del buf[:i + 1]
                        if not line.strip():
                            continue
                        try:
                            msg = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                        except ValueError:
                            garbage += 1
                            if garbage >= MCP_GARBAGE_MAX:
                                return end(f"It wrote {garbage} lines in a row on its output "
                                           "that are not MCP messages.")
                            continue
                        garbage = 0
                        await to_session.send(SessionMessage(msg))
                    if len(buf) > MCP_LINE_MAX_BYTES:
                        return end(f"It wrote a line longer than {MCP_LINE_MAX_BYTES // 2**20} "
                                   "MiB on its output.")
            except (trio.BrokenResourceError, trio.ClosedResourceError,
                    anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            end(await exited())

    async def write() -> None:
        assert proc.stdin is not None
        async with from_session:
            try:
                async for m in from_session:
                    data = m.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await proc.stdin.send_all(data.encode())
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                end(await exited())

    async def errors() -> None:
        assert proc.stderr is not None
        try:
            async for chunk in proc.stderr:
                tail.add(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(write)
            nursery.start_soon(errors)
            try:
                yield from_server, to_server
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await _stop_process(proc)


async def _stop_process(proc: trio.Process) -> None:
    """Close stdin, give the server `MCP_STOP_GRACE_S` to leave, then kill its group."""
    if proc.stdin is not None:
        await proc.stdin.aclose()
    with trio.move_on_after(MCP_STOP_GRACE_S):
        await proc.wait()
    _kill_group(proc.pid)
    await proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            await stream.aclose()


@asynccontextmanager
async def http_transport(cfg: ServerConfig) -> AsyncIterator[tuple[Any, Any]]:
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client
    headers = dict(cfg.headers)
    if cfg.sse:
        async with sse_client(cfg.url, headers=headers, timeout=MCP_START_TIMEOUT_S) as streams:
            yield streams[0], streams[1]
        return
    timeout = httpx2.Timeout(MCP_START_TIMEOUT_S, read=max(cfg.timeout, MCP_START_TIMEOUT_S))
    async with httpx2.AsyncClient(headers=headers, timeout=timeout) as client:
        async with streamable_http_client(cfg.url, http_client=client) as streams:
            yield streams[0], streams[1]


# -- one server -------------------------------------------------------------------------

def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _failure(cfg: ServerConfig, exc: BaseException) -> str:
    """A sentence for a session that failed with `exc` (never the exception's own text)."""
    import mcp_types as types
    from mcp.shared.exceptions import MCPError
    for e in _leaves(exc):
        if isinstance(e, Ended) and e.args and e.args[0]:
            return str(e.args[0])
        if isinstance(e, FileNotFoundError) and cfg.transport == "stdio":
            return f"Its command {cfg.command!r} was not found."
        if isinstance(e, PermissionError) and cfg.transport == "stdio":
            return f"Its command {cfg.command!r} may not be run (permission denied)."
        if isinstance(e, (httpx2.HTTPError, OSError)) and cfg.transport == "http":
            return f"{cfg.url} could not be reached or did not answer as an MCP server."
        if isinstance(e, MCPError):
            if e.code == types.CONNECTION_CLOSED:
                return "It closed the connection while starting."
            return f"It refused to start: {e.error.message[:300]}"
        if isinstance(e, (ValidationError, ValueError, RuntimeError)):
            return "It answered with messages that are not valid MCP."
    return "It failed because of an error in bmoe; the server's log has the details."


class Server:
    def __init__(self, cfg: ServerConfig, changed: Callable[[Server], None]) -> None:
        self.cfg = cfg
        self.state = "failed" if cfg.problem else "stopped"
        self.error: str | None = cfg.problem
        self.tools: list[Tool] = []
        self.restarts = 0
        self.session: ClientSession | None = None
        self._changed_cb = changed
        self._changed = trio.Event()
        self._wanted = trio.Event()
        self._wake = trio.Event()          # a restart asked for: skip the back-off
        self._end = trio.Event()           # the current session should end
        self._end_reason: str | None = None
        self.next_start = 0.0              # trio time of the next start after a failure
        self.settled = bool(cfg.problem)   # its first start has run or failed
        self.tail = Tail()

    def entry(self) -> dict[str, Any]:
        return {"name": self.cfg.name, "transport": self.cfg.transport, "state": self.state,
                "error": self.error, "restarts": self.restarts,
                "tools": [{"name": t.qualified, "description": t.description} for t in self.tools]}

    def _set(self, state: str, error: str | None) -> None:
        """A new state: waiters wake; an `mcp` event when it differs from the last."""
        same = (state, error) == (self.state, self.error)
        self.settled = self.settled or state in ("running", "failed")
        self.state, self.error = state, error
        self._changed.set()
        self._changed = trio.Event()
        if not same:
            self._changed_cb(self)

    def want(self) -> None:
        if not self.cfg.problem:
            self._wanted.set()

    def end(self, reason: str | None) -> None:
        """End the current session (`reason` None: a restart, not a failure); no call
        uses it from now on."""
        if not self._end.is_set():
            self._end_reason = reason
            self._end.set()
            self.session = None
            if reason and self.state in ("starting", "running"):
                self._set("failed", reason)

    def restart(self) -> None:
        self.want()
        self.end(None)
        self._wake.set()

    async def ready(self, *, through_failure: bool = False) -> None:
        """Start the server if it is not, and wait (at most `MCP_START_TIMEOUT_S`) until it
        runs or has failed; `through_failure`: until it runs again, when its next start
        comes within that time."""
        self.want()
        with trio.move_on_after(MCP_START_TIMEOUT_S + 1.0):     # its spawn, then the start
            while self.state != "running" and not self.cfg.problem:
                if self.state == "failed" and not (
                        through_failure and
                        self.next_start - trio.current_time() < MCP_START_TIMEOUT_S / 2):
                    return
                await self._changed.wait()

    # -- the supervisor ------------------------------------------------------------------

    async def supervise(self) -> None:
        if self.cfg.problem:
            return
        await self._wanted.wait()
        delay = MCP_BACKOFF_MIN_S
        first = True
        while True:
            if not first:
                self.restarts += 1
            first = False
            self._end, self._end_reason, self._wake = trio.Event(), None, trio.Event()
            self.tail = Tail()
            self._set("starting", None)
            began = trio.current_time()
            try:
                await self._session()
                failed = None
            except Exception as e:  # noqa: BLE001 - every failure becomes the server's error
                failed = self._end_reason or _failure(self.cfg, e)
                if failed.endswith("the server's log has the details."):
                    log.exception("MCP server %s failed", self.cfg.name)
            self.session, self.tools = None, []
            if failed is None:                 # a restart asked for
                delay = MCP_BACKOFF_MIN_S
                continue
            if trio.current_time() - began >= MCP_BACKOFF_MAX_S:
                delay = MCP_BACKOFF_MIN_S
            self.next_start = trio.current_time() + delay
            self._set("failed", failed)
            with trio.move_on_after(delay):
                await self._wake.wait()
            delay = min(delay * 2, MCP_BACKOFF_MAX_S)

    def _transport(self) -> Any:
        if self.cfg.transport == "stdio":
            return stdio_transport(self.cfg, self.end, self.tail)
        return http_transport(self.cfg)

    async def _session(self) -> None:
        import mcp_types as types
        from mcp import ClientSession
        info = types.Implementation(name="bmoe", version=__version__)
        async with self._transport() as (read, write):
            async with ClientSession(read, write, client_info=info) as session:
                with trio.move_on_after(MCP_START_TIMEOUT_S) as start:
                    await session.initialize()
                    listed = await self._list(session)
                if start.cancelled_caught:
                    self.end(f"It did not start and list its tools within "
                             f"{MCP_START_TIMEOUT_S:.0f} s.")
                    raise Ended(self._end_reason)
                self.tools, skipped = [], []
                for raw in listed[:MCP_TOOLS_MAX]:
                    try:
                        self.tools.append(bounded_tool(self.cfg.name, raw))
                    except ValueError as e:
                        skipped.append(str(e))
                note = None
                if len(listed) > MCP_TOOLS_MAX:
                    skipped.append(f"{len(listed) - MCP_TOOLS_MAX} tools past the first "
                                   f"{MCP_TOOLS_MAX}")
                if skipped:
                    note = "Some tools are not offered: " + "; ".join(skipped)[:1000] + "."
                self.session = session
                self._set("running", note)
                await self._end.wait()
                self.session = None
        if self._end_reason:
            raise Ended(self._end_reason)

    async def _list(self, session: ClientSession) -> list[types.Tool]:
        import mcp_types as types
        out: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(MCP_LIST_PAGES_MAX):
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            out += page.tools
            cursor = page.next_cursor
            if not cursor or len(out) > MCP_TOOLS_MAX:
                break
        return out

    # -- a call -------------------------------------------------------------------------

    async def call(self, tool: str, args: dict[str, Any]) -> tuple[bool, str]:
        import mcp_types as types
        from mcp.shared.exceptions import MCPError
        name = self.cfg.name
        await self.ready(through_failure=True)
        session = self.session
        if session is None or self.state != "running":
            why = self.error or f"it did not start within {MCP_START_TIMEOUT_S:.0f} s."
            raise McpCallError(f"The MCP server {name} is not running: {why}")
        limit = self.cfg.timeout
        try:
            with trio.fail_after(limit):
                result = await session.call_tool(tool, args)
        except trio.TooSlowError:
            self.end(f"It did not answer a call of {tool} within {limit:.0f} s.")
            raise McpCallError(f"The MCP server {name} did not answer within {limit:.0f} s, "
                               "its time limit; the call was given up and the server is "
                               "restarted.") from None
        except MCPError as e:
            if e.code == types.CONNECTION_CLOSED:
                with trio.move_on_after(1.0):        # the transport says why
                    while self.state == "running":
                        await self._changed.wait()
                why = self.error or self._end_reason or "it closed the connection."
                raise McpCallError(f"The MCP server {name} stopped during the call: {why}") \
                    from None
            raise McpCallError(f"The MCP server {name} refused the call: "
                               f"{e.error.message[:500]}") from None
        except (ValidationError, ValueError, RuntimeError):
            raise McpCallError(f"The MCP server {name} answered with something that is not "
                               "a tool result.") from None
        return render(result)


# -- all of them -------------------------------------------------------------------------

@dataclass
class McpServers:
    path: Path
    publish: Callable[[dict[str, Any]], None]
    servers: dict[str, Server] = field(default_factory=dict)
    config_error: str | None = None

    def load(self) -> None:
        """Read the config (worker thread, at start)."""
        try:
            configs = read_config(self.path)
        except ConfigError as e:
            self.config_error = f"The MCP servers' config {self.path.name} is not used: {e.message}"
            configs = {}
        self.servers = {n: Server(c, self._changed) for n, c in configs.items()}

    def _changed(self, server: Server) -> None:
        self.publish(server.entry())

    async def run(self) -> None:
        """Every server's supervisor (each sleeps until the server is wanted)."""
        async with trio.open_nursery() as nursery:
            for server in self.servers.values():
                nursery.start_soon(server.supervise)

    def listing(self) -> list[dict[str, Any]]:
        return [s.entry() for s in self.servers.values()]

    def want_all(self) -> None:
        for s in self.servers.values():
            s.want()

    async def specs(self) -> list[dict[str, Any]]:
        """The tools to offer, once every server's first start has run or failed (or
        taken `MCP_START_TIMEOUT_S`); a server starting again is not waited for."""
        self.want_all()
        async with trio.open_nursery() as nursery:
            for s in self.servers.values():
                if not s.settled:
                    nursery.start_soon(s.ready)
        tools = [t for s in self.servers.values() if s.state == "running" for t in s.tools]
        return [t.spec() for t in tools[:MCP_OFFERED_MAX]]

    def find(self, qualified: str) -> tuple[Server, str] | None:
        if not qualified.startswith(PREFIX):
            return None
        server_name, sep, tool = qualified[len(PREFIX):].partition("__")
        server = self.servers.get(server_name)
        return (server, tool) if sep and server is not None else None
