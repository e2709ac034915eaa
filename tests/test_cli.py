"""`bmoe-cli`: the telemetry contract's lines, the CSV sink, session mode, the table."""

from __future__ import annotations

import csv
import io
import json
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bmoe import cli
from bmoe.engine import params

PROGRESS_KEYS = ["step", "steps", "wall_ms", "io_ms", "compute_ms", "mgmt_ms", "stall_ms",
                 "read_mb", "cache_hit_pct", "text"]
DONE_KEYS = {"id", "cancelled", "tokens", "tok_s", "prefill_s", "load_s", "cache_hit_pct",
             "n_prompt", "n_past", "cache_resident_mib", "cache_budget_mib", "spec_recall_pct",
             "stall_s_tok", "mgmt_s_tok", "text"}
NUM = r"-?\d+(?:\.\d+)?"
GENERATION_LINE = re.compile(rf"^generation: \d+ tokens, {NUM} s/token \({NUM} tok/s\)$")
STREAM_LINE = re.compile(
    rf"^moe-stream: read {NUM} MiB \({NUM} MiB/token\), decode {NUM} s/token \(compute {NUM} "
    rf"\+ cache mgmt {NUM} \+ flash I/O {NUM} s/token, {NUM} MiB/s\)(, stall_s/tok={NUM})?$")
