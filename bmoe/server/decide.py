"""`POST /api/decide`: one prefill, no decode, the choices scored (see bmoe.engine.decide).

The request waits in the same turn line as a chat turn (503 `busy` when 16 already
wait), runs on the engine thread, and can be stopped by `POST /api/cancel`, which
sets its cancel flag: llama.cpp's abort callback stops the prefill and the answer
carries `cancelled: true`. A client that goes away stops it the same way. The answer
is also published as a `decide` event.

Refusals: a body of the wrong shape, an empty `choices`, two choices sharing a first
token, a prompt past the context: 400; no model: 503 `no_model`; the `decide`
parameter off for the loaded session: 409 `decide_off` (the server's mode refuses the
feature, as `chat_only` does for the agent's workspaces).
"""

from __future__ import annotations

from typing import Any

from ..engine.decide import DecideRequest, DecideResult, decide
from ..http.errors import HTTPError
from ..http.types import Request, Response
from ..runtime.state import Runtime
from . import wire


def parse_request(body: dict[str, Any]) -> DecideRequest:
    b = wire.parse(wire.DecideBody, body)
    return DecideRequest(prefix=b.prefix or "", suffix=b.suffix or "", choices=list(b.choices),
                         reuse_prefix=True if b.reuse_prefix is None else b.reuse_prefix)


def decide_enabled(state: Runtime) -> bool:
    values = state.loaded_values if state.loaded_values is not None else state.config.values
    return bool(values.get("decide", True))


async def handle(state: Runtime, request: Request) -> Response:
    body = request.json_object()
    req = parse_request(body)
    await state.require_session()                     # 503 no_model; waits through a load
    if not decide_enabled(state):
        raise HTTPError(409, "decide_off", "Decisions are turned off for this session: turn "
                        "on Decisions in the settings and load the model again.")
    result: DecideResult = await state.exclusive(decide, req)   # the turn line's, cancellable
    answer = result.answer()
    state.bus.publish("decide", answer)
    log_decision(state, req, result)
    return Response.json(answer)


def log_decision(state: Runtime, req: DecideRequest, r: DecideResult) -> None:
    what = "cancelled" if r.cancelled else f"best {r.best} of {len(req.choices)}"
    state.bus.log("info", f"decide: {what}; prompt {r.n_tokens} tokens ({r.n_reused} reused, "
                  f"{r.n_prefilled} prefilled in {r.prefill_s:.3f} s, restore "
                  f"{r.restore_s:.3f} s, store {r.store_s:.3f} s)")
