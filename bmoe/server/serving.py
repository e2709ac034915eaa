"""The HTTP side of a turn, for every generation route: one `serve`.

Theory of operation
-------------------
A protocol's handler decodes its body into one `TurnRequest` per choice (`n` choices
are n turns, run one after another: the server has one session) and makes one encoder
per choice; `serve` does the rest, the same for chat, Messages, Responses, `/completion`
and `/v1/completions`:

* without `stream`: each turn is run whole through the runtime's `drive`; the encoder
  makes its JSON body from the final view (`collect`: it also reads every event, to
  keep texts, ids or probabilities), and `merge` makes n bodies one;
* with `stream`: an SSE body. When the turn line is free the first turn takes the turn
  and prepares its prompt before the 200, so a refusal is a plain error response; a
  stream that must wait answers 200 at once and a later refusal arrives as the
  encoder's error event. Each choice's events follow the one before's; a choice that
  failed ends the stream (its encoder said so).

An `EngineError` raised before the 200 leaves the handler as it is: the route table
maps it once, in the route's own protocol shape (`shapes.engine_error`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..engine.errors import EngineError
from ..engine.turn import TurnRequest
from ..http.errors import HTTPError
from ..http.sse import SSE_HEADERS
from ..http.types import Response, Send, StreamResponse
from ..runtime.state import Lifecycle, Runtime
from ..runtime.turnevents import Failed, Finished, Opened, Shape, TurnEvent
from ..runtime.turnservice import Turn, drive


class Encoder(Protocol):
    """One protocol's answer to one choice: sans-I/O, one per choice of a request."""

    shape: Shape                                # the delta shape the stream wants
    headers: list[tuple[str, str]]              # the stream's extra headers

    def new_call_id(self) -> str: ...
    def encode(self, ev: TurnEvent) -> bytes: ...          # b"" when the event says nothing
    def whole(self, fin: Finished) -> dict[str, Any]: ...  # the non-streaming body


class ChoiceEncoder(Encoder, Protocol):
    """An encoder of choice i of n: the stream of a choice after the first that cannot
    take its place in line says so itself."""

    def error_bytes(self, err: HTTPError) -> bytes: ...


async def _ignore(_ev: TurnEvent) -> None:
    return None


async def whole(state: Runtime, req: TurnRequest, encoder: Encoder,
                collect: bool = False) -> dict[str, Any]:
    """One non-streaming turn, from its place in line to the encoder's body; with
    `collect` the encoder reads every event on the way (texts, ids, probabilities)."""
    turn = Turn(state, req)

    async def emit(ev: TurnEvent) -> None:
        encoder.encode(ev)

    try:
        fin = await drive(turn, emit if collect else _ignore, encoder.shape,
                          encoder.new_call_id)
    finally:
        turn.close()
    return encoder.whole(fin)


async def open_stream(state: Runtime, req: TurnRequest) -> Turn:
    """A streaming turn's place in line. When the line is free the turn is taken and the
    prompt prepared now, before the 200, so a refusal is a plain error response."""
    turn = Turn(state, req)
    if not state.turns.busy and state.state == Lifecycle.READY:
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


def require_model(state: Runtime) -> None:
    """503 no_model before anything else, unless a load is under way (it is waited for)."""
    if state.session is None and not state.state.loading:
        raise HTTPError(503, "no_model", "No model is loaded. Load one with "
                        "POST /api/session/load or start the server with -m.")


async def serve(state: Runtime, reqs: list[TurnRequest], encoders: list[Any], *,
                streaming: bool, merge: Callable[[list[dict[str, Any]]], dict[str, Any]]
                | None = None, collect: bool = False,
                failed: Callable[[], bool] = lambda: False) -> Response | StreamResponse:
    """The HTTP side of one request's turns (one per choice), for any protocol.

    `failed()` says a streamed choice failed, so the choices after it do not run."""
    if len(reqs) != len(encoders) or not reqs:
        raise ValueError("serve needs one encoder per request, and a request")
    require_model(state)
    if not streaming:
        bodies = [await whole(state, r, e, collect) for r, e in zip(reqs, encoders, strict=True)]
        return Response.json(merge(bodies) if merge is not None else bodies[0])
    first = await open_stream(state, reqs[0])

    async def produce(send: Send) -> None:
        await stream(first, encoders[0], send)
        for req, encoder in zip(reqs[1:], encoders[1:], strict=True):
            if failed():
                return
            try:
                turn = Turn(state, req)
            except HTTPError as e:
                await send(encoder.error_bytes(e))
                return
            await stream(turn, encoder, send)

    headers = list(SSE_HEADERS) + [h for h in encoders[0].headers if h not in SSE_HEADERS]
    return StreamResponse(produce=produce, headers=headers, on_close=first.close)
