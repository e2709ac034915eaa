"""Live events (`GET /api/events`) and the config through the HTTP API."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from _clients import (
    EventStream,
    WebSocketClient,
    WebSocketRefused,
    host_port,
    quick_server,  # noqa: F401 - a fixture
)
from conftest import ServerProcess, start_server

from bmoe.cli import build_parser
from bmoe.engine import params
from bmoe.runtime.events import SUBSCRIBER_QUEUE, EventBus

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOKEN_KEYS = {"step", "steps", "wall_ms", "io_ms", "compute_ms", "mgmt_ms", "stall_ms",
              "flash_wait_ms", "read_mib", "cache_hit_pct", "cache_budget_mib", "rss_mib",
              "mem_available_mib", "majflt", "cpu_ms", "dense_resident_frac", "mtp_batch"}
DONE_KEYS = {"cancelled", "tokens", "tok_s", "load_s", "prefill_s", "prefill_tps",
             "prefill_read_mib", "prefill_dev_tokens", "n_prompt", "n_past", "cache_hit_pct",
             "read_mib", "io_s_tok", "compute_s_tok", "stall_s_tok", "flash_wait_s_tok",
             "mgmt_s_tok", "majflt_tok", "cpu_s_tok", "loop_overhead_s_tok",
             "cache_resident_mib", "cache_budget_mib", "cache_evictions", "cache_rereads",
             "cache_discarded", "token_demand_mib", "mtp_drafted", "mtp_accepted",
             "mtp_decodes", "drafted_steps", "mtp_draft_s_tok", "ttft_s"}


def chat(server: ServerProcess, max_tokens: int, text: str = "Tell me about rivers.") -> Any:
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **NO_THINK})
    assert status == 200, body
    return body


def tokens_and_done(events: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tokens = [d for n, d in events if n == "token"]
    assert events[-1][0] == "done"
    return tokens, events[-1][1]


# --- a chat turn, seen live -----------------------------------------------------------

def test_state_then_tokens_then_done(server: ServerProcess) -> None:
    stream = EventStream(server.url)
    try:
        assert stream.status == 200
        assert stream.resp.getheader("Content-Type", "").startswith("text/event-stream")
        name, info = stream.next()
        assert name == "state" and info["state"] == "ready" and info["model"]["n_ctx"] == 4096
        body = chat(server, 24)
        tokens, done = tokens_and_done(stream.until("done"))
        name, log = stream.next()
    finally:
        stream.close()
    n = body["usage"]["completion_tokens"]
    assert [t["step"] for t in tokens] == list(range(1, n + 1))
    assert all(t["steps"] == 24 for t in tokens)
    streaming = info["model"]["streaming"]
    for t in tokens:
        assert TOKEN_KEYS <= set(t) <= TOKEN_KEYS | {"cpu_temp_c"}
        assert t["wall_ms"] >= t["compute_ms"] >= 0 and t["rss_mib"] > 0
        if streaming:  # the expert cache's figures are measured
            assert 0 <= t["cache_hit_pct"] <= 100 and 0 <= t["dense_resident_frac"] <= 1
        else:
            assert t["cache_hit_pct"] == -1 and t["dense_resident_frac"] == -1
    assert set(done) == DONE_KEYS
    assert done == body["bmoe"]["summary"] and done["tokens"] == n
    assert name == "log" and log["level"] == "info" and log["message"].startswith("answer: ")


def test_config_and_decide_events(server: ServerProcess) -> None:
    stream = EventStream(server.url)
    try:
        stream.next()
        status, _, put = server.request("PUT", "/api/config", {"values": {"top-k": 7}})
        assert status == 200
        name, data = stream.next()
        assert name == "config" and data["values"]["top-k"] == 7 and "top-k" in data["user_keys"]
        server.request("PUT", "/api/config", {"reset": ["top-k"]})
        name, data = stream.next()
        assert name == "config" and "top-k" not in data["user_keys"]
        status, _, answer = server.request("POST", "/api/decide",
                                           {"prefix": "Pick: ", "choices": ["A", "B"]})
        assert status == 200
        events = stream.until("decide")
    finally:
        stream.close()
    assert events[-1][1] == answer


# --- the stream limit ---------------------------------------------------------------------

def test_ninth_stream_is_refused_and_a_closed_one_frees_its_place(server: ServerProcess) -> None:
    streams = [EventStream(server.url) for _ in range(8)]
    try:
        for s in streams:
            assert s.status == 200 and s.next()[0] == "state"
        ninth = EventStream(server.url)
        assert ninth.status == 503 and ninth.error()["code"] == "streams_full"
        ninth.close()
        with pytest.raises(WebSocketRefused) as refused:   # the WebSocket shares the limit
            WebSocketClient(server.url)
        assert refused.value.status == 503 and refused.value.body["code"] == "streams_full"
        streams.pop().close()
        deadline = time.monotonic() + 1.0   # "gives its place back within a second"
        while True:
            again = EventStream(server.url)
            if again.status == 200:
                streams.append(again)
                break
            again.close()
            assert time.monotonic() < deadline, "the closed stream kept its place"
            time.sleep(0.02)
    finally:
        for s in streams:
            s.close()


# --- slow readers -----------------------------------------------------------------------------

def stalled_subscriber(url: str) -> socket.socket:
    """An event stream whose client never reads (a tiny receive window, never drained)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(host_port(url))
    sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: " + url.split("//")[1].encode()
                 + b"\r\n\r\n")
    return sock


