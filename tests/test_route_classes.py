"""Every route answers as its registration says, in every launch mode, from this machine
and from the network.

A route states what it is once, where it is registered: its access class (public, the
key, local-only), its errors' shape, whether it runs the model. These tests hold the
server to that without a list of routes of their own:

* For each launch mode (plain, ``--autoload``, ``--models-only``; a key, none,
  ``--no-api-key``) the routes are read from the table itself: every registered route
  (``build_routes``) with what its registration declares, and any other route of the
  table ``bmoe-server`` builds for that command line (``main.route_table``, wrappers
  included). A real ``bmoe-server`` process is started with the same command line on
  the built-in ``--demo`` model, and every one of those routes is asked from a loopback
  peer and, when the server listens beyond loopback, from a real non-loopback peer (a
  network namespace joined by a veth pair), with the key and without it. On loopback
  only, the network peer must reach nothing. A route added later is asked too, with no
  change here.
* Each request declares a body one byte over its route's body limit and sends none.
  The server refuses that with 413 only once every access check has let the request
  through and the route was found, before any handler runs: a 413 says "admitted to
  this route", and nothing is shut down, loaded or written by the probes.
* Expected: without the key (when the server has one) every route but a public one is
  401; a local-only route from the network is 403 ``local_only``; everything else is
  admitted (413). Every answer is in the route's declared error shape.

The wrapper ``--autoload`` puts around the table keeps every attribute of every route
(the bug this guards: it dropped ``local_only`` and opened those routes to the network).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import pytest
import trio
from _app_routes import concrete
from _netns import Peer, veth_namespace
from conftest import ServerProcess, start_server

from bmoe.http.access import AccessPolicy, check_access
from bmoe.http.errors import HTTPError
from bmoe.http.routes import Access, Route, RouteTable
from bmoe.http.server import HttpApp
from bmoe.http.types import Request, Response
from bmoe.server import shapes
from bmoe.server.main import all_routes as build_routes
from bmoe.server.main import build_parser, route_table
from bmoe.service.autoload import with_autoload

KEY = "r0ute-classes-k3y"
SUBNET = f"10.219.{os.getpid() % 250}"
HOST_IP = f"{SUBNET}.1"
OWN = "bmoe"          # the server's own {"error", "code"} (a route's shape None)


# --- the launch modes ------------------------------------------------------------------

@dataclass(frozen=True)
class Mode:
    name: str
    flags: tuple[str, ...]       # the mode's own flags; "KEYFILE" stands for the key file
    network: bool                # listens beyond loopback (0.0.0.0): a network peer reaches it

    @property
    def keyed(self) -> bool:
        return "KEYFILE" in self.flags

    def args(self, key_file: Path) -> list[str]:
        """What start_server is given (it adds --port 0, --data-dir, --no-auto, --threads 1)."""
        return ["--demo", *(str(key_file) if f == "KEYFILE" else f for f in self.flags)]

    def argv(self, data: Path, key_file: Path) -> list[str]:
        """The whole command line the server process runs with."""
        return ["--port", "0", "--data-dir", str(data), "--no-auto", "--threads", "1",
                *self.args(key_file)]


NET = ("--host", "0.0.0.0")
MODES = [
    Mode("plain", (), network=False),
    Mode("plain, key", ("--api-key-file", "KEYFILE"), network=False),
    Mode("network, key", (*NET, "--api-key-file", "KEYFILE"), network=True),
    Mode("network, --no-api-key", (*NET, "--no-api-key"), network=True),
    Mode("--autoload", ("--autoload",), network=False),
    Mode("--autoload, network, key", ("--autoload", *NET, "--api-key-file", "KEYFILE"),
         network=True),
    Mode("--autoload, network, --no-api-key", ("--autoload", *NET, "--no-api-key"),
         network=True),
    Mode("--models-only, network, key", ("--models-only", *NET, "--api-key-file", "KEYFILE"),
         network=True),
    Mode("--models-only, --autoload, network, --no-api-key",
         ("--models-only", "--autoload", *NET, "--no-api-key"), network=True),
]


def routes_for(argv: list[str]) -> list[Route]:
    """Every route bmoe-server serves for this command line, with its registration's
    attributes: each route registered (``build_routes``) and any other the served table
    (``main.route_table``, its wrappers included) holds. A wrapper that lost an attribute
    or a route is then caught by the server's answers. Handlers are never called here."""
    state = SimpleNamespace(wake=lambda: None)
    registered = list(build_routes(state))  # type: ignore[arg-type]
    served = route_table(state, build_parser().parse_args(argv))
    known = {(r.method, r.pattern.text) for r in registered}
    return registered + [r for r in served if (r.method, r.pattern.text) not in known]


