"""The one thread that calls llama.cpp.

Work is posted as plain callables and runs in order on a dedicated thread; each
post returns a `concurrent.futures.Future`. The trio side awaits those futures
through `bmoe.server.bridge`. The thread is never abandoned while it holds a
context: `close()` waits for the running job.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable

# llama.cpp's grammar parser and sampler recurse: the engine thread gets a deep stack so
# the limits of bmoe.engine.grammar_guard keep a wide margin (virtual memory: pages are
# touched only when used). Measured in bench/grammar_limits.py.
ENGINE_STACK_BYTES = 64 * 1024 * 1024
_STOP = object()


class EngineThread:
    def __init__(self, name: str = "bmoe-engine") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        previous = threading.stack_size(ENGINE_STACK_BYTES)
        try:
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the engine thread and wait for its result (for synchronous callers)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
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
