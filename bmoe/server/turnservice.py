"""The turn service: one driver from a `TurnRequest` to protocol-neutral events.

Theory of operation
-------------------
Every protocol is a decoder (wire body → `TurnRequest`) and an encoder (events →
bytes); this module is everything between them, written once:

1. `Turn` takes a place in the turn line (503 `busy` when 16 already wait), waits for
   the model and the turn, and prepares the prompt on the engine thread (the engine
   renders, tokenizes, checks the context and picks the grammar).
2. `Turn.run` marks the generation with `state.turn(cancel)` (the one way to say
   "generating"), runs it on the engine thread and reads its tokens back through a
   `TokenPipe`. A cancelled caller (its client went away) sets the turn's cancel flag
   and waits, shielded, for the engine to let go.
3. `drive` feeds the tokens to the parser (`TurnOutput`) and hands each event to the
   encoder's `emit`: `Opened`, `Waiting`/`Ping` keep-alives, `Started`, the deltas,
   then `Finished` or `Failed`. A completed answer to a schema must parse as JSON
   (else 500 `invalid_output`, the turn rolled back out of the KV).
4. `serve` is the whole HTTP side of a turn for any protocol: a JSON answer, or an SSE
   stream. When the line is free a stream takes the turn and prepares it before the
   200, so a refusal is a plain error response; a stream that must wait answers 200
   at once and a later refusal arrives as the encoder's error event.
"""

from __future__ import annotations

import dataclasses

import json
import threading
from typing import Any, Awaitable, Callable, Protocol

import trio

from ..engine.errors import EngineError
from ..engine.session import PrefillProgress, Session, TokenEvent
from ..engine.turn import Prepared, TurnRequest, TurnResult, prepare, run_turn
from ..http.errors import HTTPError
from ..http.types import Response, Send, StreamResponse
from .bridge import TokenPipe, let_go, wait_future
from .state import ServerState
from .turnevents import (Failed, Finished, Opened, Ping, Progress, Shape, Started, Stopped,
                         TurnEvent, TurnOutput, Waiting)

IDLE_PING_S = 15.0  # a running stream with nothing to send for this long gets a keep-alive

Batch = list[tuple[TokenEvent | PrefillProgress, dict[str, Any] | None]]
Emit = Callable[[TurnEvent], Awaitable[None]]


class Encoder(Protocol):
    """One protocol's answer: sans-I/O, one per request."""

    shape: Shape                                # the delta shape the stream wants
    headers: list[tuple[str, str]]              # the stream's extra headers

    def new_call_id(self) -> str: ...
    def encode(self, ev: TurnEvent) -> bytes: ...          # b"" when the event says nothing
    def whole(self, fin: Finished) -> dict[str, Any]: ...  # the non-streaming body


class Turn:
    """One request's turn: its place in line, the session it runs on, its prompt."""

    def __init__(self, state: ServerState, req: TurnRequest) -> None:
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
        options = getattr(self.state, "llama_options", None)
        if options is not None and not options.jinja and self.req.grammar_reasoning:
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

        with state.turn(self.cancel):
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


async def _pump(state: ServerState, pipe: TokenPipe, on_batch: Callable[[Batch], Awaitable[None]],
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
    options = getattr(turn.state, "llama_options", None)       # --reasoning-format
    out = TurnOutput(prepared, turn.req, shape, new_call_id,
                     getattr(options, "reasoning_format", "auto"))

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


async def check_json_answer(state: ServerState, req: TurnRequest, result: TurnResult,
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


async def _ignore(_ev: TurnEvent) -> None:
    return None


async def whole(state: ServerState, req: TurnRequest,
                new_call_id: Callable[[], str] | None = None) -> Finished:
    """A non-streaming turn, from its place in line to the checked final view."""
    turn = Turn(state, req)
    try:
        return await drive(turn, _ignore, None, new_call_id)
    finally:
        turn.close()


async def open_stream(state: ServerState, req: TurnRequest) -> Turn:
    """A streaming turn's place in line. When the line is free the turn is taken and the
    prompt prepared now, before the 200, so a refusal is a plain error response."""
    turn = Turn(state, req)
    if not state.turns.busy and state.state == "ready":
        try:
            await turn.start()
        except BaseException:
            turn.close()
            raise
    return turn


async def stream(turn: Turn, encoder: Encoder, send: Send) -> None:
    """Run an opened turn into `send`, through `encoder`; a refusal is its error event."""
    async def emit(ev: TurnEvent) -> None:
        data = encoder.encode(ev)
        if data:
            await send(data)

    try:
        await emit(Opened(turn.model or turn.state.model_name()))
        await drive(turn, emit, encoder.shape, encoder.new_call_id)
    except (EngineError, HTTPError) as e:
        await emit(Failed(e))
    finally:
        turn.close()


def require_model(state: ServerState) -> None:
    """503 no_model before anything else, unless a load is under way (it is waited for)."""
    if state.session is None and state.state not in ("loading", "planning"):
        raise HTTPError(503, "no_model", "No model is loaded. Load one with "
                        "POST /api/session/load or start the server with -m.")


async def serve(state: ServerState, req: TurnRequest, encoder: Encoder, *, streaming: bool,
                http_error: Callable[[EngineError], HTTPError]) -> Response | StreamResponse:
    """The HTTP side of a turn for any protocol: a JSON answer or an SSE stream."""
    require_model(state)
    try:
        if not streaming:
            return Response.json(encoder.whole(await whole(state, req, encoder.new_call_id)))
        turn = await open_stream(state, req)
    except EngineError as e:
        raise http_error(e) from None
    return StreamResponse(produce=lambda send: stream(turn, encoder, send),
                          headers=list(encoder.headers), on_close=turn.close)