def buffered_bytes(sock: socket.socket) -> int:
    """What reached a stalled client, read only now."""
    sock.setblocking(False)
    got = 0
    try:
        while data := sock.recv(1 << 20):
            got += len(data)
    except BlockingIOError:
        pass
    return got


def timed_turn(server: ServerProcess, n: int) -> tuple[float, dict[str, Any], list[Any]]:
    """A chat turn of n tokens while a reader follows the event stream on a thread."""
    reader = EventStream(server.url)
    reader.next()
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.extend(reader.until("done")))
    thread.start()
    try:
        t0 = time.monotonic()
        summary = chat(server, n, "Go on about boats.")["bmoe"]["summary"]
        elapsed = time.monotonic() - t0
        thread.join(30)
    finally:
        reader.close()
    return elapsed, summary, seen


def test_a_stalled_subscriber_slows_neither_the_turn_nor_another_stream(
        quick_server: ServerProcess) -> None:
    n = 1000   # about 330 kB of events: more than the stalled sockets' buffers take
    base_s, before, _ = timed_turn(quick_server, n)
    stalled = [stalled_subscriber(quick_server.url) for _ in range(2)]
    try:
        stalled_s, during, seen = timed_turn(quick_server, n)
        reached = [buffered_bytes(s) for s in stalled]
    finally:
        for s in stalled:
            s.close()
    tokens, done = tokens_and_done(seen)
    assert during["tokens"] == before["tokens"] == n and done == during
    assert [t["step"] for t in tokens] == list(range(1, n + 1))
    sent = sum(len(json.dumps(d)) for _, d in seen)
    assert all(r < sent / 3 for r in reached), (reached, sent)   # they really were stalled
    # Nothing waited for them (generous: two cores are shared with other work).
    assert stalled_s < 2 * base_s + 1.0, (stalled_s, base_s)


async def test_bus_drops_a_subscriber_that_falls_behind_and_never_blocks() -> None:
    bus = EventBus()
    slow = bus.subscribe()
    fast = bus.subscribe()
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        async def read_fast() -> None:
            async for _name, data in fast.receive:
                got.append(data)

        nursery.start_soon(read_fast)
        for i in range(SUBSCRIBER_QUEUE * 3):
            bus.publish("token", i)      # synchronous: cannot block by construction
            await trio.lowlevel.checkpoint()
        assert slow.dropped and bus.subscribers == 1
        with pytest.raises(trio.EndOfChannel):
            for _ in range(SUBSCRIBER_QUEUE + 1):
                slow.receive.receive_nowait()
        fast.close()
    assert got == list(range(SUBSCRIBER_QUEUE * 3))


