"""The engine-level turn: what every protocol adapter builds, and its runner.

A `TurnRequest` is protocol-free: the conversation as the chat template reads it,
the tools, the tool choice, the token budget, the thinking switch and an output
schema. `run_turn` executes one on the engine thread: render, tokenize, check the
context, build the grammar, generate, and hand each token to `emit`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import EngineError
from .session import Generation, Session, TokenEvent
from .telemetry import ProcessProbe, token_record
from .templating import TemplateError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class TurnRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None      # OpenAI function tools, as the template reads them
    tool_choice: str = "auto"                        # auto | none | required
    max_tokens: int = 0                              # 0 = no ceiling but the context
    think: bool = True
    schema: dict[str, Any] | None = None             # JSON schema for the answer
    grammar: str | None = None                       # a GBNF the answer must match (llama.cpp's field)
    grammar_tools: list[dict[str, Any]] | None = None  # the tools a required call may name
    parallel_calls: bool = False                     # a required turn may make several calls


@dataclass
class Prepared:
    prompt_text: str
    tokens: list[int]
    starts_in_reasoning: bool
    framing: str | None
    grammar: str | None
    steps: int                                       # the token budget as a number
    grammar_triggers: list[int] = field(default_factory=list)  # lazy grammar: its trigger tokens


@dataclass
class TurnResult:
    prepared: Prepared
    generation: Generation
    summary: dict[str, Any] = field(default_factory=dict)


def ends_inside_think(prompt_text: str) -> bool:
    """Whether the generation prompt leaves a reasoning span open."""
    i = prompt_text.rfind(THINK_OPEN)
    return i >= 0 and prompt_text.find(THINK_CLOSE, i) < 0


def prepare(session: Session, req: TurnRequest,
            grammar_for: Callable[[Session, TurnRequest, str | None, bool], "str | LazyGrammar | None"] | None = None
            ) -> Prepared:
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    try:
        text = session.render(req.messages, tools=tools, enable_thinking=req.think)
    except TemplateError as e:
        raise EngineError("template_rejected", str(e)) from e
    tokens = session.tokenize(text)
    if not tokens:
        raise EngineError("empty_prompt", "The conversation rendered to an empty prompt.")
    if len(tokens) >= session.n_ctx:
        raise EngineError(
            "context_full",
            f"The conversation is {len(tokens)} tokens and the context ({{ctx-size}}) holds "
            f"{session.n_ctx}: no room for an answer. Raise {{ctx-size}} or shorten the "
            "conversation.")
    starts = req.think and ends_inside_think(text)
    framing = getattr(session, "tool_framing", None)
    grammar = grammar_for(session, req, framing, starts) if grammar_for else None
    triggers: list[int] = []
    if isinstance(grammar, LazyGrammar):
        triggers = [t for word in grammar.triggers for t in _single_token(session, word)]
        grammar = grammar.text if triggers else None
    room = session.n_ctx - len(tokens)
    steps = room if req.max_tokens <= 0 else min(req.max_tokens, room)
    return Prepared(text, tokens, starts, framing, grammar, steps, triggers)


@dataclass
class LazyGrammar:
    """A grammar that holds only from a trigger token on (a tool call the model opens)."""
    text: str
    triggers: list[str]


def _single_token(session: Session, word: str) -> list[int]:
    toks = session.tokenize(word)
    return toks if len(toks) == 1 else []


def run_turn(session: Session, prepared: Prepared, req: TurnRequest, cancel: threading.Event,
             emit: Callable[[TokenEvent, dict[str, Any]], None]) -> TurnResult:
    probe = ProcessProbe()
    t0 = time.monotonic()
    walls: list[float] = []
    sums = {"io_ms": 0.0, "stall_ms": 0.0, "mgmt_ms": 0.0, "read_mib": 0.0, "majflt": 0,
            "cpu_ms": 0.0}
    last: dict[str, Any] = {}

    def on_token(ev: TokenEvent) -> None:
        rec = token_record(ev.step, prepared.steps, ev.wall_ms, ev.telemetry, probe.sample())
        walls.append(ev.wall_ms)
        for k in sums:
            sums[k] += rec.get(k, 0) or 0
        last.clear()
        last.update(rec)
        emit(ev, rec)

    gen = session.generate(prepared.tokens, max_tokens=req.max_tokens, cancel=cancel,
                           on_token=on_token, grammar=prepared.grammar,
                           grammar_triggers=prepared.grammar_triggers)
    summary = summarize(session, gen, sums, last, time.monotonic() - t0)
    return TurnResult(prepared, gen, summary)


def summarize(session: Session, gen: Generation, sums: dict[str, Any], last: dict[str, Any],
              total_s: float) -> dict[str, Any]:
    """The `done` event / `bmoe.summary` keys (the CLI's BMOE_DONE keys)."""
    n = len(gen.tokens)
    per = (lambda x: round(x / n / 1000.0, 6)) if n else (lambda x: 0.0)
    tok_s = n / gen.decode_s if gen.decode_s > 0 and n else 0.0
    streamer = session.streamer.summary() if session.streamer is not None else {}
    io_s_tok = per(sums["io_ms"])
    stall_s_tok = per(sums["stall_ms"])
    mgmt_s_tok = per(sums["mgmt_ms"])
    flash = stall_s_tok if streamer.get("overlap") else io_s_tok
    s_tok = gen.decode_s / n if n else 0.0
    return {
        "cancelled": gen.finish == "cancelled",
        "tokens": n,
        "tok_s": round(tok_s, 3),
        "load_s": round(session.load_s, 3),
        "prefill_s": round(gen.prefill_s, 4),
        "prefill_tps": round(gen.n_prefilled / gen.prefill_s, 2) if gen.prefill_s > 0 else 0.0,
        "prefill_read_mib": round(float(streamer.get("prefill_read_mib", 0.0)), 3),
        "prefill_dev_tokens": 0,
        "n_prompt": gen.n_prefilled,
        "n_past": gen.n_past,
        "cache_hit_pct": streamer.get("cache_hit_pct", -1),
        "read_mib": round(sums["read_mib"], 3),
        "io_s_tok": io_s_tok,
        "compute_s_tok": round(max(0.0, s_tok - flash - mgmt_s_tok), 6),
        "stall_s_tok": stall_s_tok,
        "flash_wait_s_tok": flash,
        "mgmt_s_tok": mgmt_s_tok,
        "majflt_tok": round(sums["majflt"] / n, 3) if n else 0.0,
        "cpu_s_tok": per(sums["cpu_ms"]),
        "loop_overhead_s_tok": 0.0,
        "cache_resident_mib": streamer.get("cache_resident_mib", 0.0),
        "cache_budget_mib": streamer.get("cache_budget_mib", 0.0),
        "cache_evictions": streamer.get("cache_evictions", 0),
        "cache_rereads": streamer.get("cache_rereads", 0),
        "cache_discarded": streamer.get("cache_discarded", 0),
        "token_demand_mib": streamer.get("token_demand_mib", 0.0),
        "mtp_drafted": 0, "mtp_accepted": 0, "mtp_decodes": 0, "drafted_steps": 0,
        "mtp_draft_s_tok": 0.0,
        "ttft_s": round(gen.ttft_s, 4),
    }
