"""The runtime (bmoe/runtime/state.py) on the real engine: its lifecycle, `job`,
`exclusive` and their refusals, with no HTTP in between."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from bmoe.engine.decide import DecideRequest, decide
from bmoe.engine.errors import EngineError
from bmoe.engine.experts import streamer_factory
from bmoe.http.errors import HTTPError
from bmoe.runtime.config import ConfigStore
from bmoe.runtime.events import EventBus
from bmoe.runtime.state import MOVES, Lifecycle, Runtime, ServerOptions

ILLEGAL = "a move its lifecycle does not make"


def test_the_lifecycle_table() -> None:
    for state in Lifecycle:
        assert Lifecycle.LOADING in MOVES[state], state     # a load starts from anywhere
        assert Lifecycle.EMPTY in MOVES[state], state       # an unload ends anything
    came_to = {s for s in Lifecycle if any(s in MOVES[f] for f in Lifecycle if f != s)}
    assert came_to == set(Lifecycle)
    assert {f for f in Lifecycle if Lifecycle.READY in MOVES[f]} == {Lifecycle.LOADING}
    assert {f for f in Lifecycle if Lifecycle.PLANNING in MOVES[f]} == {Lifecycle.LOADING}
    assert [s for s in Lifecycle if s.loading] == [Lifecycle.PLANNING, Lifecycle.LOADING]
    assert Lifecycle.READY == "ready" and f"{Lifecycle.ERROR}" == "error"   # the wire's


def runtime(tmp_path: Path) -> Runtime:
    return Runtime(ServerOptions(data_dir=tmp_path), ConfigStore(tmp_path, {}), EventBus(),
                   streamer_factory=streamer_factory)


def run_runtime(tmp_path: Path, body: Callable[[Runtime, trio.Nursery], Awaitable[None]],
                before_close: Callable[[], Any] = lambda: None) -> None:
    """`body(rt, nursery)` on a fresh runtime attached to a nursery; `before_close()`
    (releasing what the engine thread may be blocked on), then the runtime is closed."""
    async def main() -> None:
        rt = runtime(tmp_path)
        async with trio.open_nursery() as nursery:
            rt.attach(nursery)
            try:
                await body(rt, nursery)
            finally:
                before_close()
                with trio.CancelScope(shield=True):
                    await rt.aclose()      # the engine thread ends (it is not a daemon)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def wait_settled(rt: Runtime) -> None:
    """Until the load under way has ended, loaded or not."""
    with trio.fail_after(120):
        try:
            await rt.require_session()
        except HTTPError:
            pass


def test_a_runtime_loads_runs_jobs_and_unloads(tmp_path: Path, tiny_moe: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="bmoe.runtime.state")
    seen: list[str] = []

    async def main() -> None:
        rt = runtime(tmp_path)
        sub = rt.bus.subscribe(local=True)
        async with trio.open_nursery() as nursery:
            rt.attach(nursery)
            try:
                await body(rt, sub)
            finally:
                sub.close()
                with trio.CancelScope(shield=True):
                    await rt.aclose()      # the engine thread ends (it is not a daemon)
            nursery.cancel_scope.cancel()

    async def body(rt: Runtime, sub: Any) -> None:
        with pytest.raises(HTTPError) as none:
            await rt.job(lambda s: s.n_ctx)
        assert none.value.status == 503 and none.value.code == "no_model"

        rt.begin_load(str(tiny_moe), {**rt.config.values, "model": str(tiny_moe)})
        assert rt.state == Lifecycle.LOADING
        n_ctx = await rt.job(lambda s: s.n_ctx)          # waits through the load
        assert rt.state == Lifecycle.READY and n_ctx == rt.session.n_ctx > 0
        tokens = await rt.job(lambda s, text: s.tokenize(text), "hello there")
        assert tokens and all(isinstance(t, int) for t in tokens)

        result = await rt.exclusive(decide, DecideRequest(prefix="The answer is",
                                                          suffix="", choices=["yes", "no"],
                                                          reuse_prefix=True))
        assert result.best in (0, 1) and not result.cancelled and len(result.choice_logp) == 2
        assert not rt.generating

        with pytest.raises(EngineError):                 # the engine's refusal, as raised
            await rt.job(lambda s: (_ for _ in ()).throw(EngineError("failed", "no")))

        await rt.unload()
        assert rt.state == Lifecycle.EMPTY and rt.session is None
        rt.begin_load(str(tmp_path / "missing.gguf"), rt.config.values)
        await wait_settled(rt)
        assert rt.state == Lifecycle.ERROR and rt.error
        with pytest.raises(HTTPError):
            await rt.job(lambda s: s.n_ctx)
        while True:
            with trio.move_on_after(0.1):
                name, data = await sub.receive.receive()
                if name == "state":
                    seen.append(data["state"])
                continue
            break

    trio.run(main)
    assert "ready" in seen and seen[-1] == "error", seen
    assert not [r for r in caplog.records if ILLEGAL in r.getMessage()]


def test_exclusive_holds_the_turn_and_is_cancelled_like_a_generation(
        tmp_path: Path, tiny_moe: Path) -> None:
    started = threading.Event()

    def work(session: Any, cancel: threading.Event) -> bool:
        started.set()
        return cancel.wait(30)             # True: the flag was set

    async def body(rt: Runtime, nursery: trio.Nursery) -> None:
        rt.begin_load(str(tiny_moe), {**rt.config.values, "model": str(tiny_moe)})
        await wait_settled(rt)
        out: list[bool] = []
        done = trio.Event()

        async def run() -> None:
            out.append(await rt.exclusive(work))
            done.set()

        nursery.start_soon(run)
        await trio.to_thread.run_sync(started.wait, 10)
        assert rt.generating and rt.turns.busy        # marked, and the line is held
        assert rt.cancel_current() is True            # POST /api/cancel's way
        with trio.fail_after(10):
            await done.wait()
        assert out == [True] and not rt.generating and not rt.turns.busy

        started.clear()                               # a caller that goes away
        with trio.move_on_after(0.3):
            async with trio.open_nursery() as inner:
                inner.start_soon(rt.exclusive, work)
                await trio.to_thread.run_sync(started.wait, 10)
                await trio.sleep(10)
        assert not rt.generating and not rt.turns.busy   # the engine let go

    run_runtime(tmp_path, body)


def test_a_request_while_the_model_falls_asleep_wakes_it(tmp_path: Path, tiny_moe: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """`--sleep-idle-seconds`: a request that arrives while the idle model is being closed
    waits for it to load again (it once found no model and a lifecycle still READY: 503
    no_model, seen as llama.cpp's `test_server_sleep_read_only_endpoints` failing)."""
    caplog.set_level(logging.ERROR, logger="bmoe.runtime.state")
    gate = threading.Event()

    async def body(rt: Runtime, nursery: trio.Nursery) -> None:
        rt.begin_load(str(tiny_moe), {**rt.config.values, "model": str(tiny_moe)})
        await wait_settled(rt)
        assert rt.idle()
        rt.engine.submit(lambda: gate.wait(30))      # the close waits behind this
        slept: list[bool] = []

        async def sleep() -> None:
            slept.append(await rt.fall_asleep(dict))

        nursery.start_soon(sleep)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.session is None and rt.asleep is not None   # closing: a caller wakes it
        assert rt.state == Lifecycle.EMPTY
        nursery.start_soon(trio.to_thread.run_sync, gate.wait, 0.5)
        with trio.fail_after(120):
            n_ctx = await rt.job(lambda s: s.n_ctx)
        gate.set()
        assert n_ctx > 0 and rt.state == Lifecycle.READY and rt.asleep is None
        assert slept == [False]                      # woken while it closed

        assert await rt.fall_asleep(dict) is True     # and an undisturbed sleep still is one
        assert rt.state == Lifecycle.EMPTY and rt.asleep is not None

    run_runtime(tmp_path, body, before_close=gate.set)
    assert not [r for r in caplog.records if ILLEGAL in r.getMessage()]
