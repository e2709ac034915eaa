"""Running one engine-level turn from the trio side.

Every protocol adapter does the same: take a place in the turn line (refused with
503 `busy`), wait for the turn, prepare (render, tokenize, context check), run the
generation on the engine thread, and read its tokens back through a `TokenPipe`.
A cancelled caller (its client went away) sets the turn's cancel flag and waits,
shielded, for the engine to let go, so the next turn finds the engine free.
"""

from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable

import trio

from ..engine.errors import EngineError
from ..engine.session import Session, TokenEvent
from ..engine.turn import Prepared, TurnRequest, TurnResult, prepare, run_turn
from .bridge import TokenPipe, let_go, wait_future
from .state import ServerState
from .turns import Place

IDLE_PING_S = 15.0  # a running stream with nothing to send for this long gets a keep-alive

Batch = list[tuple[TokenEvent, dict[str, Any]]]


class TurnRun:
    def __init__(self, state: ServerState, req: TurnRequest, *,
                 grammar_for: Callable[..., str | None] | None = None) -> None:
        self.state = state
        self.req = req
        self.grammar_for = grammar_for
        self.place: Place = state.turns.reserve()   # 503 busy when the line is full
        self.session: Session | None = None
        self.prepared: Prepared | None = None
        self.cancel = threading.Event()

    def close(self) -> None:
        self.place.release()

    async def start(self, on_wait: Callable[[], Awaitable[None]] | None = None) -> Prepared:
        """Wait for the model and the turn, then prepare the prompt (EngineError on refusal)."""
        self.session = await self.state.require_session()
        await self.place.wait(on_wait)
        session = await self.state.require_session()
        self.session = session
        try:
            self.prepared = await wait_future(self.state.engine.submit(
                prepare, session, self.req, self.grammar_for))
        except EngineError as e:
            if e.code == "context_full":
                self.state.ctx_refused = True
                self.state.bus.log("warn", "a request was refused: " + e.message.replace(
                    "{ctx-size}", "--ctx-size"))
                self.state.publish_state()
            raise
        return self.prepared

    async def run(self, on_batch: Callable[[Batch], Awaitable[None]],
                  on_idle: Callable[[], Awaitable[None]] | None = None) -> TurnResult:
        assert self.session is not None and self.prepared is not None
        state, session, prepared = self.state, self.session, self.prepared
        pipe = TokenPipe(self.cancel)
        state.current_cancel = self.cancel
        state.generating = True
        state.publish_state()

        def job() -> TurnResult:
            try:
                if session.ctx is None:
                    raise EngineError("failed", "The model was unloaded before this turn ran.")
                return run_turn(session, prepared, self.req, self.cancel,
                                lambda ev, rec: pipe.put((ev, rec)))
            finally:
                pipe.close_writer()

        fut = state.engine.submit(job)
        try:
            await self._pump(pipe, on_batch, on_idle)
        except BaseException:
            pipe.close_reader()
            await let_go(fut)
            raise
        finally:
            state.generating = False
            if state.current_cancel is self.cancel:
                state.current_cancel = None
            state.publish_state()
        result: TurnResult = await wait_future(fut)
        state.bus.publish("done", result.summary)
        log_turn(state, session, result)
        return result

    async def _pump(self, pipe: TokenPipe, on_batch: Callable[[Batch], Awaitable[None]],
                    on_idle: Callable[[], Awaitable[None]] | None) -> None:
        bus = self.state.bus
        while True:
            batch = None
            with trio.move_on_after(IDLE_PING_S) as idle:
                batch = await pipe.get_batch()
            if idle.cancelled_caught:
                if on_idle is not None:
                    await on_idle()
                continue
            if batch is None:
                return
            for _ev, rec in batch:
                bus.publish("token", rec)
            await on_batch(batch)


def log_turn(state: ServerState, session: Session, result: TurnResult) -> None:
    gen, s = result.generation, result.summary
    hit = s.get("cache_hit_pct", -1)
    state.bus.log(
        "info",
        f"answer: {s['tokens']} tokens at {s['tok_s']:.1f} tok/s ({gen.finish}); prompt "
        f"{gen.n_prompt} tokens ({gen.n_prefilled} prefilled in {gen.prefill_s:.3f} s); "
        f"context {gen.n_past}/{session.n_ctx}; experts read {s['read_mib']:.1f} MiB, "
        f"hit {f'{hit}%' if hit >= 0 else 'n/a'}")
    if gen.budget_cut_by_context:
        asked = gen.requested_budget or "no ceiling"
        state.bus.log("warn", f"an answer stopped at the end of the context: it asked for "
                      f"{asked} tokens and the context left {len(gen.tokens)}; raise --ctx-size")
