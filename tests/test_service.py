"""`bmoe-server service ...`: the registrations checked by the real tools, the command
line a service gets, the refusals at install, the init systems' command lines (a real
`systemctl --user` when one answers, else a recording stand-in on PATH), and the log file.
"""

from __future__ import annotations

import getpass
import json
import os
import plistlib
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import trio

from bmoe.server import main as server_main
from bmoe.service import NAME, args, cli, logtee, managers, stopping, units

TRICKY = ["--scan-dir", "/srv/my models/100% \"best\"", "--allow-origin", "http://x:1/$HOME",
          "--model", "C:\\models\\a b\\m.gguf", "--temp", "0.7", "--no-think", "back\\slash\\"]

def service_argv(argv: list[str], cwd: Path | None = None) -> args.ServiceArgs:
    """A start's command line made a service's, with bmoe-server's own parser."""
    return args.service_argv(argv, server_main, cwd)


def service(argv: list[str]) -> int:
    """`bmoe-server service ARGV`, as bmoe-server dispatches it."""
    return cli.main(argv, server_main)


def _env_rundir(tmp_path: Path) -> dict[str, str]:
    run = tmp_path / "xdg-run"
    run.mkdir(mode=0o700, exist_ok=True)
    return dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR") or str(run))


# --- the registrations, checked by the real tools ---------------------------------------------

def test_systemd_unit_verifies_and_reads_back(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: scripts/test installs Debian's systemd package")
    cmd = units.command(TRICKY)
    unit = tmp_path / f"{NAME}.service"
    unit.write_text(units.systemd_unit(cmd, units.workdir()), encoding="utf-8")
    done = subprocess.run([analyze, "verify", "--user", str(unit)], capture_output=True,
                          text=True, env=_env_rundir(tmp_path), timeout=60)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    text = unit.read_text(encoding="utf-8")
    assert units.systemd_command(text) == cmd
    lines = text.splitlines()
    assert "Restart=on-failure" in lines and "WantedBy=default.target" in lines
    assert "KillMode=mixed" in lines and "Type=exec" in lines


def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above means something: the same tool refuses a unit with a mistake."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: scripts/test installs Debian's systemd package")
    unit = tmp_path / f"{NAME}.service"
    unit.write_text(units.systemd_unit(["relative/python", "-m", "bmoe.server"], tmp_path)
                    .replace("Restart=", "Restartt="), encoding="utf-8")
    done = subprocess.run([analyze, "verify", "--user", str(unit)], capture_output=True,
                          text=True, env=_env_rundir(tmp_path), timeout=60)
    assert done.returncode != 0 or done.stderr.strip()


def test_launchd_plist_round_trips(tmp_path: Path) -> None:
    cmd = units.command(TRICKY)
    data = units.launchd_plist(cmd, Path("/opt/bmoe"), tmp_path / "server.log")
    plist = plistlib.loads(data)
    assert plist["Label"] == NAME
    assert plist["ProgramArguments"] == cmd
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}     # after a failure, not a stop
    assert plist["WorkingDirectory"] == "/opt/bmoe"
    assert plist["StandardErrorPath"] == plist["StandardOutPath"] == str(tmp_path / "server.log")
    assert plistlib.dumps(plist) == data
    assert units.launchd_command(data) == cmd


