"""The init systems: systemd (user units), launchd (agents), Windows Task Scheduler.

Each manager writes its registration file, then drives its own tool (``systemctl
--user``, ``launchctl``, ``schtasks``) with plain command lines, run through
``run_tool``, so a test can put a recording stand-in on ``PATH`` and check every line.
A tool that fails becomes a ``ServiceError`` whose message says what failed, with the
tool's own words; nothing here needs an administrator.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import NAME, units

TOOL_TIMEOUT_S = 60.0        # the longest one systemctl / launchctl / schtasks call may take


class ServiceError(Exception):
    """A step that failed, in a sentence for the person at the terminal."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class Ran:
    rc: int
    out: str
    err: str

    @property
    def said(self) -> str:
        """The tool's last words, for a message."""
        lines = (self.err.strip() or self.out.strip()).splitlines()
        return lines[-1] if lines else f"exit status {self.rc}"


def run_tool(cmd: list[str]) -> Ran:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return Ran(127, "", f"{cmd[0]} was not found")
    except subprocess.TimeoutExpired:
        return Ran(124, "", f"{cmd[0]} did not answer within {TOOL_TIMEOUT_S:.0f} s")
    except OSError as e:
        return Ran(126, "", f"{cmd[0]} could not be run ({e.strerror or 'refused'})")
    return Ran(done.returncode, done.stdout, done.stderr)


def must(cmd: list[str], what: str) -> Ran:
    ran = run_tool(cmd)
    if ran.rc != 0:
        raise ServiceError(f"{what} failed: `{' '.join(cmd)}` said: {ran.said}")
    return ran


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Status:
    registered: bool
    running: bool = False
    pid: int | None = None
    command: list[str] = field(default_factory=list)
    detail: str = ""


@dataclass
class Install:
    cmd: list[str]
    cwd: Path
    data_dir: Path
    log_file: Path


class Systemd:
    title = "systemd (user unit)"
    tool = "systemctl"
    unit = f"{NAME}.service"

    @staticmethod
    def answers() -> bool:
        return bool(shutil.which("systemctl")) and \
            run_tool(["systemctl", "--user", "show-environment"]).rc == 0

    @property
    def path(self) -> Path:
        config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
        return Path(config) / "systemd" / "user" / self.unit

    def ctl(self, *words: str) -> list[str]:
        return ["systemctl", "--user", *words]

    def install(self, inst: Install) -> list[str]:
        write_private(self.path, units.systemd_unit(inst.cmd, inst.cwd).encode())
        must(self.ctl("daemon-reload"), "Reloading the user units")
        must(self.ctl("enable", self.unit), "Enabling the service at login")
        must(self.ctl("restart", self.unit), "Starting the service")
        return self.linger()

    def linger(self) -> list[str]:
        user = getpass.getuser()
        asked = run_tool(["loginctl", "show-user", user, "--property=Linger", "--value"])
        if asked.rc == 0 and asked.out.strip() == "yes":
            return []
        if run_tool(["loginctl", "enable-linger", user]).rc == 0:
            return [f"Lingering is on for {user}: the service keeps running after you log out."]
        return [f"The service stops when your last session ends. To keep it running, have an "
                f"administrator run: sudo loginctl enable-linger {user}"]

    def start(self) -> None:
        must(self.ctl("start", self.unit), "Starting the service")

    def stop(self) -> None:
        must(self.ctl("stop", self.unit), "Stopping the service")

    def status(self) -> Status:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Status(False)
        shown = run_tool(self.ctl("show", self.unit, "--property=ActiveState,SubState,MainPID"))
        props = dict(line.partition("=")[::2] for line in shown.out.splitlines())
        pid = int(props.get("MainPID", "0") or 0)
        return Status(True, props.get("ActiveState") == "active", pid or None,
                      units.systemd_command(text),
                      f"{props.get('ActiveState', 'unknown')} ({props.get('SubState', '?')})")

    def uninstall(self) -> None:
        run_tool(self.ctl("disable", "--now", self.unit))
        self.path.unlink(missing_ok=True)
        must(self.ctl("daemon-reload"), "Reloading the user units")
        run_tool(self.ctl("reset-failed", self.unit))


