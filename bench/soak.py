"""A soak: many clients at once on two real servers (the tiny MoE streamed, and resident)
for N minutes; requests by status, and the servers' memory, descriptors, threads, trio
tasks and event-bus subscribers sampled every 10 s. Fails on a 5xx, a client that could
not talk to a server, or growth after warm-up.

    .venv/bin/python bench/soak.py --minutes 2 [--clients 8] [--json out.json]

The clients (threads, each a loop of random actions, a fresh connection each time):
streamed chats on the three protocols through the real SDKs (openai chat completions,
anthropic messages, openai Responses), non-streamed chats, a stream dropped mid-answer
(a client that disconnects), `POST /api/cancel` mid-stream, event streams
(`GET /api/events`) and WebSockets (`GET /api/ws`) held for a random while, decide,
`GET /api/models`, `GET /api/plan?cached=1`, config writes (`PUT /api/config`, top-k),
llama-server's `/completion`, `/tokenize`, `/props`; on the resident server, which serves
a vision pair (the model maker's MoE with its projector), chats with an image through the
openai SDK; and agent conversations: created, given a message that the agent answers on
the server's own model, read until the round ends, deleted. At most 12 turn clients and 4
live event streams per server, below the spec's limits (16 waiting turns, 8 streams), so a
503 is a failure too.

Growth: after the warm-up (a fifth of the run, at least 30 s) the clients pause, the
server goes quiet and a *baseline* is sampled; halfway through the rest the clients pause
again for a *mid-run* sample, and at the end they stop for the *final* one (each half
timed from its own start, so a slow quiet sample does not eat the run). Each quiet sample
first generates one token on every server, so that each has a quiet spell starting then
(a slow host's clients end their last actions far apart, and a server quiet early would
have trimmed before the others), and waits for that spell's heap trim
(`bmoe:process_heap_trims_total`), so all three are taken in the same state. RSS fails
when it grew more than 2 % in each half (a leak grows with the work) or more than 10 % in
all (a high-water mark, such as a burst's heaps, steps once); descriptors, trio tasks,
threads and subscribers must be no more at the end than at the baseline. RSS, descriptors and threads are read from
/proc/<pid> (the kernel's figures); trio tasks, subscribers and trims from the server's
`/metrics?process=1` (`bmoe:process_*`, counted at the scrape). A failure names the
mappings (smaps) that grew most.
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anthropic  # noqa: E402
import openai  # noqa: E402

from bmoe.modelmaker import make_model  # noqa: E402
from bmoe.modelmaker.projector import make_vision_pair  # noqa: E402

MOE = dict(n_layer=4, n_embd=128, n_expert=8, n_expert_used=4, n_ff_exp=64,
           residual_scale=0.3)
SAMPLE_S = 10.0
TRIM_WAIT_S = 30.0     # a quiet server trims its heaps after 5 s (bmoe/server/trim.py)
# Every client, SDK or raw HTTP, waits this long for an answer (a request may wait on the
# turn line behind other turns: the streamed server serves one at a time).
CLIENT_TIMEOUT_S = 120.0
# A leak grows with the work, so in both halves of the run; a high-water mark (a burst's
# heaps, the allocator's per-thread arenas) steps once. RSS fails when it grew more than
# RSS_HALF in each half (quiet samples after the warm-up, mid-run and at the end), or
# more than RSS_TOTAL over the whole run.
RSS_HALF = 0.02
RSS_TOTAL = 0.10
N_CTX = 4096
# The servers' n-predict: an answer whose request sets no limit (the agent's rounds) ends
# here. Left at 0 (up to the context), an agent round on the tiny model's random weights
# wrote 4,096 tokens, 29 s on the streamed server, and the turns queued behind it are what
# timed the 30-minute runs' clients out; every other action sets its own max_tokens.
N_PREDICT = 512
PROMPTS = ["Hello there! What is the weather like in Paris today?",
           "Write a short poem about the sea.", "List three colours.",
           "Explain what a kettle does, in one sentence."]


# -- the servers --------------------------------------------------------------------------

class Server:
    def __init__(self, name: str, model: Path, data: Path, *args: str,
                 vision: bool = False) -> None:
        self.name = name
        self.vision = vision
        cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
               "--no-auto", "--threads", "1", "--metrics", "-m", str(model), "-c", str(N_CTX),
               "--n-predict", str(N_PREDICT), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = open(data.parent / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"{name}: bmoe-server did not start: {line!r}")
        self.url = line.split("listening on", 1)[1].strip().rstrip("/")
        self.host, port = self.url.split("//", 1)[1].rsplit(":", 1)
        self.port = int(port)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = self.get_json("/api/info").get("state")
            if state == "ready":
                return
            if state == "error":
                raise SystemExit(f"{name}: the model did not load: {self.get_json('/api/info')}")
            time.sleep(0.1)
        raise SystemExit(f"{name}: never ready")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def doing(self) -> str:
        """What the server says it is doing: its state, the turn running, turns waiting."""
        try:
            info = self.get_json("/api/info")
        except (OSError, ValueError) as e:
            return f"no answer from /api/info ({e!r})"
        return json.dumps({k: info.get(k) for k in ("state", "generating", "waiting")})

    def sample(self) -> dict[str, Any]:
        pid = self.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out: dict[str, Any] = {
            "t": round(time.monotonic(), 1),
            "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "rss_anon_mib": round(int(fields["RssAnon"].split()[0]) / 1024, 1),
            "rss_file_mib": round(int(fields["RssFile"].split()[0]) / 1024, 1),
            "heap_trims": -1,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }
        with urllib.request.urlopen(self.url + "/metrics?process=1", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("bmoe:process_trio_tasks "):
                    out["trio_tasks"] = int(float(line.split()[1]))
                elif line.startswith("bmoe:process_event_subscribers "):
                    out["subscribers"] = int(float(line.split()[1]))
                elif line.startswith("bmoe:process_heap_trims_total "):
                    out["heap_trims"] = int(float(line.split()[1]))
        return out

    def mappings(self) -> dict[str, int]:
        """Resident KiB per mapping name (anonymous ones as `[anon]`), from smaps: what a
        growth report names."""
        out: collections.Counter[str] = collections.Counter()
        name = "[anon]"
        for line in Path(f"/proc/{self.proc.pid}/smaps").read_text().splitlines():
            head = line.split(None, 5)
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                out[name] += int(line.split()[1])
        return dict(out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- the clients --------------------------------------------------------------------------

def png(colour: tuple[int, ...], size: tuple[int, int]) -> str:
    from PIL import Image
    b = io.BytesIO()
    Image.new("RGB", size, colour).save(b, "PNG")
    return "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)

    def took(self, server: str, action: str, seconds: float) -> None:
        with self.lock:
            self.seconds[f"{server} {action}"].append(seconds)

    def latency(self) -> dict[str, dict[str, float]]:
        """Per server and action: how many, the median, the 99th percentile, the slowest."""
        out = {}
        with self.lock:
            for key, xs in sorted(self.seconds.items()):
                xs = sorted(xs)
                out[key] = {"n": len(xs), "p50_s": round(xs[len(xs) // 2], 3),
                            "p99_s": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
                            "max_s": round(xs[-1], 3)}
        return out

    def add(self, server: str, action: str, outcome: str | int, detail: str = "") -> None:
        with self.lock:
            self.counts[f"{server} {outcome}"] += 1
            self.counts[f"action {action}"] += 1
            bad = ((isinstance(outcome, int) and outcome >= 500)
                   or outcome in ("connection", "client_error", "stream_error"))
            if bad and len(self.failures) < 50:
                self.failures.append(f"{server} {action}: {outcome} {detail[:300]}")


def _raw(srv: Server, method: str, path: str, body: Any = None,
         timeout: float = CLIENT_TIMEOUT_S) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"}
                                 if method != "GET" else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            payload, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        payload, status = e.read(), e.code
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload


class Client(threading.Thread):
    def __init__(self, srv: Server, tally: Tally, seed: int, stop: threading.Event,
                 go: threading.Event, streams: threading.Semaphore) -> None:
        super().__init__(daemon=True, name=f"soak-{srv.name}-{seed}")
        self.srv, self.tally, self.rng = srv, tally, random.Random(seed)
        self.stop_ev, self.go, self.streams = stop, go, streams
        self.idle = threading.Event()

    def actions(self) -> list[tuple[Any, int]]:
        actions = [(self.chat_stream, 4), (self.chat_once, 2), (self.chat_dropped, 2),
                   (self.chat_cancelled, 1), (self.messages_stream, 3),
                   (self.responses_stream, 3), (self.events, 2), (self.websocket, 2),
                   (self.decide, 1), (self.reads, 3), (self.config_write, 1),
                   (self.llama_routes, 3), (self.agent_run, 1), (self.long_prompt, 1)]
        if self.srv.vision:
            actions.append((self.image_chat, 2))
        return actions

    def attempt(self, fn: Any) -> None:
        """Run one action; what goes wrong is counted, never raised. A client timeout
        also records what the server was doing then (its turn and the turns waiting)."""
        name = fn.__name__
        t0 = time.monotonic()
        try:
            fn()
        except (openai.APITimeoutError, anthropic.APITimeoutError, TimeoutError) as e:
            self.tally.add(self.srv.name, name, "connection",
                           f"{e!r} after {time.monotonic() - t0:.1f} s; the server then: "
                           f"{self.srv.doing()}")
        except (openai.APIConnectionError, anthropic.APIConnectionError,
                ConnectionError, urllib.error.URLError) as e:
            late = isinstance(getattr(e, "reason", None), TimeoutError)   # urllib's timeout
            self.tally.add(self.srv.name, name, "connection",
                           repr(e) + (f"; the server then: {self.srv.doing()}" if late else ""))
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            self.tally.add(self.srv.name, name, e.status_code, str(e))
        except (openai.APIError, anthropic.APIError) as e:     # an error chunk mid-stream
            self.tally.add(self.srv.name, name, "stream_error", str(e))
        except Exception as e:  # noqa: BLE001 - a client's own fault is counted, not fatal
            self.tally.add(self.srv.name, name, "client_error", repr(e))
        self.tally.took(self.srv.name, name, time.monotonic() - t0)

    def first_pass(self) -> None:
        """Every action once, in the calling thread, before any client thread starts, the
        long prompt at the context's full length.

        The SDKs' pydantic models build their validators lazily, on first use, and that
        build is not thread-safe (pydantic 2.13: two threads validating a ChatCompletion
        for the first time at once can see a half-built class and raise AttributeError
        `__pydantic_core_schema__`). One serial pass builds them all first. The full
        context is the largest request of the run: the server's resident memory rises
        with the longest prompt decoded so far (llama.cpp's buffers are allocated at load,
        their pages become resident as a prompt first reaches them; about 6 MiB on the
        tiny model between a 70- and a 3,850-token prompt), so the warm-up reaches that
        high-water mark and the run's long prompts check that it holds."""
        for fn, _ in self.actions():
            self.attempt(self.full_prompt if fn == self.long_prompt else fn)

    def run(self) -> None:
        fns, weights = zip(*self.actions(), strict=True)
        while not self.stop_ev.is_set():
            if not self.go.is_set():
                self.idle.set()
                self.go.wait(1.0)
                continue
            self.idle.clear()
            self.attempt(self.rng.choices(fns, weights)[0])
        self.idle.set()

    def _prompt(self) -> str:
        return self.rng.choice(PROMPTS)

    def _oa(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.srv.url + "/v1", api_key="soak", max_retries=0,
                             timeout=CLIENT_TIMEOUT_S)

    def chat_stream(self) -> None:
        with self._oa() as c:
            stream = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": self._prompt()}],
                max_tokens=self.rng.randint(4, 40), stream=True)
            for _ in stream:
                pass
        self.tally.add(self.srv.name, "chat_stream", 200)

    def chat_once(self) -> None:
        with self._oa() as c:
            c.chat.completions.create(model="m", max_tokens=self.rng.randint(4, 24),
                                      messages=[{"role": "user", "content": self._prompt()}])
        self.tally.add(self.srv.name, "chat_once", 200)

    def chat_dropped(self) -> None:
        """A client that goes away mid-answer (closes its connection)."""
        with self._oa() as c:
            stream = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": self._prompt()}],
                max_tokens=200, stream=True)
            for i, _ in enumerate(stream):
                if i >= self.rng.randint(1, 6):
                    break
            stream.close()
        self.tally.add(self.srv.name, "chat_dropped", 200)

    def chat_cancelled(self) -> None:
        with self._oa() as c:
            stream = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": self._prompt()}],
                max_tokens=300, stream=True)
            for i, _ in enumerate(stream):
                if i == 2:
                    status, _ = _raw(self.srv, "POST", "/api/cancel", {})
                    self.tally.add(self.srv.name, "cancel", status)
        self.tally.add(self.srv.name, "chat_cancelled", 200)

    def messages_stream(self) -> None:
        with anthropic.Anthropic(base_url=self.srv.url, api_key="soak", max_retries=0,
                                 timeout=CLIENT_TIMEOUT_S) as c:
            with c.messages.stream(model="m", max_tokens=self.rng.randint(4, 40),
                                   messages=[{"role": "user", "content": self._prompt()}]) as s:
                for _ in s.text_stream:
                    pass
                s.get_final_message()
        self.tally.add(self.srv.name, "messages_stream", 200)

    def responses_stream(self) -> None:
        with self._oa() as c:
            with c.responses.stream(model="m", input=self._prompt(),
                                    max_output_tokens=self.rng.randint(16, 40)) as s:
                last = ""
                for event in s:
                    last = event.type
        # an answer cut at max_output_tokens ends with response.incomplete (the protocol's)
        ok = last in ("response.completed", "response.incomplete")
        self.tally.add(self.srv.name, "responses_stream", 200 if ok else "stream_error",
                       f"the stream ended with {last!r}")

    def events(self) -> None:
        if not self.streams.acquire(timeout=0.1):
            return
        try:
            with socket.create_connection((self.srv.host, self.srv.port), timeout=30) as s:
                s.sendall(f"GET /api/events HTTP/1.1\r\nHost: {self.srv.host}:{self.srv.port}"
                          "\r\nAccept: text/event-stream\r\n\r\n".encode())
                self._hold(s, "events")
        finally:
            self.streams.release()

    def _hold(self, s: socket.socket, action: str) -> None:
        """Read the answer's status line, then whatever comes for a random while."""
        head = s.recv(4096).split(b"\r\n", 1)[0]
        parts = head.split()
        self.tally.add(self.srv.name, action, int(parts[1]) if len(parts) > 1 else "connection",
                       repr(head))
        end = time.monotonic() + self.rng.uniform(0.5, 4.0)
        s.settimeout(0.5)
        while time.monotonic() < end:
            try:
                if not s.recv(4096):
                    break
            except (socket.timeout, TimeoutError):
                pass

    def websocket(self) -> None:
        if not self.streams.acquire(timeout=0.1):
            return
        try:
            key = base64.b64encode(os.urandom(16)).decode()
            with socket.create_connection((self.srv.host, self.srv.port), timeout=30) as s:
                s.sendall((f"GET /api/ws HTTP/1.1\r\nHost: {self.srv.host}:{self.srv.port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
                self._hold(s, "websocket")
                if self.rng.random() < 0.5:      # a clean close frame; else just gone
                    mask = os.urandom(4)
                    payload = (1000).to_bytes(2, "big")
                    s.sendall(bytes([0x88, 0x80 | len(payload)]) + mask +
                              bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        finally:
            self.streams.release()

    def decide(self) -> None:
        status, _ = _raw(self.srv, "POST", "/api/decide", {
            "prefix": "You are choosing the next action.\nTask: " + self._prompt(),
            "suffix": "\nAnswer with the letter.", "choices": ["A", "B", "C"]})
        self.tally.add(self.srv.name, "decide", status)

    def reads(self) -> None:
        for path in ("/api/models", "/api/plan?cached=1", "/api/info", "/api/config"):
            status, _ = _raw(self.srv, "GET", path)
            self.tally.add(self.srv.name, "reads", status)

    def config_write(self) -> None:
        status, _ = _raw(self.srv, "PUT", "/api/config",
                         {"values": {"top-k": self.rng.randint(20, 60)}})
        self.tally.add(self.srv.name, "config_write", status)

    def image_chat(self) -> None:
        colour = tuple(self.rng.randint(0, 255) for _ in range(3))
        size = (self.rng.randint(8, 96), self.rng.randint(8, 96))
        with self._oa() as c:
            stream = c.chat.completions.create(
                model="m", max_tokens=self.rng.randint(2, 16), stream=self.rng.random() < 0.5,
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What colour is this?"},
                    {"type": "image_url", "image_url": {"url": png(colour, size)}}]}])
            if not isinstance(stream, openai.types.chat.ChatCompletion):
                for _ in stream:
                    pass
        self.tally.add(self.srv.name, "image_chat", 200)

    def agent_run(self) -> None:
        """A conversation of the agent (no workspace: the model answers, no tools), read
        until its round ends, then deleted."""
        status, conv = _raw(self.srv, "POST", "/api/conversations", {})
        self.tally.add(self.srv.name, "agent_create", status)
        if status != 201 and status != 200:
            return
        cid = conv["id"]
        status, _ = _raw(self.srv, "POST", f"/api/conversations/{cid}/messages",
                         {"text": self._prompt()})
        self.tally.add(self.srv.name, "agent_message", status)
        end = time.monotonic() + 120
        state = "running"
        while status == 202 and time.monotonic() < end:
            got, body = _raw(self.srv, "GET", f"/api/conversations/{cid}")
            state = body.get("state", "") if isinstance(body, dict) else ""
            if got != 200 or state not in ("running", "queued", "streaming"):
                if got == 200 and state == "error":      # the round failed: say why
                    notes = [i.get("text", "") for i in body.get("items", [])
                             if i.get("kind") == "notice"]
                    self.tally.add(self.srv.name, "agent_read", "stream_error",
                                   notes[-1] if notes else "the round ended in error")
                else:
                    self.tally.add(self.srv.name, "agent_read", got)
                break
            time.sleep(0.2)
        else:
            if status == 202:
                self.tally.add(self.srv.name, "agent_read", "client_error",
                               f"the round did not end in 120 s ({state})")
        status, _ = _raw(self.srv, "DELETE", f"/api/conversations/{cid}")
        self.tally.add(self.srv.name, "agent_delete", status)

    def full_prompt(self) -> None:
        self.long_prompt(full=True)

    def long_prompt(self, full: bool = False) -> None:
        """llama-server's `/completion` on a prompt of a random length up to the whole
        context (token ids, the prompt's cache off so all of it is decoded)."""
        status, body = _raw(self.srv, "POST", "/tokenize",
                            {"content": " ".join(self.rng.choice(PROMPTS) for _ in range(400))})
        self.tally.add(self.srv.name, "tokenize", status)
        if status != 200:
            return
        tokens = body["tokens"]
        room = N_CTX - 8                     # the answer's few tokens fit after it
        n = room if full else self.rng.randint(256, room)
        prompt = (tokens * (n // max(1, len(tokens)) + 1))[:n]
        status, _ = _raw(self.srv, "POST", "/completion",
                         {"prompt": prompt, "n_predict": self.rng.randint(1, 4),
                          "cache_prompt": False})
        self.tally.add(self.srv.name, "long_prompt", status)

    def llama_routes(self) -> None:
        status, _ = _raw(self.srv, "POST", "/completion",
                         {"prompt": self._prompt(), "n_predict": self.rng.randint(2, 12)})
        self.tally.add(self.srv.name, "completion", status)
        status, _ = _raw(self.srv, "POST", "/tokenize", {"content": self._prompt()})
        self.tally.add(self.srv.name, "tokenize", status)
        status, _ = _raw(self.srv, "GET", "/props")
        self.tally.add(self.srv.name, "props", status)


# -- the run --------------------------------------------------------------------------------

def quiet(servers: list[Server], clients: list[Client], settle_s: float = 12.0
          ) -> dict[str, dict[str, Any]]:
    """Wait until every client is idle and the servers have let go of their turns, then
    sample each server. `settle_s` is past trio's 10 s for an idle worker thread to end."""
    deadline = time.monotonic() + 180
    for c in clients:
        while c.is_alive() and not c.idle.wait(0.5) and time.monotonic() < deadline:
            pass
    for srv in servers:
        while time.monotonic() < deadline:
            info = srv.get_json("/api/info")
            if not info.get("generating") and not info.get("waiting"):
                break
            time.sleep(0.2)
    # A server that went quiet before the others may have trimmed already (a slow host's
    # last actions end far apart): one generated token each starts a quiet spell now (a
    # spell starts when a generation ends), whose trim every sample then waits for.
    trims = {}
    for srv in servers:
        trims[srv.name] = srv.sample()["heap_trims"]
        _raw(srv, "POST", "/completion", {"prompt": "quiet", "n_predict": 1,
                                          "temperature": 0})
    time.sleep(settle_s)
    out = {}
    for srv in servers:
        # the server gives its heaps' free pages back once per quiet spell: sample after
        # that, so every quiet sample is taken in the same state
        until = time.monotonic() + TRIM_WAIT_S
        row = srv.sample()
        while row["heap_trims"] <= trims[srv.name] and time.monotonic() < until:
            time.sleep(0.5)
            row = srv.sample()
        out[srv.name] = {**row, "trimmed": row["heap_trims"] > trims[srv.name],
                         "mappings": srv.mappings()}
    return out


def rss_growth(base: float, mid: float, final: float) -> str:
    """Why RSS counts as growing over the run ("" when it does not): more than RSS_HALF
    in both halves (a leak grows with the work), or more than RSS_TOTAL in all."""
    if final > base * (1 + RSS_TOTAL):
        return f"grew more than {RSS_TOTAL:.0%} over the run"
    if mid > base * (1 + RSS_HALF) and final > mid * (1 + RSS_HALF):
        return f"grew more than {RSS_HALF:.0%} in each half of the run"
    return ""


def _brief(sample: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {k: v for k, v in row.items() if k != "mappings"}
            for name, row in sample.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=8, help="client threads per server")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    total = args.minutes * 60
    warmup = min(300.0, max(30.0, total / 5))
    work = Path(tempfile.mkdtemp(prefix="bmoe-soak-"))
    model = make_model(work / "tiny-moe.gguf", **MOE)
    seeing, projector = make_vision_pair(work / "vision", **MOE)
    (work / "streamed").mkdir()
    (work / "resident").mkdir()
    servers = [Server("streamed", model, work / "streamed" / "data", "--moe-stream",
                      "--cache-mb", "2", "--io-threads", "2"),
               Server("resident", seeing, work / "resident" / "data", "--no-moe-stream",
                      "--mmproj", str(projector), vision=True)]
    tally, stop, go = Tally(), threading.Event(), threading.Event()
    # at most 4 live event streams / WebSockets per server (shared by its clients), under
    # the spec's 8
    streams = {srv.name: threading.Semaphore(4) for srv in servers}
    clients = [Client(srv, tally, 1000 * i + j, stop, go, streams[srv.name])
               for i, srv in enumerate(servers) for j in range(min(args.clients, 12))]
    samples: list[dict[str, Any]] = []
    try:
        first = time.monotonic()
        for srv in servers:                  # the vision server's client has every action
            next(c for c in clients if c.srv is srv).first_pass()
        print(f"first pass (every action once, serially): {time.monotonic() - first:.1f} s",
              flush=True)
        start = {srv.name: srv.sample() for srv in servers}
        t0 = time.monotonic()
        go.set()
        for c in clients:
            c.start()

        def sample_until(t_end: float, phase: str) -> None:
            next_at = time.monotonic()
            while time.monotonic() < t_end:
                if time.monotonic() >= next_at:
                    for srv in servers:
                        if srv.proc.poll() is not None:
                            raise SystemExit(f"{srv.name}: the server process ended "
                                             f"({srv.proc.returncode})")
                        row = {"server": srv.name, "phase": phase,
                               "at_s": round(time.monotonic() - t0), **srv.sample()}
                        samples.append(row)
                        print(json.dumps(row), flush=True)
                    next_at += SAMPLE_S
                time.sleep(0.2)

        sample_until(t0 + warmup, "warm-up")
        go.clear()
        baseline = quiet(servers, clients)
        print("baseline (quiet, after warm-up):", json.dumps(_brief(baseline)), flush=True)
        go.set()
        half = (total - warmup) / 2      # each half timed from its own start: a quiet
        sample_until(time.monotonic() + half, "run")     # sample can take a while
        go.clear()
        mid = quiet(servers, clients)
        print("mid-run (quiet):", json.dumps(_brief(mid)), flush=True)
        go.set()
        sample_until(time.monotonic() + half, "run")
        stop.set()
        go.set()
        final = quiet(servers, clients)
        print("final (quiet, after the run):", json.dumps(_brief(final)), flush=True)
        for c in clients:
            c.join(60)
    finally:
        stop.set()
        go.set()
        for srv in servers:
            alive = srv.proc.poll() is None
            srv.stop()
            if not alive:
                print(f"{srv.name}: the server process had ended", flush=True)

    problems = list(tally.failures)
    for srv in servers:
        b, m, f = baseline[srv.name], mid[srv.name], final[srv.name]
        why = rss_growth(b["rss_mib"], m["rss_mib"], f["rss_mib"])
        if why:
            grew = sorted(((f["mappings"].get(k, 0) - b["mappings"].get(k, 0), k)
                           for k in set(b["mappings"]) | set(f["mappings"])), reverse=True)
            problems.append(f"{srv.name}: RSS {b['rss_mib']} -> {m['rss_mib']} -> "
                            f"{f['rss_mib']} MiB: {why} (anonymous {b['rss_anon_mib']} -> "
                            f"{f['rss_anon_mib']}, files {b['rss_file_mib']} -> "
                            f"{f['rss_file_mib']}; grew most: "
                            + ", ".join(f"{k} +{v} KiB" for v, k in grew[:5] if v > 0) + ")")
        for key in ("fds", "trio_tasks", "subscribers", "threads"):
            if f[key] > b[key]:
                problems.append(f"{srv.name}: {key} {b[key]} after warm-up, {f[key]} at the end")
    statuses = {k: v for k, v in sorted(tally.counts.items()) if not k.startswith("action ")}
    actions = {k[7:]: v for k, v in sorted(tally.counts.items()) if k.startswith("action ")}
    n5xx = sum(v for k, v in statuses.items() if k.split()[1].isdigit()
               and int(k.split()[1]) >= 500)
    report = {"minutes": args.minutes, "warmup_s": warmup, "clients_per_server": len(clients) // 2,
              "requests_by_status": statuses, "actions": actions, "5xx": n5xx,
              "start": start, "baseline": baseline, "mid": mid, "final": final,
              "rss_ratio": {s.name: round(final[s.name]["rss_mib"] /
                                          baseline[s.name]["rss_mib"], 4) for s in servers},
              "latency": tally.latency(), "samples": samples, "problems": problems}
    print("requests by status:", json.dumps(statuses))
    print("actions:", json.dumps(actions))
    slow = sorted(report["latency"].items(), key=lambda kv: -kv[1]["max_s"])[:8]
    print("slowest actions:", "; ".join(f"{k} max {v['max_s']} s (p99 {v['p99_s']}, n {v['n']})"
                                        for k, v in slow))
    for srv in servers:
        print(f"{srv.name}: RSS {baseline[srv.name]['rss_mib']} -> {mid[srv.name]['rss_mib']}"
              f" -> {final[srv.name]['rss_mib']}"
              f" MiB (ratio {report['rss_ratio'][srv.name]}), fds {baseline[srv.name]['fds']}"
              f" -> {final[srv.name]['fds']}, trio tasks {baseline[srv.name]['trio_tasks']} -> "
              f"{final[srv.name]['trio_tasks']}, threads {baseline[srv.name]['threads']} -> "
              f"{final[srv.name]['threads']}, subscribers {baseline[srv.name]['subscribers']} "
              f"-> {final[srv.name]['subscribers']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("OK: 0 x 5xx, no growth after warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
