"""`GET /metrics`: llama-server's Prometheus metrics, plus the expert cache's.

Theory of operation
-------------------
`Metrics.book` adds one finished generation (any route: chat, Messages, Responses,
/completion) to plain counters when its turn ends, on the trio thread. A scrape reads
those counters, the turn line and the expert streamer's totals at that moment through
a `prometheus_client` collector, and `prometheus_client` writes the text exposition
format (names, `# HELP`/`# TYPE`, escaping): nothing here formats it by hand.

The names are llama-server's (`llamacpp:prompt_tokens_total`, ...), so its dashboards
read ours; bmoe's own figures are `bmoe:`-prefixed. As in llama-server, the two
throughput gauges (`prompt_tokens_seconds`, `predicted_tokens_seconds`) are averaged over
the window between two scrapes: each scrape reads the window and starts the next one.

`bmoe:process_*` (asked for with ``/metrics?process=1``) are what a long run watches for
growth (bench/soak.py): trio tasks alive (counted from the root task down at the scrape),
event-bus subscribers, threads, open descriptors and resident memory. They are left out
of a plain scrape, which then holds only what the model's work changes: two scrapes with
nothing run between them read the same (llama-server's suite checks that of a sleeping
server).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .events import EventBus
from .turns import TurnLine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Metrics:
    prompt_tokens: int = 0          # prompt tokens computed (the KV's reused prefix not counted)
    prompt_tokens_cached: int = 0   # ... and the ones the KV already held (no decode)
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0               # llama_decode calls: one per prefill chunk and per token
    requests: int = 0
    n_tokens_max: int = 0           # the most positions one generation took (prompt + answer)
    # the window since the last scrape (llama-server's prompt and predict buckets)
    bucket_prompt_tokens: int = 0
    bucket_prompt_seconds: float = 0.0
    bucket_predicted_tokens: int = 0
    bucket_predicted_seconds: float = 0.0

    def book(self, gen: Any, n_batch: int = 512) -> None:
        """One generation's counts (a `bmoe.engine.session.Generation`); `n_batch` is the
        session's prompt batch (one llama_decode call each)."""
        n_out = len(gen.tokens)
        self.requests += 1
        self.prompt_tokens += gen.n_prefilled
        self.prompt_tokens_cached += gen.n_cached
        self.prompt_seconds += gen.prefill_s
        self.tokens_predicted += n_out
        self.predicted_seconds += gen.decode_s
        self.n_decode += -(-gen.n_prefilled // max(1, n_batch)) + max(0, n_out - 1)
        self.n_tokens_max = max(self.n_tokens_max, gen.n_prompt + n_out)
        if gen.prefill_s > 0 and gen.n_prefilled:
            self.bucket_prompt_tokens += gen.n_prefilled
            self.bucket_prompt_seconds += gen.prefill_s
        if gen.decode_s > 0 and n_out > 1:      # the first token cost no decode step
            self.bucket_predicted_tokens += n_out - 1
            self.bucket_predicted_seconds += gen.decode_s

    def prompt_rate(self) -> float:
        """Prompt tokens per second over the window since the last scrape (0: none ran)."""
        s = self.bucket_prompt_seconds
        return self.bucket_prompt_tokens / s if s > 0 else 0.0

    def predicted_rate(self) -> float:
        s = self.bucket_predicted_seconds
        return self.bucket_predicted_tokens / s if s > 0 else 0.0

    def reset_bucket(self) -> None:
        """A scrape read the window: the next one starts empty."""
        self.bucket_prompt_tokens = self.bucket_predicted_tokens = 0
        self.bucket_prompt_seconds = self.bucket_predicted_seconds = 0.0


class Scraped(Protocol):
    """What a scrape reads of the runtime (`Runtime` is one; this module sits below it)."""

    session: Any
    asleep: Any
    metrics: Metrics
    bus: EventBus
    turns: TurnLine
    heap_trims: int

    @property
    def generating(self) -> bool: ...


class _Collector(Collector):
    def __init__(self, state: Scraped, process: bool) -> None:
        self.state = state
        self.process = process

    def collect(self) -> Iterator[Metric]:
        state = self.state
        m: Metrics = state.metrics
        yield _counter("prompt_tokens", "Number of prompt tokens processed.", m.prompt_tokens)
        yield _counter("prompt_tokens_cached", "Number of prompt tokens taken from the cache "
                       "(no decode).", m.prompt_tokens_cached)
        yield _counter("prompt_seconds", "Prompt process time.", m.prompt_seconds)
        yield _counter("tokens_predicted", "Number of generation tokens processed.",
                       m.tokens_predicted)
        yield _counter("tokens_predicted_seconds", "Predict process time.", m.predicted_seconds)
        yield _counter("n_decode", "Total number of llama_decode() calls.", m.n_decode)
        yield _counter("n_tokens_max", "Largest observed n_tokens.", m.n_tokens_max)
        # no speculative decoding on these routes: llama-server's counters, at zero
        yield _counter("spec_decode_num_draft_tokens", "Number of draft tokens generated.", 0)
        yield _counter("spec_decode_num_accepted_tokens", "Number of draft tokens accepted.", 0)
        yield _counter("spec_decode_num_drafts", "Number of drafts generated.", 0)
        yield _gauge("n_busy_slots_per_decode", "Average number of busy slots per "
                     "llama_decode() call.", 1.0 if m.n_decode else 0.0)
        yield _gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                     m.prompt_rate())
        yield _gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                     m.predicted_rate())
        # asleep (--sleep-idle-seconds), the model's figures as they were when it slept
        session = state.session if state.session is not None else state.asleep
        kv = len(session.kv_tokens) if session is not None else 0
        n_ctx = session.n_ctx if session is not None else 0
        yield _gauge("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                     kv / n_ctx if n_ctx else 0.0)
        yield _gauge("kv_cache_tokens", "KV-cache tokens.", kv)
        yield _gauge("requests_processing", "Number of requests processing.",
                     1 if state.generating else 0)
        yield _gauge("requests_deferred", "Number of requests deferred.", state.turns.waiting)
        yield from _expert_metrics(session)
        if self.process:
            yield from _process_metrics(state)


def trio_tasks() -> int:
    """Tasks alive in this trio run (the root task and every descendant); -1 outside trio."""
    try:
        root = trio.lowlevel.current_root_task()
    except RuntimeError:
        return -1
    if root is None:
        return -1
    n, todo = 0, [root]
    while todo:
        task = todo.pop()
        n += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return n


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _process_metrics(state: Scraped) -> Iterator[Metric]:
    bus = state.bus
    yield _gauge("process_trio_tasks", "Trio tasks alive.", trio_tasks(), "bmoe:")
    yield _gauge("process_event_subscribers", "Event-bus subscribers (event streams, "
                 "WebSockets).", bus.subscribers if bus is not None else -1, "bmoe:")
    yield _gauge("process_threads", "Python threads (the kernel's count, with native "
                 "ones, is in /proc).", threading.active_count(), "bmoe:")
    yield _gauge("process_open_fds", "Open file descriptors (-1: unknown).", _open_fds(),
                 "bmoe:")
    yield _gauge("process_resident_bytes", "Resident memory (-1: unknown).", _rss_bytes(),
                 "bmoe:")
    yield _counter("process_heap_trims", "Quiet spells after which the server gave its "
                   "heaps' free pages back to the system.", state.heap_trims, "bmoe:")


def _counter(name: str, doc: str, value: float, prefix: str = "llamacpp:") -> Metric:
    return CounterMetricFamily(prefix + name, doc, value=value)


def _gauge(name: str, doc: str, value: float, prefix: str = "llamacpp:") -> Metric:
    return GaugeMetricFamily(prefix + name, doc, value=value)


def _expert_metrics(session: Any) -> Iterator[Metric]:
    """The expert streamer's totals since the model loaded (zeros without one)."""
    streamer = session.streamer if session is not None else None
    stats = getattr(streamer, "stats", None)
    s: dict[str, Any] = stats() if callable(stats) else {}
    b = "bmoe:"
    yield _counter("expert_cache_hits", "Routed experts found in the expert cache.",
                   s.get("hits", 0), b)
    yield _counter("expert_cache_misses", "Routed experts read from storage.",
                   s.get("misses", 0), b)
    yield _counter("expert_read_bytes", "Bytes of expert weights read from storage.",
                   s.get("read_bytes", 0), b)
    yield _counter("expert_cache_evictions", "Experts evicted from the cache.",
                   s.get("evictions", 0), b)
    yield _counter("expert_cache_rereads", "Evicted experts that were read again.",
                   s.get("rereads", 0), b)
    yield _counter("expert_read_wait_seconds", "Seconds the model's layers waited on expert "
                   "reads (prompts and tokens).", s.get("io_s", 0.0), b)
    yield _counter("expert_read_ahead_bytes", "Bytes of expert weights read ahead of their "
                   "layer (guessed for a token or a prompt batch), part of expert_read_bytes.",
                   s.get("spec_bytes", 0), b)
    yield _counter("expert_pages_moved_bytes", "Bytes of committed memory handed from "
                   "evicted experts to the experts read in their place (reads that took no "
                   "fresh pages).", s.get("moved_bytes", 0), b)
    yield _gauge("expert_cache_resident_bytes", "Bytes of experts held in the cache.",
                 s.get("resident_bytes", 0), b)
    yield _gauge("expert_cache_budget_bytes", "The expert cache's budget in bytes.",
                 s.get("budget_bytes", 0), b)
    yield _gauge("expert_streaming", "1 when the model's experts stream from storage.",
                 1 if streamer is not None else 0, b)


def exposition(state: Scraped, process: bool = False) -> bytes:
    """The text exposition of every metric, as of now (`process`: with the
    `bmoe:process_*` gauges); the throughput window starts again."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(state, process))
    # llama-server exposes this one counter without the `_total` every other counter
    # carries (its dashboards and tests read `llamacpp:n_tokens_max`); prometheus_client
    # always adds it, so the one name is respelled after the exposition is written.
    text = generate_latest(registry).replace(b"llamacpp:n_tokens_max_total",
                                             b"llamacpp:n_tokens_max")
    state.metrics.reset_bucket()
    return text