# --- a real non-loopback peer (required: a failure, never a skip) -----------------------

@contextmanager
def required_namespace() -> Iterator[Peer]:
    cm = veth_namespace("routes", SUBNET)
    try:
        peer = cm.__enter__()
    except pytest.skip.Exception as exc:
        pytest.fail("these tests need a real non-loopback peer (a network namespace, as root "
                    f"with iproute2) and could not make one: {exc.msg}")
    try:
        yield peer
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    with required_namespace() as p:
        yield p


# --- probes ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    route: Route
    target: str
    from_network: bool
    with_key: bool

    def raw(self, host: str) -> str:
        lines = [f"{self.route.method} {self.target} HTTP/1.1", f"Host: {host}",
                 "Content-Type: application/json",
                 f"Content-Length: {self.route.body_limit + 1}", "Connection: close"]
        if self.with_key:
            lines.append(f"Authorization: Bearer {KEY}")
        return "\r\n".join(lines) + "\r\n\r\n"

    def expected(self, keyed: bool) -> tuple[int, str]:
        access = self.route.access
        if keyed and not self.with_key and access is not Access.PUBLIC:
            return 401, "unauthorized"
        if access is Access.LOCAL_ONLY and self.from_network:
            return 403, "local_only"
        return 413, "too_large"                  # admitted: past every check, at the route

    def __str__(self) -> str:
        where = "network" if self.from_network else "loopback"
        key = "key" if self.with_key else "no key"
        return (f"{self.route.method} {self.route.pattern.text} [{self.route.access.value}] "
                f"from {where}, {key}")


# Runs in the namespace (and, as a module function, on loopback): each raw request on its
# own connection; prints [status, body] per request, status -1 when nothing answered.
CLIENT = r"""
import json, socket, sys

def ask(host, port, raw):
    try:
        s = socket.create_connection((host, port), timeout=20)
    except OSError:
        return [-1, None]
    with s:
        s.sendall(raw.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return [-1, None]
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = [int(l.split(b":", 1)[1]) for l in lines if l.lower().startswith(b"content-length:")]
        while length and len(body) < length[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        return [int(lines[0].split()[1]), parsed]

if __name__ == "__main__":
    host, port, raws = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
    print(json.dumps([ask(host, port, raw) for raw in raws]))
"""
_client: dict[str, Any] = {}
exec(compile(CLIENT, "<route-classes client>", "exec"), _client)


def ask_from_loopback(port: int, probes: list[Probe]) -> list[list[Any]]:
    return [_client["ask"]("127.0.0.1", port, p.raw(f"127.0.0.1:{port}")) for p in probes]