def test_task_xml_has_what_schtasks_needs(tmp_path: Path) -> None:
    cmd = units.command(TRICKY, python="C:\\Program Files\\bmoe\\python.exe")
    path = tmp_path / "task.xml"
    path.write_bytes(units.task_xml(cmd, Path("C:/Program Files/bmoe"), "HOME\\ann")
                     .encode("utf-16"))
    raw = path.read_bytes()
    assert raw[:2] in (b"\xff\xfe", b"\xfe\xff")                 # UTF-16 with its BOM
    root = ET.fromstring(raw)                                      # expat reads UTF-16 itself
    ns = {"t": units.TASK_NS}
    assert root.tag == f"{{{units.TASK_NS}}}Task" and root.get("version") == "1.2"
    assert root.findtext("t:RegistrationInfo/t:URI", namespaces=ns) == "\\" + NAME
    assert root.findtext("t:Triggers/t:LogonTrigger/t:UserId", namespaces=ns) == "HOME\\ann"
    principal = root.find("t:Principals/t:Principal", ns)
    assert principal is not None and principal.get("id") == "Author"
    assert principal.findtext("t:LogonType", namespaces=ns) == "S4U"      # no password kept
    assert principal.findtext("t:RunLevel", namespaces=ns) == "LeastPrivilege"
    assert principal.findtext("t:UserId", namespaces=ns) == "HOME\\ann"
    actions = root.find("t:Actions", ns)
    assert actions is not None and actions.get("Context") == "Author"
    settings = root.find("t:Settings", ns)
    assert settings is not None
    assert settings.findtext("t:ExecutionTimeLimit", namespaces=ns) == "PT0S"   # runs for good
    assert settings.findtext("t:MultipleInstancesPolicy", namespaces=ns) == "IgnoreNew"
    assert settings.findtext("t:DisallowStartIfOnBatteries", namespaces=ns) == "false"
    assert settings.findtext("t:RestartOnFailure/t:Count", namespaces=ns) == "999"
    exe = root.find("t:Actions/t:Exec", ns)
    assert exe is not None
    assert exe.findtext("t:WorkingDirectory", namespaces=ns) == "C:/Program Files/bmoe"
    assert units.task_command(path.read_bytes().decode("utf-16")) == cmd


@pytest.mark.parametrize("words", [
    ["a", "b c", "", 'say "hi"', "C:\\dir\\", "back\\\\slash", "tab\there", '\\"', "%PATH%"],
    TRICKY])
def test_windows_command_line_splits_back(words: list[str]) -> None:
    assert units.windows_split(subprocess.list2cmdline(words)) == words


# --- the command line a service gets ---------------------------------------------------------

def test_install_args_are_absolute_and_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    shell = tmp_path / "shell"
    shell.mkdir()
    out = service_argv(["-m", "model.gguf", "--scan-dir", "more", "--scan-dir", "~/x",
                             "-c", "8192", "--open", "--temp", "-0.0", "--no-think"], cwd=shell)
    ns = server_main.build_parser().parse_args(out.argv)
    assert ns.model == str(shell / "model.gguf")
    assert ns.scan_dir == [shell / "more", Path.home() / "x"]
    assert ns.data_dir == tmp_path / "xdg" / "bmoe" == out.data_dir
    assert ns.log_file == tmp_path / "xdg" / "bmoe" / "bmoe-server.log" == out.log_file
    assert ns.autoload is True and ns.open is False and ns.ctx_size == 8192 and ns.think is False
    assert "--open" not in out.argv
    assert any("--open is dropped" in n for n in out.notes)
    assert out.new_key is None and ns.api_key_file is None         # loopback: no key needed
    assert out.url == "http://127.0.0.1:8765/"
    # what was registered parses back to itself
    again = args.namespace_to_argv(server_main.build_parser(), ns)
    assert again == out.argv


def test_install_keeps_what_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    key = tmp_path / "k"
    key.write_text("secret\n")
    out = service_argv(["--data-dir", "d", "--log-file", "logs/s.log", "--host", "0.0.0.0",
                             "--api-key-file", "k", "--port", "9000"])
    ns = server_main.build_parser().parse_args(out.argv)
    assert ns.data_dir == tmp_path / "d" and ns.log_file == tmp_path / "logs" / "s.log"
    assert ns.api_key_file == key and ns.port == 9000 and ns.host == "0.0.0.0"
    assert out.new_key is None and not (tmp_path / "d" / "api-key").exists()


def test_beyond_loopback_without_a_key_gets_one_kept_across_installs(tmp_path: Path) -> None:
    first = service_argv(["--data-dir", str(tmp_path), "--host", "0.0.0.0"])
    key_file = tmp_path / "api-key"
    assert first.new_key and key_file.read_text().strip() == first.new_key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert server_main.build_parser().parse_args(first.argv).api_key_file == key_file
    second = service_argv(["--data-dir", str(tmp_path), "--host", "0.0.0.0", "-c", "4096"])
    assert second.new_key is None                                   # printed once only
    assert key_file.read_text().strip() == first.new_key
    assert any("Kept the key" in n for n in second.notes)
    open_ = service_argv(["--data-dir", str(tmp_path / "o"), "--host", "0.0.0.0",
                               "--no-api-key"])
    assert open_.new_key is None and not (tmp_path / "o" / "api-key").exists()


def _refusal(capsys: pytest.CaptureFixture[str], fn, argv: list[str]) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    err = capsys.readouterr().err
    return str(exc.value.code) if not isinstance(exc.value.code, int) else err.strip().splitlines()[-1]


