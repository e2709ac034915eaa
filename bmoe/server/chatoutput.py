"""From generated text to a protocol's answer: parsing, grammars, JSON checks, errors.

Shared by every protocol adapter: `TurnOutput` feeds the chat parser with the text
of each token batch and keeps the parser's view; `grammar_for` builds the grammar a
turn's tool choice or output schema needs; `check_json_answer` enforces "a completed
JSON answer parses"; `engine_http_error` turns an engine failure into the HTTP error
it is (labels rendered in its message).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..engine import grammar, params
from ..engine.chatparse import ChatDeltaStream, OutputParser, ParseView, random_call_ids
from ..engine.errors import EngineError
from ..engine.chatparse import CALL_OPEN
from ..engine.turn import LazyGrammar, Prepared, TurnRequest, TurnResult
from ..http.errors import HTTPError
from .bridge import wait_future
from .turnrunner import Batch, TurnRun

log = logging.getLogger("bmoe.chat")

STATUS_OF = {"context_full": 400, "empty_prompt": 400, "template_rejected": 400,
             "needs_chat_mode": 400, "invalid_request": 400, "no_vision": 400,
             "invalid_output": 500, "failed": 500}


def engine_http_error(e: EngineError) -> HTTPError:
    return HTTPError(STATUS_OF.get(e.code, 500), e.code, params.render(e.message, "label"))


class TurnOutput:
    """The parser's reading of one generation, and the OpenAI chat deltas it yields."""

    def __init__(self, prepared: Prepared, req: TurnRequest) -> None:
        tools = req.tools if req.tool_choice != "none" else None
        framing = prepared.framing if tools else None
        self.parser = OutputParser(framing, prepared.starts_in_reasoning, tools)
        self.deltas = ChatDeltaStream(random_call_ids())
        self._view = ParseView()

    def feed(self, text: str) -> ParseView:
        if text:
            self.parser.feed(text)
            self._view = self.parser.snapshot()
        return self._view

    def feed_deltas(self, text: str) -> list[dict[str, Any]]:
        return self.deltas.update(self.feed(text))

    def finish(self, result: TurnResult) -> ParseView:
        view = self.parser.finish()
        if view.fallback_raw:
            log.warning("the answer parsed to nothing; returning the raw text as content")
        self._view = view
        return view

    def final_deltas(self, view: ParseView) -> list[dict[str, Any]]:
        return self.deltas.finish(view)

    def tool_calls(self) -> bool:
        return bool(self._view.tool_calls)

    def tool_calls_final(self, view: ParseView) -> list[dict[str, Any]]:
        """The calls as OpenAI `tool_calls`, with the ids the stream used (if any)."""
        ids = self.deltas.call_ids
        new_id = random_call_ids()
        out = []
        for i, call in enumerate(view.tool_calls):
            out.append({"id": ids[i] if i < len(ids) else new_id(), "type": "function",
                        "function": {"name": call.name,
                                     "arguments": call.arguments_text or "{}"}})
        return out


def grammar_for(session: Any, req: TurnRequest, framing: str | None,
                starts_in_reasoning: bool) -> str | LazyGrammar | None:
    """The grammar a turn needs (runs on the engine thread inside `prepare`)."""
    try:
        if req.tool_choice == "required" and req.tools:
            if framing is None:
                raise EngineError("template_rejected", "This model's chat template has no tool-"
                                  "call format the server knows, so a call cannot be required.")
            tools = req.grammar_tools or req.tools
            return grammar.tool_call_grammar(framing, tools, allow_reasoning=req.think,
                                             starts_in_reasoning=starts_in_reasoning,
                                             parallel=req.parallel_calls)
        if req.schema is not None:
            return _schema_grammar(req.schema, req.think, starts_in_reasoning)
        if req.grammar:
            return req.grammar
        if req.tools and req.tool_choice == "auto" and framing is not None:
            return _lazy_call_grammar(framing, req.tools)
    except ValueError as e:
        raise EngineError("invalid_request", str(e)) from None
    return None


def _lazy_call_grammar(framing: str, tools: list[dict[str, Any]]) -> LazyGrammar | None:
    """Free text, until the model opens a call: from there the call must name an offered
    tool with arguments that match it (as llama.cpp's server does). A tool list the grammar
    cannot express leaves the calls unconstrained rather than refusing a turn that may
    never call a tool."""
    try:
        text = grammar.tool_call_grammar(framing, tools, allow_reasoning=False, parallel=True)
    except ValueError as e:
        log.warning("tool calls will not be held to a grammar: %s", e)
        return None
    return LazyGrammar(text, [CALL_OPEN])


def _schema_grammar(schema: dict[str, Any], think: bool, starts_in_reasoning: bool) -> str:
    # An answer schema constrains the answer, not the reasoning before it.
    return grammar.json_schema_grammar(schema, allow_reasoning=think,
                                       starts_in_reasoning=starts_in_reasoning)


async def check_json_answer(state: Any, req: TurnRequest, result: TurnResult,
                            view: ParseView) -> None:
    """A completed (`stop`) answer to a schema must parse; otherwise 500 invalid_output
    and the turn is rolled back out of the KV (the model stays loaded)."""
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


# -- running a turn for an adapter ------------------------------------------------------

def require_model(state: Any) -> None:
    """503 no_model before anything else, unless a load is under way (it is waited for)."""
    if state.session is None and state.state != "loading":
        raise HTTPError(503, "no_model", "No model is loaded. Load one with "
                        "POST /api/session/load or start the server with -m.")


async def open_stream_turn(state: Any, req: TurnRequest,
                           to_http: Callable[[EngineError], HTTPError]) -> TurnRun:
    """A streaming turn's place in line. When the line is free the turn is taken and the
    prompt prepared now, before the 200, so a refusal is a plain error response."""
    run = TurnRun(state, req, grammar_for=grammar_for)
    if not state.turns.busy and state.state == "ready":
        try:
            await run.start()
        except EngineError as e:
            run.close()
            raise to_http(e) from None
        except BaseException:
            run.close()
            raise
    return run


@dataclass
class WholeTurn:
    model: str
    output: TurnOutput
    result: TurnResult
    view: ParseView


async def run_whole(state: Any, req: TurnRequest, to_http: Callable[[EngineError], HTTPError],
                    on_view: Callable[[Batch, ParseView], None] | None = None) -> WholeTurn:
    """A non-streaming turn from place in line to the checked final view."""
    run = TurnRun(state, req, grammar_for=grammar_for)
    try:
        prepared = await run.start()
        model = run.session.path.name if run.session else ""
        out = TurnOutput(prepared, req)

        async def on_batch(batch: Batch) -> None:
            view = out.feed("".join(ev.text for ev, _ in batch))
            if on_view is not None:
                on_view(batch, view)

        result = await run.run(on_batch)
    except EngineError as e:
        raise to_http(e) from None
    finally:
        run.close()
    view = out.finish(result)
    await check_json_answer(state, req, result, view)
    return WholeTurn(model, out, result, view)
