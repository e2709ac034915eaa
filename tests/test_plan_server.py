"""The plan routes on a real server: GET /api/plan, apply, auto-plan, 409s, the routing record."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bmoe.models.probe import probe_file
from bmoe.planner.routing import (cost_path, read_costs, read_record, read_trial, record_path,
                                  trial_path)
from conftest import ServerProcess, start_server


class EventTap:
    """Every event of GET /api/events, read in a thread."""

    def __init__(self, srv: ServerProcess) -> None:
        self.events: list[tuple[str, Any]] = []
        self._resp = urllib.request.urlopen(srv.url + "/api/events", timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        name = ""
        try:
            for raw in self._resp:
                line = raw.decode().rstrip("\n")
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    self.events.append((name, json.loads(line[5:])))
        except Exception:  # noqa: BLE001 - the stream ends when the test closes it
            pass

    def wait_for(self, pred: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pred(n, d) for n, d in list(self.events)):
                return
            time.sleep(0.05)
        raise AssertionError(f"no such event in {self.events[-20:]}")

    def close(self) -> None:
        # call after the server stopped: the stream has ended and the reader with it
        # (closing a response another thread is reading from can deadlock)
        self._thread.join(10)


def chat(srv: ServerProcess, n: int = 24) -> tuple[int, Any]:
    status, _, body = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": n, "temperature": 0})
    return status, body


def test_plan_routes_apply_and_reload(tmp_path: Path, tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "-m", str(tiny_moe))
    try:
        info = srv.info()
        assert info["planner_available"] is True
        assert srv.request("GET", "/api/plan?cached=1")[2] == {"available": True, "none": True}
        status, _, plan = srv.request("GET", "/api/plan")
        assert status == 200, plan
        assert plan["available"] is True and plan["regime"] == "resident"
        assert "warning" in plan          # measured with the model loaded
        knobs = {d["knob"]: d for d in plan["decisions"]}
        assert knobs["threads"]["source"] == "operator"       # --threads 1 at launch
        assert "threads" not in plan["values"]
        assert plan["values"]["moe-stream"] is False
        before = srv.request("GET", "/api/config")[2]
        status, _, config = srv.request("POST", "/api/plan/apply", {})
        assert status == 200, config
        assert config["plan"] and {d["knob"] for d in config["plan"]} == set(knobs)
        assert config["user_keys"] == before["user_keys"]
        assert config["values"]["moe-stream"] is False
        assert config["values"]["threads"] == 1
        assert srv.request("GET", "/api/plan?cached=1")[2]["cached"] is True
    finally:
        srv.stop()
    srv = start_server(tmp_path, wait_ready=False)   # the same data folder: the plan was saved
    try:
        config = srv.request("GET", "/api/config")[2]
        assert config["plan"] and config["values"]["moe-stream"] is False
        assert "moe-stream" not in config["user_keys"]
        status, _, _ = srv.request("POST", "/api/session/load", {"model": str(tiny_moe)})
        assert status == 202
        info = srv.wait_state("ready", "error")
        assert info["state"] == "ready", info
        assert info["model"]["streaming"] is False        # loaded with the plan's values
        assert info["model"]["streaming_notes"] == {}
    finally:
        srv.stop()


def test_409_while_generating_and_for_a_second_measurement(tmp_path: Path,
                                                           tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "8192")
    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(chat, srv, 6000)
            deadline = time.monotonic() + 20
            while not srv.info()["generating"] and time.monotonic() < deadline:
                time.sleep(0.01)
            status, _, body = srv.request("GET", "/api/plan?measure=1")
            srv.request("POST", "/api/cancel", {})
            long.result()
        assert status == 409 and "generation is running" in json.dumps(body), body
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: srv.request("GET", "/api/plan?measure=1"),
                                    range(3)))
        codes = sorted(a[0] for a in answers)
        assert codes[0] == 200 and 409 in codes, codes
        busy = [a[2] for a in answers if a[0] == 409][0]
        assert "already running" in json.dumps(busy), busy
    finally:
        srv.stop()


def test_auto_plan_load_progress_measured_and_routing_record(tmp_path: Path,
                                                             tiny_moe: Path) -> None:
    srv = start_server(tmp_path, "--auto", "--moe-stream", "-c", "4096", wait_ready=False)
    tap = EventTap(srv)
    try:
        assert srv.request("GET", "/api/config")[2]["auto_plan"] is True
        status, _, _ = srv.request("POST", "/api/session/load", {"model": str(tiny_moe)})
        assert status == 202
        tap.wait_for(lambda n, d: n == "state" and d["state"] == "planning")
        with ThreadPoolExecutor(1) as pool:     # a request while it plans waits for the load
            early = pool.submit(chat, srv, 4)
            info = srv.wait_state("ready", "error")
            assert early.result()[0] == 200, early.result()
        assert info["state"] == "ready", info
        steps = [d["step"] for n, d in tap.events if n == "plan_progress"]
        assert steps[:5] == ["model", "compute", "storage", "memory", "rules"]
        assert steps[-1] == "done"
        assert info["model"]["streaming"] is True       # --moe-stream is the operator's
        plan = srv.request("GET", "/api/plan")[2]
        assert plan["from_last_load"] is True and plan["regime"] == "experts-stream"
        for _ in range(2):
            status, body = chat(srv, 24)
            assert status == 200, body
        deadline = time.monotonic() + 10
        while "measured" not in plan and time.monotonic() < deadline:
            plan = srv.request("GET", "/api/plan?cached=1")[2]
            time.sleep(0.1)
        assert plan["measured"]["tokens"] > 0 and plan["measured"]["s_per_token"] > 0
        assert "s_per_token" in plan["predicted"]
        p = probe_file(tiny_moe)
        size = tiny_moe.stat().st_size
        folder = tmp_path / "routing"
        # the record is written after each turn's end, off the answer's path: the early
        # 4-token answer's rows can be there before the two 24-token answers' are
        deadline = time.monotonic() + 10
        while True:
            rec, warning = read_record(record_path(folder, tiny_moe, size), size=size,
                                       n_layer=p.n_moe_layer, n_expert=p.n_expert,
                                       n_expert_used=p.n_expert_used)
            if (rec is not None and rec.tokens >= 24) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert warning == "" and rec is not None and rec.tokens >= 24
        costs, _ = read_costs(cost_path(folder, tiny_moe, size))
        assert costs
        # the next plan of the same configuration prices with what decode measured
        again = srv.request("GET", "/api/plan?measure=1")[2]
        notes = {d["knob"]: d for d in again["decisions"]}
        assert notes["hit-curve"]["source"] == "measured"
    finally:
        srv.stop()
        tap.close()


def test_the_first_answer_calibrates_and_the_next_plan_reads_it(tmp_path: Path,
                                                              tiny_moe: Path) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: there is no second thread count to try")
    srv = start_server(tmp_path, "--auto", "-m", str(tiny_moe), "-c", "4096", threads=None)
    try:
        plan = srv.request("GET", "/api/plan")[2]
        assert plan["from_last_load"] is True
        tried = plan["values"]["trial-threads"]
        assert tried != plan["values"]["threads"], plan["values"]
        size = tiny_moe.stat().st_size
        file = trial_path(tmp_path / "routing", tiny_moe, size)
        for _ in range(3):
            assert chat(srv, 40)[0] == 200
            if file.exists():
                break
        deadline = time.monotonic() + 10
        while not file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        verdict, warning = read_trial(file)
        assert warning == "" and verdict is not None and verdict["threads_measured"]
        assert sorted(a["threads"] for a in verdict["arms"]) == sorted(
            [plan["values"]["threads"], tried])
        again = srv.request("GET", "/api/plan?measure=1")[2]
        threads = next(d for d in again["decisions"] if d["knob"] == "threads")
        assert threads["source"] == "measured" and "measured on this model" in threads["brief"]
        assert again["values"]["threads"] == verdict["threads"]
        assert "trial-threads" not in again["values"]
    finally:
        srv.stop()


def test_a_hostile_routing_record_is_ignored_by_the_server(tmp_path: Path,
                                                           tiny_moe: Path) -> None:
    size = tiny_moe.stat().st_size
    folder = tmp_path / "routing"
    folder.mkdir()
    record_path(folder, tiny_moe, size).write_bytes(b"BMOE-ROUTING 1\n{\"tokens\": -1}\n\xff")
    cost_path(folder, tiny_moe, size).write_bytes(b"\x00not json")
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "4096")
    try:
        status, _, plan = srv.request("GET", "/api/plan")
        assert status == 200 and plan["regime"], plan
        assert "ignored" in plan["measurements"]["routing_warning"]
    finally:
        srv.stop()


def test_auto_plan_is_on_by_default_and_a_saved_switch(tmp_path: Path) -> None:
    srv = start_server(tmp_path, wait_ready=False, auto_plan=None)
    try:
        assert srv.request("GET", "/api/config")[2]["auto_plan"] is True
        status, _, body = srv.request("PUT", "/api/config", {"auto_plan": False})
        assert status == 200 and body["auto_plan"] is False
        assert srv.request("PUT", "/api/config", {"auto_plan": "yes"})[0] == 400
        assert srv.request("GET", "/api/plan")[2]["error"].startswith("No model is selected")
    finally:
        srv.stop()
    srv = start_server(tmp_path, wait_ready=False, auto_plan=None)   # the choice was saved
    try:
        assert srv.request("GET", "/api/config")[2]["auto_plan"] is False
    finally:
        srv.stop()
    srv = start_server(tmp_path, wait_ready=False, auto_plan=True)   # --auto, for this run
    try:
        assert srv.request("GET", "/api/config")[2]["auto_plan"] is True
    finally:
        srv.stop()