# --- the config over HTTP -------------------------------------------------------------------

def get_config(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/api/config")
    assert status == 200
    return body  # type: ignore[no-any-return]


def put_config(srv: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    status, _, result = srv.request("PUT", "/api/config", body)
    assert status == 200, result
    return result  # type: ignore[no-any-return]


def saved(data: Path) -> dict[str, Any]:
    return json.loads((data / "settings.json").read_text())["values"]  # type: ignore[no-any-return]


def test_config_layers_and_persists_across_restarts(tmp_path: Path) -> None:
    defaults = params.defaults(server=True)
    srv = start_server(tmp_path, wait_ready=False)          # launched with --threads 1
    try:
        cfg = get_config(srv)
        assert cfg["launch_keys"] == ["threads"] and cfg["values"]["threads"] == 1
        result = put_config(srv, {"values": {"temp": 0.7, "threads": 3, "ctx-size": 2048}})
        assert result["rejected"] == {} and result["valid"] is True
        assert result["values"]["threads"] == 3 and result["launch_keys"] == []
        assert result["user_keys"] == ["ctx-size", "threads", "temp"]
        refused = put_config(srv, {"values": {"bogus": 1, "temp": "hot"}})
        assert set(refused["rejected"]) == {"bogus", "temp"}
        assert "Temperature" in refused["rejected"]["temp"] and refused["values"]["temp"] == 0.7
        # `args` is the equivalent bmoe-cli command line: it parses back to the values.
        parsed = params.values_from_namespace(build_parser().parse_args(result["args"]))
        assert all(result["values"][k] == v for k, v in parsed.items())
        assert {"temp", "threads", "ctx-size"} <= set(parsed)
    finally:
        srv.stop()
    assert saved(tmp_path) == {"ctx-size": 2048, "threads": 3, "temp": 0.7}

    srv = start_server(tmp_path, "-c", "1024", wait_ready=False)
    try:
        cfg = get_config(srv)
        # Launch flags outrank what an earlier run saved; the rest of the saved values hold.
        assert (cfg["values"]["threads"], cfg["values"]["ctx-size"]) == (1, 1024)
        assert cfg["values"]["temp"] == 0.7 and cfg["launch_keys"] == ["ctx-size", "threads"]
        reset = put_config(srv, {"reset": ["temp", "ctx-size"]})
        assert reset["values"]["temp"] == defaults["temp"] and "temp" not in reset["user_keys"]
        assert reset["values"]["ctx-size"] == defaults["ctx-size"]
        assert "ctx-size" not in reset["launch_keys"]
    finally:
        srv.stop()
    assert saved(tmp_path) == {"threads": 3}   # a launch flag's value is never saved

    srv = start_server(tmp_path, wait_ready=False)
    try:
        cfg = get_config(srv)
        assert cfg["values"]["temp"] == defaults["temp"]
        assert cfg["values"]["ctx-size"] == defaults["ctx-size"] and cfg["values"]["threads"] == 1
    finally:
        srv.stop()


def test_an_invalid_config_is_stored_but_a_load_refuses_it(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, wait_ready=False)
    try:
        result = put_config(srv, {"values": {"cache-mb": 5000, "cache-ceil-mb": 1000}})
        assert result["valid"] is False and "Expert cache" in result["error"]
        assert "--cache" not in result["error"] and "{" not in result["error"]
        status, _, body = srv.request("POST", "/api/session/load", {"model": str(tiny_moe)})
        assert status == 400 and body["code"] == "invalid_config"
        assert get_config(srv)["values"]["cache-mb"] == 5000
    finally:
        srv.stop()
