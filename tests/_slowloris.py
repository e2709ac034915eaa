"""A slowloris and a normal client side by side, as a script the tests run (from this
machine, or inside a network namespace with ``ip netns exec``).

    python tests/_slowloris.py HOST PORT --tricklers N --seconds S [--key KEY]

``N`` connections each send a request head one byte per ``--interval`` seconds and never
finish it; one that the server closes is opened again after an interval (an attacker
simply reconnects). Meanwhile a normal client, a process of its own, sends
``GET /api/info`` on a fresh connection every 0.1 s. Prints one JSON object:

    {"seconds": S, "info": [[seconds_taken, status], ...],
     "tricklers": [[opened_at, closed_at or null, first_answer_status or null], ...]}

Times are seconds since the script began; ``closed_at`` is when the server closed (end of
file or a reset), ``null`` when it was still open at the end. ``check_attack`` is what
the tests ask of such a report.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

HEAD = "GET /api/info HTTP/1.1\r\nHost: {host}\r\nUser-Agent: slowloris\r\nX-Pad: " + "a" * 4000


@dataclass
class Trickler:
    sock: socket.socket
    opened: float
    sent: int = 0
    closed: float | None = None
    received: bytes = field(default=b"")

    def status(self) -> int | None:
        parts = self.received.split(b" ", 2)
        return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None


def normal_client(host: str, port: int, key: str | None, until: float,
                  out: list[list[float]]) -> None:
    lines = ["GET /api/info HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode()
    while time.monotonic() < until:
        began = time.monotonic()
        status = 0
        try:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(request)
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                status = int(data.split(b" ", 2)[1])
        except (OSError, IndexError, ValueError):
            status = -1
        out.append([round(time.monotonic() - began, 4), status])
        time.sleep(0.1)


def open_trickler(host: str, port: int, start: float) -> Trickler | None:
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return None
    sock.setblocking(False)
    return Trickler(sock, time.monotonic() - start)


def trickle(host: str, port: int, count: int, seconds: float, interval: float,
            start: float) -> list[Trickler]:
    head = HEAD.format(host=f"{host}:{port}").encode()
    selector = selectors.DefaultSelector()
    live: list[Trickler] = []
    done: list[Trickler] = []
    until = start + seconds
    next_send = time.monotonic()
    while time.monotonic() < until:
        if time.monotonic() >= next_send:          # once an interval: reconnect, then a byte each
            while len(live) < count and (t := open_trickler(host, port, start)) is not None:
                live.append(t)
                selector.register(t.sock, selectors.EVENT_READ, t)
            for t in live:
                try:
                    t.sock.send(head[t.sent % len(head):][:1])
                    t.sent += 1
                except OSError:
                    pass                   # closed by the server: the read below sees it
            next_send += interval
        for key, _ in selector.select(timeout=max(0.0, min(next_send, until) - time.monotonic())):
            t = key.data
            try:
                chunk = t.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            t.received += chunk
            if not chunk:
                t.closed = time.monotonic() - start
                selector.unregister(t.sock)
                t.sock.close()
                live.remove(t)
                done.append(t)
    for t in live:
        t.sock.close()
    return done + live


def check_attack(report: dict[str, Any], *, tricklers: int, head_timeout: float,
                 peer_arriving: int) -> None:
    """What a slow-client attack (``_slowloris.py``'s report) must leave: every normal
    request answered 200 within 1 s; the tricklers the server let wait closed with a 408
    at the head deadline; the rest closed at once (well before it), unanswered."""
    info = report["info"]
    assert len(info) >= 10, info
    slow = [(took, status) for took, status in info if status != 200 or took >= 1.0]
    assert not slow, f"normal requests slow or refused during the attack: {slow} of {len(info)}"
    closed = [t for t in report["tricklers"] if t[1] is not None]
    timed_out = [t for t in closed if t[2] == 408]
    at_once = [t for t in closed if t[2] is None]
    assert len(timed_out) + len(at_once) == len(closed), closed
    assert timed_out, "no trickler reached the head deadline"
    for opened, closed_at, _ in timed_out:
        assert head_timeout - 0.1 <= closed_at - opened <= head_timeout + 1.0, (opened, closed_at)
    for opened, closed_at, _ in at_once:      # long before the deadline (the client's own
        assert closed_at - opened < head_timeout / 2, (opened, closed_at)   # loop is in this figure)
    if tricklers > peer_arriving:
        assert at_once, "the tricklers past the peer's places were not closed"
    assert len(report["tricklers"]) >= tricklers
    old = [t for t in report["tricklers"] if t[0] < report["seconds"] - head_timeout - 1.0]
    assert old and all(t[1] is not None for t in old), "a trickler outlived the head deadline"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--tricklers", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--key")
    parser.add_argument("--client-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    start = time.monotonic()
    if args.client_only:
        info: list[list[float]] = []
        normal_client(args.host, args.port, args.key, start + args.seconds, info)
        print(json.dumps(info))
        return
    # The normal client is a process of its own, so the attacker's loop cannot slow it.
    client = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--client-only"],
                              stdout=subprocess.PIPE, text=True)
    tricklers = trickle(args.host, args.port, args.tricklers, args.seconds, args.interval, start)
    out, _ = client.communicate()
    print(json.dumps({"seconds": args.seconds, "info": json.loads(out), "tricklers": [
        [round(t.opened, 4), None if t.closed is None else round(t.closed, 4), t.status()]
        for t in tricklers]}))


if __name__ == "__main__":
    main()
