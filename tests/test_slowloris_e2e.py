"""Slow clients against a real bmoe-server with the tiny MoE loaded, at the real limits.

40 and 200 connections trickle a request head one byte a second (reconnecting when
closed), from loopback and from a network namespace (a real non-loopback peer, against
a server bound to the host side with a key). Throughout: a normal client's
``GET /api/info`` (from the tricklers' own address) answers 200 within 1 s, a streamed
chat started before the attack keeps streaming, and the UI's event stream stays open
and keeps delivering; the tricklers are closed with a 408 at the head deadline, or at
once past their peer's places. ``tests/_slowloris.py`` is the attacker and the normal
client; its report is checked by ``_slowloris.check_attack``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e2e_support import Conn, call, port_of, request_bytes, wait_for
from _slowloris import check_attack
from _netns import veth_namespace
from conftest import ServerProcess, start_server

from bmoe.http import limits

SLOWLORIS = Path(__file__).with_name("_slowloris.py")
ATTACK_S = limits.HEAD_TIMEOUT_S + 3.0
LONG_TURN = {"messages": [{"role": "user", "content": "Tell me a very long story."}],
             "max_tokens": 1_000_000, "stream": True}
KEY = "sl0wl0ris-key"
SUBNET = f"10.216.{os.getpid() % 200 + 20}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"


class Watch:
    """Reads a long response in a thread and records when each chunk arrived."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.times: list[float] = []
        self.ended = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.conn.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                chunk = self.conn.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.ended = True
                return
            self.times.append(time.monotonic())

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.conn.close()

    def max_gap(self, since: float, until: float) -> float:
        times = [since, *(t for t in self.times if since <= t <= until), until]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


def open_chat(port: int, addr: str, headers: list[tuple[str, str]]) -> Conn:
    conn = Conn(port, addr)
    conn.send(request_bytes("POST", "/v1/chat/completions", host=f"{addr}:{port}",
                            headers=[("Content-Type", "application/json"), *headers],
                            body=json.dumps(LONG_TURN).encode(), close=False))
    assert conn.read_head()[0] == 200
    conn.read_until(b'"role":"assistant"')                       # it has the turn: tokens flow
    return conn


def open_events(port: int, addr: str, headers: list[tuple[str, str]]) -> Conn:
    conn = Conn(port, addr)
    conn.send(request_bytes("GET", "/api/events", host=f"{addr}:{port}", headers=headers, close=False))
    assert conn.read_head()[0] == 200
    conn.read_until(b"event: state")
    return conn


def run_attack(port: int, addr: str, tricklers: int, *, key: str | None = None,
               prefix: tuple[str, ...] = ()) -> None:
    """Chat and events open, then the attack; check the report and both streams."""
    headers = [("Authorization", f"Bearer {key}")] if key else []
    chat = Watch(open_chat(port, addr, headers))
    events = Watch(open_events(port, addr, headers))
    try:
        began = time.monotonic()
        command = [*prefix, sys.executable, str(SLOWLORIS), addr, str(port), "--tricklers",
                   str(tricklers), "--seconds", str(ATTACK_S), *(["--key", key] if key else [])]
        result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
        ended = time.monotonic()
    finally:
        chat.finish()
        events.finish()
    report = json.loads(result.stdout)
    print(f"\n{tricklers} tricklers from {'a network peer' if prefix else 'loopback'}: "
          f"{summary(report)}; chat max gap {chat.max_gap(began, ended):.3f} s, "
          f"events max gap {events.max_gap(began, ended):.3f} s")
    check_attack(report, tricklers=tricklers, head_timeout=limits.HEAD_TIMEOUT_S,
                 peer_arriving=limits.PEER_ARRIVING)
    assert not chat.ended and chat.max_gap(began, ended) < 1.0, "the chat stopped streaming"
    assert not events.ended and events.max_gap(began, ended) < 1.0, "the event stream went quiet"
    stop_turn(port, addr, key)


def summary(report: dict[str, Any]) -> str:
    took = sorted(t for t, _ in report["info"])
    closed = [t for t in report["tricklers"] if t[1] is not None]
    at_deadline = [t[1] - t[0] for t in closed if t[2] == 408]
    first, last = min(at_deadline, default=math.nan), max(at_deadline, default=math.nan)
    return (f"GET /api/info x{len(took)} median {took[len(took) // 2] * 1000:.1f} ms, "
            f"p90 {took[len(took) * 9 // 10] * 1000:.1f} ms, max {took[-1] * 1000:.1f} ms; "
            f"{len(report['tricklers'])} trickling connections, "
            f"{len(at_deadline)} closed with 408 after {first:.2f}-{last:.2f} s, "
            f"{sum(1 for t in closed if t[2] is None)} closed at once")


def stop_turn(port: int, addr: str, key: str | None) -> None:
    def idle() -> bool:
        if call(port, "GET", "/api/info", addr=addr, key=key).json()["generating"]:
            call(port, "POST", "/api/cancel", addr=addr, key=key)
            return False
        return True
    wait_for(idle, 10, "the engine to be idle")


# --- loopback -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("slowloris"), "-m", str(tiny_moe), "-c", "16384")
    try:
        assert server.info()["state"] == "ready"
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("tricklers", [40, 200])
def test_tricklers_from_loopback(srv: ServerProcess, tricklers: int) -> None:
    run_attack(port_of(srv), "127.0.0.1", tricklers)


# --- a network peer --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    with veth_namespace("slow", SUBNET) as peer:
        yield peer.ns


@pytest.fixture(scope="module")
def network_srv(namespace: str, tmp_path_factory: pytest.TempPathFactory,
                tiny_moe: Path) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("slowloris-net")
    key_file = data / "key"
    key_file.write_text(KEY + "\n")
    server = start_server(data, "--host", HOST_IP, "--api-key-file", str(key_file),
                          "-m", str(tiny_moe), "-c", "16384", wait_ready=False)
    server.key = KEY
    try:
        assert server.wait_state("ready", "error")["state"] == "ready"
        with socket.create_connection((HOST_IP, port_of(server)), timeout=5):
            pass
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("tricklers", [40, 200])
def test_tricklers_from_a_network_peer(network_srv: ServerProcess, namespace: str, tricklers: int) -> None:
    run_attack(port_of(network_srv), HOST_IP, tricklers, key=KEY,
               prefix=("ip", "netns", "exec", namespace))
