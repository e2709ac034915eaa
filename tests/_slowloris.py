"""A slowloris and a normal client side by side, as a script the tests run (from this
machine, or inside a network namespace with ``ip netns exec``).

    python tests/_slowloris.py HOST PORT --tricklers N --seconds S [--key KEY]

``N`` connections each send a request head one byte per ``--interval`` seconds and never
finish it; one that the server closes is opened again after an interval (an attacker
simply reconnects). Meanwhile a normal client sends ``GET /api/info`` on a fresh
connection every 0.1 s. Prints one JSON object:

    {"seconds": S, "info": [[seconds_taken, status], ...],
     "tricklers": [[opened_at, closed_at or null, first_answer_status or null], ...]}

Times are seconds since the script began; ``closed_at`` is when the server closed (end of
file or a reset), ``null`` when it was still open at the end.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--tricklers", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--key")
    args = parser.parse_args()
    start = time.monotonic()
    info: list[list[float]] = []
    client = threading.Thread(target=normal_client, daemon=True, args=(
        args.host, args.port, args.key, start + args.seconds, info))
    client.start()
    tricklers = trickle(args.host, args.port, args.tricklers, args.seconds, args.interval, start)
    client.join()
    print(json.dumps({"seconds": args.seconds, "info": info, "tricklers": [
        [round(t.opened, 4), None if t.closed is None else round(t.closed, 4), t.status()]
        for t in tricklers]}))


if __name__ == "__main__":
    main()