def _start_checks(argv: list[str]) -> None:
    """What `bmoe-server ARGS` does before it serves: parse, then the launch checks."""
    ns = server_main.build_parser().parse_args(argv)
    key = server_main.read_key(ns)
    server_main.check_binding(ns.host, key, ns.no_api_key)


@pytest.mark.parametrize("argv", [
    ["--ctx-size", "0"],
    ["--temp", "hot"],
    ["--cache-mb", "-5"],
    ["--bogus-flag"],
    ["--api-key-file", "does-not-exist"],
    ["--api-key", "  "],
    ["--api-key", "a", "--api-key-file", "b"],
    ["--port", "eighty"],
])
def test_refused_at_install_with_the_start_reason(argv: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    full = ["--data-dir", str(tmp_path), *argv]
    at_start = _refusal(capsys, _start_checks, full)
    at_install = _refusal(capsys, service_argv, full)
    assert at_install == at_start and at_start


def test_empty_key_file_refused_at_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").write_text("\n")
    full = ["--data-dir", str(tmp_path), "--host", "0.0.0.0", "--api-key-file",
            str(tmp_path / "empty")]
    assert _refusal(capsys, service_argv, full) == _refusal(capsys, _start_checks, full)
    assert not (tmp_path / "api-key").exists()


def test_parent_pid_refused_at_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    why = _refusal(capsys, service_argv, ["--data-dir", str(tmp_path), "--parent-pid", "1"])
    assert "--parent-pid" in why and "service" in why


# --- the init systems' command lines ----------------------------------------------------------

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    log, state = os.environ["BMOE_TEST_TOOLS_LOG"], os.environ["BMOE_TEST_TOOLS_STATE"]
    name, words = os.path.basename(sys.argv[0]), sys.argv[1:]
    with open(log, "a") as f:
        f.write(json.dumps([name, *words]) + "\\n")
    running = os.path.exists(state)
    verb = next((w for w in words if not w.startswith("-") and w != "--user"), "")
    if name == "loginctl":
        if verb == "show-user":
            print("no")
        elif verb == "enable-linger":
            print("Could not enable linger: Access denied", file=sys.stderr)
            sys.exit(1)
    elif name == "systemctl":
        if verb == "show":
            print("ActiveState=" + ("active" if running else "inactive"))
            print("SubState=" + ("running" if running else "dead"))
            print("MainPID=" + ("4242" if running else "0"))
        elif verb in ("start", "restart"):
            open(state, "w").close()
        elif verb == "stop" or words[-2:-1] == ["--now"]:
            running and os.unlink(state)
    elif name == "launchctl":
        if verb == "print":
            if running:
                print("io.bigmoeonedge.server = {{\\n\\tstate = running\\n\\tpid = 4343\\n}}")
        elif verb in ("bootstrap", "kickstart"):
            open(state, "w").close()
        elif verb in ("kill", "bootout"):
            running and os.unlink(state)
    elif name == "schtasks":
        if "/Query" in words:
            xml = os.path.join(os.environ["BMOE_TEST_DATA"], "io.bigmoeonedge.server.xml")
            if not os.path.exists(xml) or os.path.exists(state + ".deleted"):
                print("ERROR: The system cannot find the file specified.", file=sys.stderr)
                sys.exit(1)
            if "/XML" in words:
                print(open(xml, "rb").read().decode("utf-16"))
            else:
                print("TaskName:    \\\\io.bigmoeonedge.server")
                print("Status:      " + ("Running" if running else "Ready"))
        elif "/Run" in words or "/Create" in words:
            open(state, "w").close()
        elif "/End" in words:
            running and os.unlink(state)
        elif "/Delete" in words:
            open(state + ".deleted", "w").close()
    """)


class Tools:
    """Recording stand-ins for systemctl, loginctl, launchctl and schtasks on PATH."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "tools.log"
        self.log.touch()
        self.state = root / "running"
        for name in names:
            exe = self.bin / name
            exe.write_text(STAND_IN.format(python=sys.executable))
            exe.chmod(0o755)

    def calls(self) -> list[list[str]]:
        lines = self.log.read_text().splitlines()
        self.log.write_text("")
        return [json.loads(line) for line in lines]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    monkeypatch.setenv("BMOE_TEST_DATA", str(home / "data"))
    return home


def _tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: list[str]) -> Tools:
    tools = Tools(tmp_path, names)
    monkeypatch.setenv("PATH", str(tools.bin))          # the stand-ins and nothing else
    monkeypatch.setenv("BMOE_TEST_TOOLS_LOG", str(tools.log))
    monkeypatch.setenv("BMOE_TEST_TOOLS_STATE", str(tools.state))
    return tools