CACHE_LINE = re.compile(rf"^moe-cache: {NUM}% hit, resident {NUM} MiB$")
CSV_COLUMNS = ["step", "steps", "wall_ms", "io_ms", "compute_ms", "read_bytes",
               "cache_hit_pct", "stall_ms", "mgmt_ms"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def tagged(line: str) -> tuple[str, dict[str, Any]]:
    tag, _, payload = line.partition(" ")
    assert re.fullmatch(r"BMOE_[A-Z]+", tag), line
    return tag, json.loads(payload)


# --- one shot ----------------------------------------------------------------------------------

def test_progress_lines_parse_as_the_contract(tiny_moe: Path, tmp_path: Path) -> None:
    out_csv = tmp_path / "run.csv"
    done = run_cli("-m", str(tiny_moe), "-p", "Tell me a story.", "-n", "12", "--no-think",
                   "-t", "1", "-c", "1024", "--progress", "--csv", str(out_csv))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    answer_at = lines.index("=== answer ===")
    perf_at = lines.index("=== perf ===")
    progress = [tagged(line) for line in lines[:answer_at]]
    assert all(tag == "BMOE_PROGRESS" for tag, _ in progress)   # no reads: no BMOE_LOAD
    records = [p for _, p in progress]
    assert [r["step"] for r in records] == list(range(1, 13))
    texts = [r["text"] for r in records]
    for r in records:
        assert list(r) == PROGRESS_KEYS and r["steps"] == 12
        assert all(isinstance(r[k], float) for k in PROGRESS_KEYS[2:-1])
        assert r["cache_hit_pct"] == -1.0 and r["read_mb"] == 0.0 and r["io_ms"] == 0.0
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert "\n".join(lines[answer_at + 1:perf_at]) == texts[-1]
    perf = [line for line in lines[perf_at + 1:] if line]
    assert len(perf) == 1 and GENERATION_LINE.match(perf[0]), perf   # no streaming, no cache
    assert perf[0].startswith("generation: 12 tokens")

    rows = out_csv.read_text().splitlines()
    assert rows[0] == ",".join(CSV_COLUMNS) and rows[-1].startswith("# summary ")
    assert "stall_s/tok=" in rows[-1] and "mgmt_s/tok=" in rows[-1]
    table = list(csv.DictReader(rows[:-1]))
    assert [int(r["step"]) for r in table] == list(range(1, 13))
    assert all(int(r["read_bytes"]) == 0 and float(r["wall_ms"]) >= 0 for r in table)
    assert [float(r["wall_ms"]) for r in table] == [r["wall_ms"] for r in records]


def test_plain_mode_streams_the_answer_and_prints_only_the_summary(tiny_moe: Path) -> None:
    done = run_cli("-m", str(tiny_moe), "-p", "Hello.", "-n", "6", "--no-think", "-t", "1",
                   "-c", "512")
    assert done.returncode == 0, done.stderr
    assert "BMOE_" not in done.stdout and "===" not in done.stdout and done.stdout.strip()
    assert any(GENERATION_LINE.match(line) for line in done.stderr.splitlines())


def test_missing_model_file_is_an_error(tmp_path: Path) -> None:
    done = run_cli("-m", str(tmp_path / "none.gguf"), "-p", "x")
    assert done.returncode == 1 and "does not exist" in done.stderr


def test_describe_params_is_the_table() -> None:
    done = run_cli("--describe-params")
    assert done.returncode == 0
    assert json.loads(done.stdout) == params.describe(server=False)


# --- the pure formatters (the figures only an expert streamer produces) ---------------------

SUMMARY = {"tokens": 4, "tok_s": 8.0, "read_mib": 40.0, "io_s_tok": 0.05, "compute_s_tok": 0.07,
           "stall_s_tok": 0.01, "mgmt_s_tok": 0.005, "cache_hit_pct": 58.5,
           "cache_resident_mib": 600.0, "prefill_s": 0.2, "n_prompt": 10}


def test_load_line_appears_only_when_experts_were_read() -> None:
    rec = {"step": 1, "steps": 4, "wall_ms": 120.0, "io_ms": 50.0, "compute_ms": 70.0,
           "mgmt_ms": 0.0, "stall_ms": 0.0, "read_mib": 10.0, "cache_hit_pct": 50}
    lines = cli.progress_lines(rec, "Hi").splitlines()
    assert [tagged(line)[0] for line in lines] == ["BMOE_LOAD", "BMOE_PROGRESS"]
    assert tagged(lines[0])[1] == {"mb": 10.0, "ms": 50.0}
    assert tagged(lines[1])[1]["read_mb"] == 10.0
    assert len(cli.progress_lines(dict(rec, read_mib=0.0), "Hi").splitlines()) == 1


def test_perf_lines_with_a_streamer_and_a_cache() -> None:
    lines = cli.perf_lines(SUMMARY, {"overlap": False}).splitlines()
    assert GENERATION_LINE.match(lines[0]) and STREAM_LINE.match(lines[1])
    assert CACHE_LINE.match(lines[2]) and "stall_s/tok" not in lines[1]
    assert "read 40.0 MiB (10.00 MiB/token)" in lines[1] and "200.0 MiB/s" in lines[1]
    overlap = cli.perf_lines(SUMMARY, {"overlap": True}).splitlines()
    assert STREAM_LINE.match(overlap[1]) and overlap[1].endswith("stall_s/tok=0.0100")
    no_cache = cli.perf_lines(dict(SUMMARY, cache_hit_pct=-1), {}).splitlines()
    assert len(no_cache) == 2


# --- session mode -----------------------------------------------------------------------------

class CliSession:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "--session", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.transcript: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode("utf-8").rstrip("\n"))
        self.lines.put(None)

    def send(self, obj: Any) -> None:
        self.send_raw(json.dumps(obj).encode() if not isinstance(obj, bytes) else obj)

    def send_raw(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = 60) -> tuple[str, dict[str, Any]]:
        line = self.lines.get(timeout=timeout)
        assert line is not None, "bmoe-cli ended"
        self.transcript.append(line)
        return tagged(line)

    def expect(self, wanted: str) -> dict[str, Any]:
        tag, obj = self.next()
        assert tag == wanted, (tag, obj)
        return obj

    def turn(self, req_id: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.expect("BMOE_BEGIN") == {"id": req_id}
        progress = []
        while True:
            tag, obj = self.next()
            if tag == "BMOE_DONE":
                return progress, obj
            assert tag == "BMOE_PROGRESS", (tag, obj)
            progress.append(obj)

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.send({"cmd": "close"})
        self.proc.stdin.close()
        code = self.proc.wait(30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return code


HOSTILE = [b"this is not json", b"[1, 2, 3]", b'{"cmd": "rm -rf /"}', b"\xff\xfe{}",
           b'{"cmd": "generate", "id": 2, "prompt": 7}',
           b'{"cmd": "generate", "id": {"a": 1}, "prompt": "x"}',
           b'{"cmd": "generate", "id": 3, "prompt": "x", "n_predict": -5}',
           b'{"cmd": "generate", "id": 4, "prompt": "x", "n_predict": 5000}',
           b'{"cmd": "decide", "id": 5, "prefix": "x", "choices": ["A", "A"]}',
           b'{"cmd": "decide", "id": 6, "choices": "A"}']


def test_session_transcript_with_garbage_and_a_cancel(tiny_moe: Path) -> None:
    s = CliSession("-m", str(tiny_moe), "-t", "1", "-c", "4096")
    try:
        ready = s.expect("BMOE_READY")
        assert ready["arch"] == "qwen3moe" and ready["n_ctx"] == 4096 and ready["load_s"] >= 0
        ask = {"cmd": "generate", "id": 1, "prompt": "Name a colour.", "n_predict": 8,
               "think": False}
        s.send(ask)
        progress, first = s.turn(1)
        assert [p["step"] for p in progress] == list(range(1, 9))
        assert DONE_KEYS <= set(first) and first["id"] == 1 and first["cancelled"] is False
        assert first["tokens"] == 8 and first["text"] == progress[-1]["text"]
        assert first["spec_recall_pct"] == -1

        for line in HOSTILE:
            s.send_raw(line)
            error = s.expect("BMOE_ERROR")
            assert error["fatal"] is False and error["msg"], line
        # ... and the next turn is unaffected.
        s.send(dict(ask, id=7))
        _, again = s.turn(7)
        assert again["text"] == first["text"] and again["tokens"] == 8

        s.send({"cmd": "generate", "id": 8, "prompt": "Go on and on.", "n_predict": 3000,
                "think": False})
        assert s.expect("BMOE_BEGIN") == {"id": 8}
        assert s.expect("BMOE_PROGRESS")["step"] == 1
        s.send({"cmd": "cancel"})
        while (msg := s.next())[0] == "BMOE_PROGRESS":
            pass
        tag, cancelled = msg
        assert tag == "BMOE_DONE" and cancelled["cancelled"] is True
        assert 0 < cancelled["tokens"] < 3000

        # A follow-up in the same conversation reuses the KV prefix.
        s.send({"cmd": "generate", "id": 9, "prompt": "And then?", "n_predict": 4,
                "think": False, "clear_kv": False})
        _, follow = s.turn(9)
        assert follow["cancelled"] is False and follow["n_past"] > follow["n_prompt"] > 0

        s.send({"cmd": "decide", "id": 10, "prefix": "Pick one: ", "suffix": "A or B?",
                "choices": ["A", "B"]})
        decided = s.expect("BMOE_DECIDE")
        assert decided["id"] == 10 and decided["best"] in (0, 1)
        assert len(decided["choice_logp"]) == 2 and decided["cancelled"] is False
        assert s.close() == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_session_eof_runs_what_was_queued_then_ends(tiny_moe: Path) -> None:
    lines = b"\n".join(json.dumps(r).encode() for r in [
        {"cmd": "generate", "id": 1, "prompt": "One.", "n_predict": 3, "think": False},
        {"cmd": "generate", "id": 2, "prompt": "Two.", "n_predict": 3, "think": False}]) + b"\n"
    done = subprocess.run([sys.executable, "-m", "bmoe.cli", "--session", "-m", str(tiny_moe),
                           "-t", "1", "-c", "512"], input=lines, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tags = [tagged(line)[0] for line in done.stdout.decode().splitlines()]
    assert tags == ["BMOE_READY"] + (["BMOE_BEGIN"] + ["BMOE_PROGRESS"] * 3 + ["BMOE_DONE"]) * 2


def test_session_with_no_model_file_is_a_fatal_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bmoe.cli", "--session", "-m",
                           str(tmp_path / "none.gguf")], input=b"", capture_output=True,
                          timeout=60)
    assert done.returncode == 1
    tag, error = tagged(done.stdout.decode().strip())
    assert tag == "BMOE_ERROR" and error["fatal"] is True


@pytest.mark.parametrize("line", [b"", b"   "])
def test_blank_lines_are_ignored(line: bytes) -> None:
    assert cli.parse_request(b'{"cmd": "close"}', {}) == {"cmd": "close", "id": -1}
    inbox: queue.Queue[Any] = queue.Queue()
    cli.read_requests(io.BytesIO(line + b"\n"), inbox, cli.InFlight(),
                      cli.Console(io.StringIO()), {})
    assert inbox.get_nowait() is None


def test_csv_header_is_the_contracts() -> None:
    assert cli.CSV_HEADER == ",".join(CSV_COLUMNS)


# --- output constraints ------------------------------------------------------------------------

def test_grammar_file_constrains_the_answer(tiny_moe: Path, tmp_path: Path) -> None:
    gbnf = tmp_path / "yesno.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    done = run_cli("-m", str(tiny_moe), "-p", "Is the sea blue?", "-n", "16", "--no-think",
                   "-t", "1", "-c", "1024", "--grammar", str(gbnf))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("yes", "no")


def test_json_schema_file_constrains_the_answer(tiny_moe: Path, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False}))
    done = run_cli("-m", str(tiny_moe), "-p", "Answer in JSON.", "-n", "64", "--no-think",
                   "-t", "1", "-c", "1024", "--json-schema", str(schema))
    assert done.returncode == 0, done.stderr
    answer = done.stdout.strip()
    if answer.endswith("}"):                  # completed within the budget: it parses
        assert isinstance(json.loads(answer)["ok"], bool)
    else:
        assert answer.startswith("{")


def test_constraint_flags_refuse_what_they_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    done = run_cli("-m", "x.gguf", "-p", "hi", "--json-schema", str(bad))
    assert done.returncode == 2 and "JSON object schema" in done.stderr
    done = run_cli("-m", "x.gguf", "-p", "hi", "--grammar", str(tmp_path / "missing.gbnf"))
    assert done.returncode == 2 and "cannot read" in done.stderr
