"""A network namespace joined to this one by a veth pair: a real peer that is not loopback.

The security model treats a peer off loopback differently (the key, local-only routes,
the agent's private conversations); only a second network stack shows that for real. The
namespace gets ``<subnet>.2`` and this side ``<subnet>.1``; a test runs its client in the
namespace with ``ip netns exec NS ...``. CI runs as root with iproute2 and must run these
tests: there a missing permission is a failure, elsewhere a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Peer:
    ns: str          # the namespace's name, for ``ip netns exec``
    host_ip: str     # this side of the pair
    ns_ip: str       # the namespace's side


def skip_outside_ci(reason: str) -> None:
    """A real non-loopback peer is required in CI (root, iproute2); elsewhere it may skip."""
    if os.environ.get("CI"):
        pytest.fail("CI must run the network-namespace tests: " + reason)
    pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def veth_namespace(tag: str, subnet: str) -> Iterator[Peer]:
    """A namespace named after `tag` and this process, on `subnet` (``"10.x.y"``); removed
    on exit, whatever happened."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        skip_outside_ci("needs Linux, root and iproute2 to create a network namespace")
    ns = f"bmoe_{tag}_{os.getpid()}"
    veth = f"bm{tag[:2]}{os.getpid() % 100000}"
    peer = Peer(ns, f"{subnet}.1", f"{subnet}.2")
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        skip_outside_ci(f"ip netns is not permitted here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "n")
        _ip("link", "set", veth + "n", "netns", ns)
        _ip("addr", "add", f"{peer.host_ip}/24", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{peer.ns_ip}/24", "dev", veth + "n")
        _ip("netns", "exec", ns, "ip", "link", "set", veth + "n", "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield peer
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