def ask_from_network(peer: Peer, port: int, probes: list[Probe]) -> list[list[Any]]:
    raws = [p.raw(f"{peer.host_ip}:{port}") for p in probes]
    done = subprocess.run(["ip", "netns", "exec", peer.ns, sys.executable, "-c", CLIENT,
                           peer.host_ip, str(port)], input=json.dumps(raws),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the client in the namespace failed: {done.stderr}"
    answers: list[list[Any]] = json.loads(done.stdout)
    return answers


def shape_of(body: Any) -> str | None:
    """Which error shape a body is in (None: none of the known ones)."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, str) and isinstance(body.get("code"), str):
        return OWN
    if body.get("type") == "error" and isinstance(err, dict) and "message" in err:
        return shapes.ANTHROPIC
    if isinstance(err, dict) and isinstance(err.get("code"), int) and "type" in err:
        return shapes.LLAMA
    if isinstance(err, dict) and "param" in err and isinstance(err.get("code"), str):
        return shapes.RESPONSES
    return None


def code_in(body: dict[str, Any], shape: str | None) -> str | int | None:
    """The refusal's code as the shape carries it (Anthropic's carries a type only)."""
    if shape == OWN:
        return body["code"]
    if shape in (shapes.LLAMA, shapes.RESPONSES):
        return body["error"]["code"]
    return None


def wrong_answers(probes: list[Probe], answers: list[list[Any]], keyed: bool) -> list[str]:
    wrong = []
    for probe, (status, body) in zip(probes, answers, strict=True):
        want_status, want_code = probe.expected(keyed)
        want_shape = probe.route.shape or OWN
        got_shape = shape_of(body)
        problems = []
        if status != want_status:
            problems.append(f"status {status}, expected {want_status} {want_code}")
        if got_shape != want_shape:
            problems.append(f"error shape {got_shape}, declared {want_shape}")
        elif status == want_status:
            code = code_in(body, got_shape)
            if code not in (None, want_code, want_status):
                problems.append(f"code {code!r}, expected {want_code!r}")
        if problems:
            wrong.append(f"{probe}: {'; '.join(problems)}: {json.dumps(body)[:200]}")
    return wrong


def probes_for(routes: list[Route], *, from_network: bool, keyed: bool) -> list[Probe]:
    keys = [True, False] if keyed else [False]
    return [Probe(r, concrete(r.pattern.text), from_network, k) for r in routes for k in keys]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


def serve(mode: Mode, data: Path, key_file: Path) -> ServerProcess:
    srv = start_server(data, *mode.args(key_file), wait_ready=False)
    srv.key = KEY if mode.keyed else None
    info = srv.wait_state("ready", "error")
    assert info["state"] == "ready", f"{mode.name}: the demo model did not load: {info}"
    return srv


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_every_route_answers_as_registered(mode: Mode, peer: Peer, key_file: Path,
                                           tmp_path: Path) -> None:
    data = tmp_path / "data"
    routes = routes_for(mode.argv(data, key_file))
    classes = {r.access for r in routes}
    assert classes == set(Access), f"the table lacks a class, so a probe proves little: {classes}"
    srv = serve(mode, data, key_file)
    try:
        port = int(srv.url.rsplit(":", 1)[1])
        local = probes_for(routes, from_network=False, keyed=mode.keyed)
        wrong = wrong_answers(local, ask_from_loopback(port, local), mode.keyed)
        network = probes_for(routes, from_network=True, keyed=mode.keyed)
        answers = ask_from_network(peer, port, network)
        if mode.network:
            wrong += wrong_answers(network, answers, mode.keyed)
        else:                                # bound to loopback: the network reaches nothing
            wrong += [f"{p}: answered {s} although the server listens on loopback only"
                      for p, (s, _) in zip(network, answers, strict=True) if s != -1]
        assert srv.proc.poll() is None, "the server stopped during the probes"
    finally:
        srv.stop()
    assert not wrong, f"{mode.name}: {len(wrong)} of {len(local) + len(network)} answers " \
                      "do not match the route's registration:\n" + "\n".join(wrong)


# --- wrapping the table keeps every attribute ---------------------------------------------

def test_autoload_keeps_every_route_attribute() -> None:
    table = build_routes(SimpleNamespace())  # type: ignore[arg-type]
    woken = with_autoload(table, SimpleNamespace(wake=lambda: None))  # type: ignore[arg-type]
    before, after = list(table), list(woken)
    assert [(r.method, r.pattern.text) for r in after] == [(r.method, r.pattern.text) for r in before]
    kept = [f.name for f in dataclasses.fields(Route) if f.name != "handler"]
    for old, new in zip(before, after, strict=True):
        for name in kept:
            assert getattr(new, name) == getattr(old, name), \
                f"{old.method} {old.pattern.text}: --autoload changed its {name}"
        if old.model:
            assert new.handler is not old.handler, f"{old.pattern.text} does not wake the model"
        else:
            assert new.handler is old.handler, f"{old.pattern.text} wakes the model needlessly"
    assert any(r.access is Access.LOCAL_ONLY for r in after), "no local-only route to keep"
    assert any(r.model for r in after), "no route that runs the model"


def test_a_wrapper_waits_for_nothing_but_runs_wake_first() -> None:
    order: list[str] = []

    async def handler(request: Request) -> Response:
        order.append("handler")
        return Response.json({})

    table = RouteTable()
    table.add("POST", "/api/run", handler, model=True, access=Access.LOCAL_ONLY, shape="x")
    table.add("GET", "/api/look", handler)
    woken = with_autoload(table, SimpleNamespace(wake=lambda: order.append("wake")))  # type: ignore[arg-type]
    run, look = list(woken)
    assert (run.access, run.shape, run.model) == (Access.LOCAL_ONLY, "x", True)
    request = Request("POST", "/api/run", "/api/run", {}, [], b"", ("127.0.0.1", 1), ("127.0.0.1", 2))
    trio.run(run.handler, request)
    trio.run(look.handler, request)
    assert order == ["wake", "handler", "handler"]


@pytest.mark.parametrize("method,pattern", [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/responses"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/api/decide"), ("POST", "/completion"),
    ("POST", "/v1/completions"), ("POST", "/chat/completions"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/v1/chat/completions/input_tokens"),
])
def test_the_routes_that_run_the_model_say_so(method: str, pattern: str) -> None:
    assert _route(method, pattern).model


@pytest.mark.parametrize("method,pattern", [("GET", "/health"), ("GET", "/props"),
                                            ("GET", "/slots"), ("GET", "/metrics"),
                                            ("GET", "/api/info"), ("GET", "/v1/models")])
def test_status_routes_do_not_wake_the_model(method: str, pattern: str) -> None:
    assert not _route(method, pattern).model     # a health probe must not load a model


def _route(method: str, pattern: str) -> Route:
    found = [r for r in build_routes(SimpleNamespace())  # type: ignore[arg-type]
             if (r.method, r.pattern.text) == (method, pattern)]
    assert found, f"{method} {pattern} is not registered"
    return found[0]


# --- paths no route answers: the key, and the shape of the route they lie below -------------

APP = HttpApp(build_routes(SimpleNamespace()), AccessPolicy("0.0.0.0", port=8765, api_key=KEY),  # type: ignore[arg-type]
              error_shaper=shapes.error_shaper)


def _req(method: str, target: str, key: bool) -> Request:
    headers = [("host", "192.0.2.1:8765"), ("content-type", "application/json")]
    if key:
        headers.append(("authorization", f"Bearer {KEY}"))
    return Request(method, target, unquote(target), {}, headers, b"", ("192.0.2.9", 5), ("0.0.0.0", 8765))


@pytest.mark.parametrize("method,target,shape", [
    ("GET", "/api/nope", OWN), ("GET", "/v1/nope", OWN), ("POST", "/v1/models", OWN),
    ("GET", "/v1/models/a/b", shapes.LLAMA), ("GET", "/v1/models/", shapes.LLAMA),
    ("POST", "/completion/x", shapes.LLAMA), ("GET", "/slots/", shapes.LLAMA),
    ("PUT", "/props", shapes.LLAMA), ("GET", "/health/x", shapes.LLAMA),
    ("POST", "/v1/messages/x", shapes.ANTHROPIC), ("GET", "/v1/messages", shapes.ANTHROPIC),
    ("POST", "/v1/responses/r1", shapes.RESPONSES), ("POST", "/chat/completions/x", shapes.LLAMA),
    ("POST", "/api/tags", OWN),
])
def test_a_path_no_route_answers_needs_the_key_and_takes_its_familys_shape(
        method: str, target: str, shape: str) -> None:
    with pytest.raises(HTTPError) as refused:
        APP.dispatch(_req(method, target, key=False))
    assert refused.value.status == 401, target
    with pytest.raises(HTTPError) as missing:
        APP.dispatch(_req(method, target, key=True))
    assert missing.value.status in (404, 405), target
    for err in (refused.value, missing.value):
        answer = APP.error_response(_req(method, target, key=True), err)
        assert shape_of(json.loads(answer.body)) == shape, (target, answer.body)


def test_public_stays_public_under_another_method() -> None:
    """`POST /health` is a 405, without the key, in llama-server's shape (as it was)."""
    with pytest.raises(HTTPError) as info:
        APP.dispatch(_req("POST", "/health", key=False))
    assert info.value.status == 405
    answer = APP.error_response(_req("POST", "/health", key=False), info.value)
    assert shape_of(json.loads(answer.body)) == shapes.LLAMA


@pytest.mark.parametrize("target", ["/", "/index.html", "/apix", "/v1x", "/assets/app.js"])
def test_paths_outside_every_routes_first_segment_are_not_the_api(target: str) -> None:
    found = check_access(_req("GET", target, key=False), APP.policy, APP.routes)
    assert found.access is None and found.route is None
