"""The turn service: one driver from a `TurnRequest` to protocol-neutral events.

Theory of operation
-------------------
Every protocol is a decoder (wire body → `TurnRequest`) and an encoder (events →
bytes); this module is everything between them, written once:

1. `Turn` takes a place in the turn line (503 `busy` when 16 already wait), waits for
   the model and the turn, and prepares the prompt on the engine thread (the engine
   renders, tokenizes, checks the context and picks the grammar).
2. `Turn.run` marks the generation with `state.generation(cancel)` (the one way to say
   "generating"), runs it on the engine thread and reads its tokens back through a
   `TokenPipe`. A cancelled caller (its client went away) sets the turn's cancel flag
   and waits, shielded, for the engine to let go.
3. `drive` feeds the tokens to the parser (`TurnOutput`) and hands each event to the
   encoder's `emit`: `Opened`, `Waiting`/`Ping` keep-alives, `Started`, the deltas,
   then `Finished` or `Failed`. A completed answer to a schema must parse as JSON
   (else 500 `invalid_output`, the turn rolled back out of the KV).

The HTTP side of a turn (a JSON answer or an SSE stream, for any protocol) is
`bmoe/server/serving.py`; the agent drives turns with `drive` directly.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Awaitable, Callable

import trio

from ..engine.errors import EngineError
from ..engine.session import PrefillProgress, Session, TokenEvent
from ..engine.turn import Prepared, TurnRequest, TurnResult, prepare, run_turn
from ..http.errors import HTTPError
from .bridge import TokenPipe, let_go, wait_future
from .state import Runtime
from .turnevents import Finished, Ping, Progress, Shape, Started, Stopped, TurnEvent, TurnOutput, Waiting

IDLE_PING_S = 15.0  # a running stream with nothing to send for this long gets a keep-alive

Batch = list[tuple[TokenEvent | PrefillProgress, dict[str, Any] | None]]
Emit = Callable[[TurnEvent], Awaitable[None]]


class Turn:
    """One request's turn: its place in line, the session it runs on, its prompt."""

    def __init__(self, state: Runtime, req: TurnRequest) -> None:
        self.state = state
        self.req = req
        self.place = state.turns.reserve()   # 503 busy when the line is full
        self.session: Session | None = None
        self.prepared: Prepared | None = None
        self.cancel = threading.Event()

    @property
    def model(self) -> str:
        return self.state.model_name() if self.session is not None else ""

    def close(self) -> None:
        self.place.release()

    async def start(self, on_wait: Callable[[], Awaitable[None]] | None = None) -> Prepared:
        """Wait for the model and the turn, then prepare the prompt (EngineError on refusal)."""
        self.session = await self.state.require_session()
        await self.place.wait(on_wait)
        self.session = session = await self.state.require_session()
        if not self.state.llama_options.jinja and self.req.grammar_reasoning:
            self.req = dataclasses.replace(self.req, grammar_reasoning=False)
        try:
            self.prepared = await wait_future(self.state.engine.submit(prepare, session, self.req))
        except EngineError as e:
            if e.code == "context_full":
                self.state.note_context_refusal(e)
            raise
        return self.prepared

    async def run(self, on_batch: Callable[[Batch], Awaitable[None]],
                  on_idle: Callable[[], Awaitable[None]] | None = None) -> TurnResult:
        assert self.session is not None and self.prepared is not None
        state, session, prepared, req = self.state, self.session, self.prepared, self.req
        pipe = TokenPipe(self.cancel)

        def job() -> TurnResult:
            try:
                if session.ctx is None:
                    raise EngineError("failed", "The model was unloaded before this turn ran.")
                return run_turn(session, prepared, req, self.cancel,
                                lambda ev, rec: pipe.put((ev, rec)),
                                lambda progress: pipe.put((progress, None)))
            finally:
                pipe.close_writer()

        with state.generation(self.cancel):
            fut = state.engine.submit(job)
            try:
                await _pump(state, pipe, on_batch, on_idle)
            except BaseException:
                pipe.close_reader()
                await let_go(fut)
                raise
        result: TurnResult = await wait_future(fut)
        state.metrics.book(result.generation, session.n_batch)
        state.bus.publish("done", result.summary)
        log_turn(state, session, result)
        return result


def log_turn(state: Runtime, session: Session, result: TurnResult) -> None:
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


async def _pump(state: Runtime, pipe: TokenPipe, on_batch: Callable[[Batch], Awaitable[None]],
                on_idle: Callable[[], Awaitable[None]] | None) -> None:
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
            if rec is not None:                 # (a prefill's progress has no record)
                state.bus.publish("token", rec)
        await on_batch(batch)


async def drive(turn: Turn, emit: Emit, shape: Shape | None,
                new_call_id: Callable[[], str] | None = None) -> Finished:
    """Run `turn`, handing each event to `emit`; raises EngineError / HTTPError."""
    async def waiting() -> None:
        await emit(Waiting())

    async def ping() -> None:
        await emit(Ping())

    prepared = turn.prepared or await turn.start(on_wait=waiting)
    await emit(Started(turn.model, len(prepared.tokens)))
    out = TurnOutput(prepared, turn.req, shape, new_call_id,
                     turn.state.llama_options.reasoning_format)     # --reasoning-format

    async def on_batch(batch: Batch) -> None:
        tokens: list[TokenEvent] = []
        for item, _ in batch:                   # tokens, and a prefill's progress between
            if isinstance(item, PrefillProgress):
                await emit(Progress(item))
            else:
                tokens.append(item)
        if tokens:
            for ev in out.feed_batch(tokens):
                await emit(ev)

    result = await turn.run(on_batch, on_idle=ping)
    await emit(Stopped(result.generation.finish))
    for ev in out.finish():
        await emit(ev)
    await check_json_answer(turn.state, turn.req, result, out)
    gen = result.generation
    fin = Finished(model=turn.model, view=out.view, finish=gen.finish, n_prompt=gen.n_prompt,
                   n_prefilled=gen.n_prefilled, n_cached=gen.n_cached, n_output=len(gen.tokens),
                   reasoning_tokens=out.reasoning_tokens, summary=result.summary,
                   call_ids=out.call_ids(), generation=gen, prompt_text=prepared.prompt_text)
    await emit(fin)
    return fin


async def check_json_answer(state: Runtime, req: TurnRequest, result: TurnResult,
                            out: TurnOutput) -> None:
    """A completed (`stop`) answer to a schema must parse; otherwise 500 invalid_output
    and the turn is rolled back out of the KV (the model stays loaded)."""
    view = out.view
    if req.schema is None or result.generation.finish != "stop":
        return
    if view.tool_calls and not view.content:
        return
    try:
        json.loads(view.content)
        return
    except ValueError:
        pass
    session = state.session
    if session is not None:
        await wait_future(state.engine.submit(session.truncate_kv, result.generation.n_prompt))
    raise HTTPError(500, "invalid_output", "The model's answer is not valid JSON although the "
                    "request asked for JSON; the turn was rolled back.")
