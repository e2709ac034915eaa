"""The agent's tools: what each offers the model, and what each does.

File tools are plain functions (the service runs them on a worker thread); the shell
command is async, so a stop cancels it and the whole process group is killed. Every
result is text for the model, capped, and says when it was cut.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

from .paths import ToolError, resolve, shown

LIST_MAX_ENTRIES = 1000          # entries a listing shows
READ_MAX_LINES = 2000            # lines a read returns
READ_MAX_BYTES = 256 * 1024      # bytes a read takes from the file
READ_MAX_LINE_CHARS = 2000       # one line is cut past this
READ_SCAN_MAX_BYTES = 64 * 2**20  # how far a read walks to reach its first line
SEARCH_MAX_FILES = 20_000        # files the fallback search opens
SEARCH_MAX_FILE_BYTES = 2**20    # bytes it reads of each
SEARCH_MAX_MATCHES = 200         # matches a search returns
SEARCH_TIME_S = 10.0             # a search's time limit
EXEC_DEFAULT_S = 120.0           # a command's default time limit
EXEC_MAX_S = 600.0               # the longest it may ask for
EXEC_OUTPUT_BYTES = 64 * 1024    # output kept (head and tail halves)
WRITE_MAX_BYTES = 8 * 2**20      # what one write may put in a file

READ_TOOLS = ("list_files", "read_file", "search_files")
WRITE_TOOLS = ("write_file", "edit_file", "exec_shell_command")


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


_PATH = {"type": "string", "description": "a path relative to the workspace"}

SPECS: dict[str, dict[str, Any]] = {
    "list_files": _fn("list_files", "List a folder of the workspace (folders end with /).",
                      {"path": _PATH}, []),
    "read_file": _fn("read_file", "Read a text file's lines, numbered. Use offset and limit "
                     "for a part of a long file.",
                     {"path": _PATH, "offset": {"type": "integer", "description": "first line, from 1"},
                      "limit": {"type": "integer", "description": "number of lines"}}, ["path"]),
    "search_files": _fn("search_files", "Search the workspace's files for a regular expression; "
                        "answers file:line:text.",
                        {"pattern": {"type": "string"}, "path": _PATH,
                         "glob": {"type": "string", "description": "only files matching, e.g. *.py"}},
                        ["pattern"]),
    "write_file": _fn("write_file", "Create or replace a file with the given content.",
                      {"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    "edit_file": _fn("edit_file", "Replace the one exact occurrence of old_text in a file with "
                     "new_text.", {"path": _PATH, "old_text": {"type": "string"},
                                   "new_text": {"type": "string"}},
                     ["path", "old_text", "new_text"]),
    "exec_shell_command": _fn("exec_shell_command", "Run a shell command in the workspace; "
                              "answers its output and exit status.",
                              {"command": {"type": "string"},
                               "timeout_s": {"type": "integer", "description": "time limit in seconds"}},
                              ["command"]),
}


def offered(mode: str, has_workspace: bool, commands: bool = True) -> list[dict[str, Any]]:
    """The tools a conversation offers the model."""
    if not has_workspace:
        return []
    names = list(READ_TOOLS) if mode == "read" else [*READ_TOOLS, *WRITE_TOOLS]
    if not commands:
        names = [n for n in names if n != "exec_shell_command"]
    return [SPECS[n] for n in names]


def _str(args: dict[str, Any], key: str, default: str | None = None) -> str:
    value = args.get(key, default)
    if not isinstance(value, str):
        raise ToolError(f"`{key}` must be a string.")
    return value


def _int(args: dict[str, Any], key: str, default: int) -> int:
    value = args.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError(f"`{key}` must be an integer.")
    return int(value)


# -- read-only tools ------------------------------------------------------------------

def list_files(root: Path, args: dict[str, Any]) -> str:
    folder = resolve(root, _str(args, "path", "."))
    if not folder.is_dir():
        raise ToolError(f"{shown(root, folder)} is not a folder.")
    entries = []
    with os.scandir(folder) as it:
        for i, e in enumerate(it):
            if i >= LIST_MAX_ENTRIES:
                entries.append(f"(more entries not shown: the listing stops at {LIST_MAX_ENTRIES})")
                break
            entries.append(e.name + ("/" if e.is_dir() else ""))
    return "\n".join(sorted(entries[:LIST_MAX_ENTRIES]) + entries[LIST_MAX_ENTRIES:]) or "(empty folder)"


def read_file(root: Path, args: dict[str, Any]) -> str:
    path = resolve(root, _str(args, "path"))
    if not path.is_file():
        raise ToolError(f"{shown(root, path)} is not a file.")
    first = max(1, _int(args, "offset", 1))
    limit = min(max(1, _int(args, "limit", READ_MAX_LINES)), READ_MAX_LINES)
    size = path.stat().st_size
    out: list[str] = []
    taken = scanned = 0
    cut = ""
    with open(path, "rb") as f:
        for _ in range(first - 1):
            line = f.readline(READ_MAX_BYTES)
            scanned += len(line)
            if not line:
                return f"(the file has fewer than {first} lines)"
            if scanned > READ_SCAN_MAX_BYTES:
                raise ToolError(f"Line {first} is too far into this {size}-byte file to reach; "
                                "search for what you need instead.")
        n = first
        while len(out) < limit:
            line = f.readline(READ_MAX_BYTES - taken + 1)
            if not line:
                break
            taken += len(line)
            if taken > READ_MAX_BYTES:
                cut = f"(cut: a read returns at most {READ_MAX_BYTES // 1024} KiB)"
                break
            text = line.decode("utf-8", "replace").rstrip("\n")
            if len(text) > READ_MAX_LINE_CHARS:
                text = text[:READ_MAX_LINE_CHARS] + " …(line cut)"
            out.append(f"{n:6}\t{text.replace(chr(0), '')}")
            n += 1
        else:
            if f.read(1):
                cut = f"(more lines follow: continue with offset {n})"
    if cut:
        out.append(cut)
    return "\n".join(out) if out else "(empty file)"


def search_files(root: Path, args: dict[str, Any]) -> str:
    pattern = _str(args, "pattern")
    base = resolve(root, _str(args, "path", "."))
    glob = args.get("glob")
    if glob is not None and not isinstance(glob, str):
        raise ToolError("`glob` must be a string.")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ToolError(f"The pattern is not a valid regular expression: {e.msg}.") from None
    rg = shutil.which("rg")
    lines = _search_rg(rg, root, base, pattern, glob) if rg else _search_walk(root, base, rx, glob)
    if not lines:
        return "(no matches)"
    if len(lines) > SEARCH_MAX_MATCHES:
        lines = lines[:SEARCH_MAX_MATCHES] + [f"(more matches not shown: at most {SEARCH_MAX_MATCHES})"]
    return "\n".join(lines)


def _search_rg(rg: str, root: Path, base: Path, pattern: str, glob: str | None) -> list[str]:
    cmd = [rg, "--no-heading", "--line-number", "--color", "never", "--max-columns", "300",
           "--max-filesize", "1M", "--no-follow", "-e", pattern]
    if glob:
        cmd += ["--glob", glob]
    cmd.append(str(base))
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=SEARCH_TIME_S, cwd=root)
    except subprocess.TimeoutExpired:
        raise ToolError(f"The search took longer than {SEARCH_TIME_S:.0f} s; narrow it.") from None
    text = done.stdout[: SEARCH_MAX_MATCHES * 400].decode("utf-8", "replace")
    real = os.path.realpath(root) + os.sep
    return [ln.removeprefix(real) for ln in text.splitlines()][: SEARCH_MAX_MATCHES + 1]


def _search_walk(root: Path, base: Path, rx: re.Pattern[str], glob: str | None) -> list[str]:
    deadline = time.monotonic() + SEARCH_TIME_S
    found: list[str] = []
    files = 0
    paths = [base] if base.is_file() else None
    walker = ((str(base.parent), [], [base.name]) for _ in [0]) if paths else \
        os.walk(base, followlinks=False)
    for folder, dirs, names in walker:
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "node_modules")
        for name in sorted(names):
            if glob and not fnmatch.fnmatch(name, glob):
                continue
            files += 1
            if files > SEARCH_MAX_FILES or time.monotonic() > deadline:
                found.append("(the search stopped early: too many files; narrow it with path or glob)")
                return found
            p = Path(folder) / name
            if p.is_symlink():
                continue
            try:
                with open(p, "rb") as f:
                    data = f.read(SEARCH_MAX_FILE_BYTES)
            except OSError:
                continue
            if b"\x00" in data[:8192]:
                continue
            for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if rx.search(line):
                    found.append(f"{shown(root, p)}:{i}:{line[:300]}")
                    if len(found) > SEARCH_MAX_MATCHES:
                        return found
    return found


# -- writing tools ------------------------------------------------------------------

def write_file(root: Path, args: dict[str, Any]) -> str:
    path = resolve(root, _str(args, "path"))
    content = _str(args, "content")
    data = content.encode("utf-8", "surrogatepass")
    if len(data) > WRITE_MAX_BYTES:
        raise ToolError(f"The content is larger than {WRITE_MAX_BYTES // 2**20} MiB.")
    if path.is_dir():
        raise ToolError(f"{shown(root, path)} is a folder.")
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    path.write_bytes(data)
    return f"{'Replaced' if existed else 'Created'} {shown(root, path)} ({len(data)} bytes)."


def edit_file(root: Path, args: dict[str, Any]) -> str:
    path = resolve(root, _str(args, "path"))
    old, new = _str(args, "old_text"), _str(args, "new_text")
    if not path.is_file():
        raise ToolError(f"{shown(root, path)} is not a file.")
    if not old:
        raise ToolError("`old_text` must not be empty; use write_file to create a file.")
    if path.stat().st_size > WRITE_MAX_BYTES:
        raise ToolError(f"The file is larger than {WRITE_MAX_BYTES // 2**20} MiB; it is not edited.")
    text = path.read_bytes().decode("utf-8", "surrogateescape")
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_text was not found in {shown(root, path)}; read the file and copy "
                        "the text exactly, spaces and line breaks included.")
    if count > 1:
        raise ToolError(f"old_text occurs {count} times in {shown(root, path)}; include more of "
                        "the surrounding text so it matches exactly once.")
    path.write_bytes(text.replace(old, new, 1).encode("utf-8", "surrogateescape"))
    return f"Edited {shown(root, path)}."


SYNC_TOOLS = {"list_files": list_files, "read_file": read_file, "search_files": search_files,
              "write_file": write_file, "edit_file": edit_file}


# -- the shell command ----------------------------------------------------------------

def _joined(head: bytes, tail: bytes, total: int) -> str:
    """The output as kept: whole, or its head and tail with what was left out counted."""
    if total <= len(head) + len(tail):
        return (head + tail).decode("utf-8", "replace")
    return (head.decode("utf-8", "replace") + f"\n…({total - len(head) - len(tail)} bytes of "
            "output not shown)…\n" + tail.decode("utf-8", "replace"))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def exec_shell_command(root: Path, args: dict[str, Any]) -> str:
    """Run the command as a new process group; the group is killed at the time limit
    and when the caller is cancelled (a stop)."""
    command = _str(args, "command")
    if not command.strip():
        raise ToolError("`command` is empty.")
    limit = min(max(1.0, float(_int(args, "timeout_s", int(EXEC_DEFAULT_S)))), EXEC_MAX_S)
    proc = await trio.lowlevel.open_process(
        ["/bin/sh", "-c", command], cwd=os.path.realpath(root), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    head = bytearray()
    tail = bytearray()
    total = 0
    timed_out = False
    try:
        with trio.move_on_after(limit) as scope:
            assert proc.stdout is not None
            async for chunk in proc.stdout:
                total += len(chunk)
                if len(head) < EXEC_OUTPUT_BYTES // 2:
                    room = EXEC_OUTPUT_BYTES // 2 - len(head)
                    head += chunk[:room]
                    chunk = chunk[room:]
                tail = (tail + chunk)[-(EXEC_OUTPUT_BYTES // 2):]
            await proc.wait()
        timed_out = scope.cancelled_caught
    finally:
        _kill_group(proc.pid)
        with trio.CancelScope(shield=True):
            await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
    out = _joined(bytes(head), bytes(tail), total)
    if timed_out:
        return f"{out}\n(the command was stopped after {limit:.0f} s, its time limit)"
    return f"{out}\n(exit status {proc.returncode})" if out else f"(no output; exit status {proc.returncode})"