class Launchd:
    title = "launchd (user agent)"
    tool = "launchctl"

    @staticmethod
    def answers() -> bool:
        return bool(shutil.which("launchctl"))

    @property
    def path(self) -> Path:
        return Path(os.path.expanduser("~/Library/LaunchAgents")) / f"{NAME}.plist"

    @property
    def domain(self) -> str:
        return f"gui/{os.getuid()}"  # type: ignore[attr-defined,unused-ignore]

    @property
    def target(self) -> str:
        return f"{self.domain}/{NAME}"

    def install(self, inst: Install) -> list[str]:
        write_private(self.path, units.launchd_plist(inst.cmd, inst.cwd, inst.log_file))
        run_tool(["launchctl", "bootout", self.target])       # an earlier registration
        must(["launchctl", "bootstrap", self.domain, os.fspath(self.path)], "Registering the agent")
        must(["launchctl", "enable", self.target], "Enabling the agent")
        return []

    def start(self) -> None:
        must(["launchctl", "kickstart", self.target], "Starting the agent")

    def stop(self) -> None:
        must(["launchctl", "kill", "SIGTERM", self.target], "Stopping the agent")

    def status(self) -> Status:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Status(False)
        shown = run_tool(["launchctl", "print", self.target])
        fields = {k.strip(): v.strip() for k, _, v in
                  (line.partition("=") for line in shown.out.splitlines()) if v}
        pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else None
        state = fields.get("state", "not loaded" if shown.rc else "unknown")
        return Status(True, state == "running", pid, units.launchd_command(data), state)

    def uninstall(self) -> None:
        run_tool(["launchctl", "bootout", self.target])
        self.path.unlink(missing_ok=True)


class Schtasks:
    title = "Windows Task Scheduler"
    tool = "schtasks"

    def __init__(self, data_dir: Path | None = None) -> None:
        self.data_dir = data_dir

    @staticmethod
    def answers() -> bool:
        return bool(shutil.which("schtasks"))

    @staticmethod
    def user() -> str:
        domain = os.environ.get("USERDOMAIN")
        name = os.environ.get("USERNAME") or getpass.getuser()
        return f"{domain}\\{name}" if domain else name

    def install(self, inst: Install) -> list[str]:
        path = inst.data_dir / f"{NAME}.xml"
        text = units.task_xml(inst.cmd, inst.cwd, self.user())
        write_private(path, text.encode("utf-16"))
        must(["schtasks", "/Create", "/TN", NAME, "/XML", os.fspath(path), "/F"],
             "Registering the task")
        must(["schtasks", "/Run", "/TN", NAME], "Starting the task")
        return []

    def start(self) -> None:
        must(["schtasks", "/Run", "/TN", NAME], "Starting the task")

    def stop(self) -> None:
        must(["schtasks", "/End", "/TN", NAME], "Stopping the task")

    def status(self) -> Status:
        xml = run_tool(["schtasks", "/Query", "/TN", NAME, "/XML", "ONE"])
        if xml.rc != 0:
            return Status(False)
        listed = run_tool(["schtasks", "/Query", "/TN", NAME, "/FO", "LIST"])
        state = next((line.split(":", 1)[1].strip() for line in listed.out.splitlines()
                      if line.strip().lower().startswith("status:")), "unknown")
        return Status(True, state.lower() == "running", None, units.task_command(xml.out), state)

    def uninstall(self) -> None:
        must(["schtasks", "/Delete", "/TN", NAME, "/F"], "Removing the task")


Manager = Systemd | Launchd | Schtasks


def find_manager() -> Manager:
    """The first of systemctl (with a user manager), launchctl, schtasks that answers."""
    if Systemd.answers():
        return Systemd()
    if Launchd.answers():
        return Launchd()
    if Schtasks.answers():
        return Schtasks()
    if shutil.which("systemctl"):
        raise ServiceError(
            "systemctl is here, but no user service manager answers (`systemctl --user "
            "show-environment` failed): run this from a login session of your own, not "
            "through su or sudo, or on a machine whose init is systemd.")
    raise ServiceError("No service manager answers here: neither systemctl (a user manager), "
                       "launchctl nor schtasks was found.")
