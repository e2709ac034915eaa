"""The three registrations, as text: a systemd user unit, a launchd agent plist and a
Windows scheduled-task XML. Values in, text out, and back: each has a reader that
gives the command line again, which is what ``status`` shows and the tests check.

Each restarts the server after a failure and not after a stop someone asked for: the
server exits 0 on SIGTERM / SIGINT, and systemd's ``Restart=on-failure`` and launchd's
``KeepAlive = {SuccessfulExit: false}`` restart only on a failure.
"""

from __future__ import annotations

import os
import plistlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from . import NAME

DESCRIPTION = "bmoe: a local LLM server (bmoe-server)"
RESTART_DELAY_S = 5          # between a failure and the next start
STOP_TIMEOUT_S = 30          # what the init system waits for a clean stop before it kills
TASK_NS = "http://schemas.microsoft.com/windows/2004/02/mit/task"


def command(argv: list[str], python: str | None = None) -> list[str]:
    """The whole command line a service runs: this Python, the server module, ``argv``."""
    return [os.path.abspath(python or sys.executable), "-m", "bmoe.server", *argv]


def workdir(python: str | None = None) -> Path:
    """The executable's own folder, which the service starts from."""
    return Path(os.path.abspath(python or sys.executable)).parent


# --- systemd --------------------------------------------------------------------------------

_SYSTEMD_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def systemd_quote(arg: str) -> str:
    """One word of an ``ExecStart=`` line: specifiers (%) and variables ($) escaped."""
    if "\n" in arg or "\0" in arg:
        raise ValueError("a service's argument cannot hold a line break")
    text = arg.replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_PLAIN.fullmatch(arg):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(cmd: list[str], cwd: Path) -> str:
    return "\n".join([
        "[Unit]",
        f"Description={DESCRIPTION}",
        "",
        "[Service]",
        "Type=exec",
        "ExecStart=" + " ".join(systemd_quote(a) for a in cmd),
        f"WorkingDirectory={systemd_quote(os.fspath(cwd))}",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def systemd_command(unit: str) -> list[str]:
    """The command line of a unit this module wrote (its ``ExecStart=``)."""
    import shlex
    for line in unit.splitlines():
        if line.startswith("ExecStart="):
            words = shlex.split(line[len("ExecStart="):])
            return [w.replace("%%", "%").replace("$$", "$") for w in words]
    return []


# --- launchd --------------------------------------------------------------------------------

def launchd_plist(cmd: list[str], cwd: Path, log_file: Path) -> bytes:
    return plistlib.dumps({
        "Label": NAME,
        "ProgramArguments": cmd,
        "WorkingDirectory": os.fspath(cwd),
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        "ExitTimeOut": STOP_TIMEOUT_S,
        "ProcessType": "Background",
        "StandardOutPath": os.fspath(log_file),
        "StandardErrorPath": os.fspath(log_file),
    })


def launchd_command(plist: bytes) -> list[str]:
    return list(plistlib.loads(plist).get("ProgramArguments", []))


# --- Windows Task Scheduler -----------------------------------------------------------------

def _sub(parent: ET.Element, tag: str, text: str | None = None) -> ET.Element:
    el = ET.SubElement(parent, tag)
    if text is not None:
        el.text = text
    return el


def task_xml(cmd: list[str], cwd: Path, user: str) -> str:
    """The task: at the person's logon, as them with no password stored (S4U)."""
    task = ET.Element("Task", {"version": "1.2", "xmlns": TASK_NS})
    info = _sub(task, "RegistrationInfo")
    _sub(info, "Description", DESCRIPTION)
    _sub(info, "URI", "\\" + NAME)
    logon = _sub(_sub(task, "Triggers"), "LogonTrigger")
    _sub(logon, "Enabled", "true")
    _sub(logon, "UserId", user)
    principal = _sub(_sub(task, "Principals"), "Principal")
    principal.set("id", "Author")
    _sub(principal, "UserId", user)
    _sub(principal, "LogonType", "S4U")
    _sub(principal, "RunLevel", "LeastPrivilege")
    settings = _sub(task, "Settings")
    for tag, text in (("MultipleInstancesPolicy", "IgnoreNew"),
                      ("DisallowStartIfOnBatteries", "false"),
                      ("StopIfGoingOnBatteries", "false"),
                      ("AllowHardTerminate", "true"),
                      ("StartWhenAvailable", "true"),
                      ("AllowStartOnDemand", "true"),
                      ("Enabled", "true"),
                      ("Hidden", "false"),
                      ("ExecutionTimeLimit", "PT0S")):
        _sub(settings, tag, text)
    restart = _sub(settings, "RestartOnFailure")
    _sub(restart, "Interval", "PT1M")
    _sub(restart, "Count", "999")
    actions = _sub(task, "Actions")
    actions.set("Context", "Author")
    exe = _sub(actions, "Exec")
    _sub(exe, "Command", cmd[0])
    _sub(exe, "Arguments", subprocess.list2cmdline(cmd[1:]))
    _sub(exe, "WorkingDirectory", os.fspath(cwd))
    body = ET.tostring(task, encoding="unicode")
    return '<?xml version="1.0" encoding="UTF-16"?>\n' + body + "\n"


def windows_split(line: str) -> list[str]:
    """A Windows command line split as the C runtime splits it (list2cmdline's inverse)."""
    words: list[str] = []
    word, quoted, started, i = "", False, False, 0
    while i < len(line):
        c = line[i]
        if c == "\\":
            n = len(line[i:]) - len(line[i:].lstrip("\\"))
            if i + n < len(line) and line[i + n] == '"':
                word += "\\" * (n // 2)
                if n % 2:
                    word += '"'
                    i += n + 1
                else:
                    i += n
                started = True
                continue
            word += "\\" * n
            i += n
            started = True
            continue
        if c == '"':
            quoted = not quoted
            started = True
        elif c in " \t" and not quoted:
            if started:
                words.append(word)
            word, started = "", False
        else:
            word += c
            started = True
        i += 1
    if started:
        words.append(word)
    return words


def task_command(xml_text: str) -> list[str]:
    """The command line of a task XML (as written here, or as ``schtasks /XML`` prints it)."""
    root = ET.fromstring(xml_text.encode("utf-8").replace(b'encoding="UTF-16"', b'encoding="UTF-8"'))
    exe = root.find(f"{{{TASK_NS}}}Actions/{{{TASK_NS}}}Exec")
    if exe is None:
        return []
    command_ = exe.findtext(f"{{{TASK_NS}}}Command") or ""
    args = exe.findtext(f"{{{TASK_NS}}}Arguments") or ""
    return [command_, *windows_split(args)]
