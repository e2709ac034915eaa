"""The one thread that calls llama.cpp.

Work is posted as plain callables and runs in order on a dedicated thread; each
post returns a `concurrent.futures.Future`. The trio side awaits those futures
through `bmoe.runtime.bridge`. The thread is never abandoned while it holds a
context: it is not a daemon, and `close()` posts a stop after every queued job and
returns a future that completes when the thread has ended (await it with
`bridge.wait_future`, or call `.result()` from plain code).
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable

import numpy  # noqa: F401 - loaded before the limit below, which applies to loaded BLAS
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

# llama.cpp's grammar parser and sampler recurse: the engine thread gets a deep stack so
# the limits of bmoe.engine.grammar_guard keep a wide margin (virtual memory: pages are
# touched only when used). Measured in bench/grammar_limits.py.
ENGINE_STACK_BYTES = 64 * 1024 * 1024

class EngineThread:
    def __init__(self, name: str = "bmoe-engine") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopped: Future[None] = Future()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        previous = threading.stack_size(ENGINE_STACK_BYTES)
        try:
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def close(self) -> Future[None]:
        """Stop once the queued jobs have run; the future completes when the thread ends."""
        if not self._closing:
            self._closing = True
            self._jobs.put(None)
        return self._stopped

    def _run(self) -> None:
        # numpy's BLAS (the streamer's router products, a few MFLOP each) on the calling
        # thread only: its worker threads spin after each product on the cores llama.cpp
        # computes on (1.8 % of a streamed prompt's CPU samples on 2 cores). Process-wide.
        threadpool_limits(1, user_api="blas")
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fut, fn, args, kwargs = job
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    if not isinstance(e, Exception):
                        traceback.print_exc(file=sys.stderr)
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
        finally:
            self._stopped.set_result(None)