def _user_manager_answers() -> bool:
    if shutil.which("systemctl") is None:
        return False
    return subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True,
                          timeout=30).returncode == 0


def test_systemd_install_status_stop_uninstall_command_lines(
        tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    tools = _tools(tmp_path, monkeypatch, ["systemctl", "loginctl"])
    data = home / "data"
    user = getpass.getuser()
    unit = home / ".config" / "systemd" / "user" / f"{NAME}.service"
    ctl = ["systemctl", "--user"]

    assert service(["install", "--data-dir", str(data), "-c", "4096", "--host", "0.0.0.0"]) == 0
    out = capsys.readouterr().out
    key = (data / "api-key").read_text().strip()
    assert f"key:     {key}" in out                                 # printed once, here
    assert f"sudo loginctl enable-linger {user}" in out             # linger needs an admin here
    assert tools.calls() == [
        [*ctl, "show-environment"],
        [*ctl, "daemon-reload"],
        [*ctl, "enable", f"{NAME}.service"],
        [*ctl, "restart", f"{NAME}.service"],
        ["loginctl", "show-user", user, "--property=Linger", "--value"],
        ["loginctl", "enable-linger", user]]
    assert stat.S_IMODE(unit.stat().st_mode) == 0o600
    cmd = units.systemd_command(unit.read_text())
    assert cmd[:3] == [os.path.abspath(sys.executable), "-m", "bmoe.server"]
    assert cmd[3:] == ["--host", "0.0.0.0", "--data-dir", str(data), "--api-key-file",
                       str(data / "api-key"), "--autoload", "--log-file",
                       str(data / "bmoe-server.log"), "--ctx-size", "4096"]

    (data / "bmoe-server.log").write_text("2026-01-01T00:00:00.000+00:00 bmoe: listening on "
                                          "http://127.0.0.1:8765/\n2026 bmoe: answer: 5 tokens\n")
    assert service(["status"]) == 0
    out = capsys.readouterr().out
    assert "registered with systemd" in out and "running: yes (pid 4242)" in out
    assert "URL:     http://127.0.0.1:8765/" in out and "bmoe: answer: 5 tokens" in out
    assert tools.calls() == [[*ctl, "show-environment"],
                             [*ctl, "show", f"{NAME}.service",
                              "--property=ActiveState,SubState,MainPID"]]

    assert service(["stop"]) == 0
    assert tools.calls()[-1] == [*ctl, "stop", f"{NAME}.service"]
    assert service(["status"]) == 3
    assert "running: no (inactive (dead))" in capsys.readouterr().out
    tools.calls()
    assert service(["start"]) == 0
    assert tools.calls()[-1] == [*ctl, "start", f"{NAME}.service"]

    # a reinstall keeps the key and does not print it again
    assert service(["install", "--data-dir", str(data), "--host", "0.0.0.0"]) == 0
    assert key not in capsys.readouterr().out and (data / "api-key").read_text().strip() == key
    tools.calls()

    (data / "settings.json").write_text("{}")
    assert service(["uninstall"]) == 0
    assert tools.calls() == [
        [*ctl, "show-environment"],
        [*ctl, "show", f"{NAME}.service", "--property=ActiveState,SubState,MainPID"],
        [*ctl, "disable", "--now", f"{NAME}.service"],
        [*ctl, "daemon-reload"],
        [*ctl, "reset-failed", f"{NAME}.service"]]
    assert not unit.exists()
    assert (data / "api-key").read_text().strip() == key and (data / "settings.json").exists()
    assert "stay in" in capsys.readouterr().out
    assert service(["status"]) == 4


def test_refused_install_registers_nothing(tmp_path: Path, home: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    tools = _tools(tmp_path, monkeypatch, ["systemctl", "loginctl"])
    with pytest.raises(SystemExit):
        service(["install", "--ctx-size", "0"])
    assert "--ctx-size" in capsys.readouterr().err
    assert tools.calls() == []
    assert not (home / ".config" / "systemd").exists()


def test_launchd_command_lines(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    tools = _tools(tmp_path, monkeypatch, ["launchctl"])
    data = home / "data"
    target = f"gui/{os.getuid()}/{NAME}"
    plist = home / "Library" / "LaunchAgents" / f"{NAME}.plist"
    assert service(["install", "--data-dir", str(data)]) == 0
    assert tools.calls() == [["launchctl", "bootout", target],
                             ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)],
                             ["launchctl", "enable", target]]
    loaded = plistlib.loads(plist.read_bytes())
    assert loaded["ProgramArguments"][3:] == ["--data-dir", str(data), "--autoload",
                                              "--log-file", str(data / "bmoe-server.log")]
    assert service(["status"]) == 0
    assert "running: yes (pid 4343)" in capsys.readouterr().out
    assert tools.calls() == [["launchctl", "print", target]]
    assert service(["stop"]) == 0
    assert tools.calls()[-1] == ["launchctl", "kill", "SIGTERM", target]
    assert service(["start"]) == 0
    assert tools.calls()[-1] == ["launchctl", "kickstart", target]
    assert service(["uninstall"]) == 0
    assert tools.calls()[-1] == ["launchctl", "bootout", target]
    assert not plist.exists()


def test_schtasks_command_lines(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    tools = _tools(tmp_path, monkeypatch, ["schtasks"])
    data = home / "data"
    xml = data / f"{NAME}.xml"
    assert service(["install", "--data-dir", str(data), "--port", "9999"]) == 0
    assert tools.calls() == [["schtasks", "/Create", "/TN", NAME, "/XML", str(xml), "/F"],
                             ["schtasks", "/Run", "/TN", NAME]]
    assert units.task_command(xml.read_bytes().decode("utf-16"))[3:5] == ["--port", "9999"]
    assert service(["status"]) == 0
    out = capsys.readouterr().out
    assert "running: yes" in out and "http://127.0.0.1:9999/" in out
    assert service(["stop"]) == 0
    assert tools.calls()[-1] == ["schtasks", "/End", "/TN", NAME]
    assert service(["uninstall"]) == 0
    assert tools.calls()[-1] == ["schtasks", "/Delete", "/TN", NAME, "/F"]
    assert not xml.exists()


def test_no_service_manager_is_a_sentence(tmp_path: Path, home: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _tools(tmp_path, monkeypatch, [])
    assert service(["status"]) == 1
    assert "No service manager answers here" in capsys.readouterr().err


@pytest.mark.skipif(not _user_manager_answers(),
                    reason="no systemd user manager answers on this machine (the stand-in "
                           "test above checks the command lines)")
def test_real_systemctl_user(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    unit = Path(os.path.expanduser("~/.config/systemd/user")) / f"{NAME}.service"
    if unit.exists():
        pytest.skip(f"{NAME} is already installed for this user; not touching it")
    # lingering outlives the test: leave the machine's setting alone (the stand-in test
    # checks the loginctl lines)
    monkeypatch.setattr(managers.Systemd, "linger", lambda self: [])
    data = tmp_path / "data"
    try:
        assert service(["install", "--data-dir", str(data), "--port", "0", "--threads", "1"]) == 0
        assert service(["status"]) in (0, 3)
        assert "registered with systemd" in capsys.readouterr().out
        assert service(["stop"]) == 0
    finally:
        service(["uninstall"])
    assert not unit.exists()


# --- the log file ---------------------------------------------------------------------------

def _tee(path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bmoe.service.logtee", str(path)],
                            stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _stamped(line: str) -> str:
    when, _, text = line.partition(" ")
    assert len(when) >= 23 and when[4] == "-" and when[10] == "T", line
    return text


def test_log_rotates_at_the_size_and_keeps_every_line(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    line = b"x" * 1000
    total = logtee.ROTATE_BYTES // 1000 + 500                  # past the size by ~0.5 MB
    tee = _tee(log)
    assert tee.stdin is not None
    for i in range(total):
        tee.stdin.write(b"%08d " % i + line + b"\n")
    tee.stdin.close()
    assert tee.wait(60) == 0
    old, new = logtee.rotated(log), log
    assert logtee.ROTATE_BYTES <= old.stat().st_size < logtee.ROTATE_BYTES + 1100
    assert 0 < new.stat().st_size < logtee.ROTATE_BYTES
    lines = old.read_text().splitlines() + new.read_text().splitlines()
    assert [int(_stamped(x)[:8]) for x in lines] == list(range(total))
    # at the next start, a full file is moved aside first, replacing the earlier .1
    with open(log, "ab") as f:
        f.truncate(logtee.ROTATE_BYTES)
    tee = _tee(log)
    assert tee.stdin is not None
    tee.stdin.write(b"after\n")
    tee.stdin.close()
    assert tee.wait(60) == 0
    assert old.stat().st_size == logtee.ROTATE_BYTES
    assert [_stamped(x) for x in log.read_text().splitlines()] == ["after"]


def test_log_keeps_what_a_killed_writer_left(tmp_path: Path) -> None:
    """The writer dies mid-line: the tee still writes every line, the unfinished one too."""
    log = tmp_path / "server.log"
    read, write = os.pipe()
    tee = subprocess.Popen([sys.executable, "-m", "bmoe.service.logtee", str(log)],
                           stdin=read, stderr=subprocess.DEVNULL)
    os.close(read)
    writer = subprocess.Popen([sys.executable, "-c",
                               "import os,time; os.write(2, b'one\\ntwo\\nhalf a li'); "
                               "time.sleep(60)"], stderr=write)
    os.close(write)
    writer_done = False
    try:
        deadline = __import__("time").monotonic() + 30
        while not log.exists() or b"two" not in log.read_bytes():
            assert __import__("time").monotonic() < deadline, "the tee wrote nothing"
            __import__("time").sleep(0.05)
        writer.kill()
        writer.wait()
        writer_done = True
        assert tee.wait(30) == 0
    finally:
        if not writer_done:
            writer.kill()
            writer.wait()
    assert [_stamped(x) for x in log.read_text().splitlines()] == ["one", "two", "half a li"]


def test_unwritable_log_file_refuses_with_a_sentence(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        logtee.check_writable(blocker / "sub" / "server.log")
    assert str(exc.value).startswith("bmoe-server: cannot write the log file")


# --- signals --------------------------------------------------------------------------------

class _Line:
    def __init__(self, busy: bool) -> None:
        self.busy, self.waiting = busy, 0


class _State:
    def __init__(self, busy: bool) -> None:
        self.turns = _Line(busy)
        self.cancels = 0

    def cancel_current(self) -> bool:
        self.cancels += 1
        return True


def _signal_run(state: _State, monkeypatch: pytest.MonkeyPatch, *, second: bool) -> tuple[list[int], bool]:
    exits: list[int] = []
    monkeypatch.setattr(stopping.os, "_exit", exits.append)
    scope = trio.CancelScope()
    stopped: list[bool] = []

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(stopping.watch_signals, state, scope)
            os.kill(os.getpid(), signal.SIGTERM)
            await trio.sleep(0.5)
            if second:
                assert exits == [] and not scope.cancel_called
                os.kill(os.getpid(), signal.SIGTERM)
                await trio.sleep(0.5)
            stopped.append(scope.cancel_called)
            nursery.cancel_scope.cancel()

    trio.run(run)
    return exits, stopped[0]


def test_first_signal_cancels_the_answer_then_stops(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    state = _State(busy=False)
    exits, stopped = _signal_run(state, monkeypatch, second=False)
    assert stopped and exits == []
    assert capsys.readouterr().err.count("stopping on SIGTERM") == 1


def test_second_signal_ends_at_once(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An answer that will not end holds the first stop; the second signal does not wait."""
    state = _State(busy=True)
    exits, stopped = _signal_run(state, monkeypatch, second=True)
    assert state.cancels >= 2                    # the running answer is cancelled, again and again
    assert exits == [128 + signal.SIGTERM] and not stopped
    assert "a second SIGTERM: stopping at once" in capsys.readouterr().err


def test_log_not_doubled_when_stderr_is_the_log_itself(tmp_path: Path) -> None:
    """Under launchd the server's stderr is the log file: the tee does not echo into it."""
    log = tmp_path / "server.log"
    with open(log, "ab") as err:
        tee = subprocess.Popen([sys.executable, "-m", "bmoe.service.logtee", str(log)],
                               stdin=subprocess.PIPE, stderr=err)
    assert tee.stdin is not None
    tee.stdin.write(b"one\ntwo\n")
    tee.stdin.close()
    assert tee.wait(60) == 0
    assert [_stamped(x) for x in log.read_text().splitlines()] == ["one", "two"]
