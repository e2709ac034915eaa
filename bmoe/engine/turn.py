"""The engine-level turn: what every protocol's decoder builds, and its runner.

A `TurnRequest` is protocol-free: the conversation as the chat template reads it,
the tools, the tool choice, the token budget, the thinking switch, an output schema
or a llama.cpp grammar. The engine owns every decision that follows from it:
`prepare` renders, tokenizes, checks the context and picks the grammar (a forced
call, a lazy call grammar for `auto`, a schema, the caller's GBNF) from the
session's tool-call framing, found at load; `run_turn` generates on the engine
thread and hands each token to `emit`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import families
from . import grammar as gbnf
from .chatparse import CALL_OPEN
from .errors import EngineError, context_full, no_vision
from .families.grammar_calls import tool_call_grammar, tool_call_heads
from .images import ImageSet
from .sampling import Sampling, check_tokens
from .session import Generation, PrefillProgress, Session, TokenEvent
from .telemetry import ProcessProbe, token_record
from .templating import TemplateError
from .triggers import Triggers
from .triggers import resolve as resolve_triggers

log = logging.getLogger("bmoe.chat")

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class TurnRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None      # OpenAI function tools, as the template reads them
    tool_choice: str = "auto"                        # auto | none | required
    named_tool: str | None = None                    # required: the one tool the call must name
    max_tokens: int = 0                              # 0 = no ceiling but the context
    think: bool = True
    schema: dict[str, Any] | None = None             # JSON schema for the answer
    grammar: str | None = None                       # a GBNF the answer must match (llama.cpp's field)
    parallel_calls: bool = False                     # a required turn may make several calls
    # llama-server's /completion: a raw prompt (strings and token ids, no chat template),
    # the request's own sampling, and whether the KV prefix may be reused.
    raw_prompt: list[str | int] | None = None
    sampling: Sampling | None = None
    cache_prompt: bool = True
    # the request's images, each marked at its place in `messages` (`images.ImageSet`)
    images: ImageSet | None = None
    # extra template variables (``reasoning_effort`` for gpt-oss)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # llama-server's `return_progress`: the prefill's progress is emitted as it goes
    progress: bool = False
    # the last message is the assistant's answer begun (a prefill): the answer goes on
    # from its text (llama-server's continue_final_message, Anthropic's prefill)
    continue_final: bool = False
    # llama-server's add_generation_prompt false: the prompt ends after the conversation,
    # with no turn opened for the answer
    generation_prompt: bool = True
    # whether a schema's or a forced call's grammar admits reasoning before what it
    # constrains (off under llama-server's --no-jinja: its legacy chat path has none)
    grammar_reasoning: bool = True

    def conflict(self) -> str | None:
        """Why these choices cannot hold together (a sentence), or None."""
        required = self.tool_choice == "required"
        if self.schema is not None and required:
            return "An output schema cannot be combined with a required tool call."
        if self.grammar is not None and (self.schema is not None or required):
            return ("`grammar` cannot be combined with an output schema or a required "
                    "tool call.")
        return None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template describes: none when the choice is "none"."""
        return self.tools if self.tools and self.tool_choice != "none" else None


@dataclass
class Prepared:
    prompt_text: str
    tokens: list[int]
    starts_in_reasoning: bool
    framing: str | None
    grammar: str | None
    steps: int                                       # the token budget as a number
    grammar_triggers: list[int] = field(default_factory=list)  # lazy grammar: its trigger tokens
    image_tokens: int = 0                            # of `tokens`, what images take
    family: str | None = None                        # the model's chat format (`families`)
    grammar_patterns: list[str] = field(default_factory=list)  # lazy grammar: its trigger words


@dataclass
class TurnResult:
    prepared: Prepared
    generation: Generation
    summary: dict[str, Any] = field(default_factory=dict)


def ends_inside_think(prompt_text: str) -> bool:
    """Whether the generation prompt leaves a reasoning span open."""
    i = prompt_text.rfind(THINK_OPEN)
    return i >= 0 and prompt_text.find(THINK_CLOSE, i) < 0


def prepare(session: Session, req: TurnRequest) -> Prepared:
    """Render, tokenize, check the context and pick the grammar (engine thread)."""
    if req.raw_prompt is not None:
        return _prepare_raw(session, req, req.raw_prompt)
    text = render_prompt(session, req)
    tokens, cells, image_tokens = _prompt_tokens(session, text, req.images)
    if not tokens:
        raise EngineError("empty_prompt", "The conversation rendered to an empty prompt.")
    if cells >= session.n_ctx:
        raise context_full(cells, session.n_ctx)
    starts = template_variables(session, req)[0] and families.ends_inside_reasoning(
        session.tool_framing, text)
    framing = session.tool_framing if req.offered_tools() else None
    grammar = choose_grammar(req, session.tool_framing, starts)
    found = Triggers()
    if isinstance(grammar, LazyGrammar):
        found = lazy_triggers(session, grammar)
        grammar = grammar.text if found else None
    room = session.n_ctx - len(tokens)
    steps = room if req.max_tokens <= 0 else min(req.max_tokens, room)
    return Prepared(text, tokens, starts, framing, grammar, steps, found.tokens, image_tokens,
                    session.tool_framing, found.patterns)


def render_prompt(session: Session, req: TurnRequest) -> str:
    """The conversation through the model's template as its family reads it (the prompt a
    turn generates from, and what /apply-template shows)."""
    begun = req.messages[-1] if req.continue_final and req.messages and \
        req.messages[-1].get("role") == "assistant" else None
    history = req.messages[:-1] if begun is not None else req.messages
    messages = families.template_messages(session.tool_framing, history)
    think, variables = template_variables(session, req)
    opened = req.generation_prompt or begun is not None
    try:
        text = session.render(messages, tools=req.offered_tools(), enable_thinking=think,
                              add_generation_prompt=opened, extra=variables or None)
    except TemplateError as e:
        raise EngineError("template_rejected", str(e)) from e
    text = families.finish_prompt(session.tool_framing, text, opened)
    return text + _continued(begun, text) if begun is not None else text


def _continued(begun: dict[str, Any], prompt: str) -> str:
    """What a begun answer adds after the generation prompt, as llama-server writes it:
    its reasoning inside a reasoning span the prompt leaves open (closed when text
    follows), then its text (content parts joined by a blank line)."""
    content = begun.get("content") or ""
    if isinstance(content, list):
        content = "\n\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    reasoning = str(begun.get("reasoning_content") or "")
    if ends_inside_think(prompt):
        return reasoning + (THINK_CLOSE + "\n\n" + content if content else "")
    return str(content)


def template_variables(session: Session, req: TurnRequest) -> tuple[bool, dict[str, Any]]:
    """Whether the turn thinks, and the template's extra variables: the setting's
    (``chat-template-kwargs``) under the request's own (its ``chat_template_kwargs``).
    The setting's enable_thinking false turns thinking off, as llama-server's flag does,
    unless the request's own variables set enable_thinking (then `req.think` says it)."""
    own = getattr(session, "template_kwargs", None) or {}
    think = req.think and ("enable_thinking" in req.template_kwargs
                           or own.get("enable_thinking", True) is not False)
    return think, {**own, **req.template_kwargs}


def _prompt_tokens(session: Session, text: str,
                   images: ImageSet | None) -> tuple[list[int], int, int]:
    """The prompt's ids, the KV cells they take, and how many are image tokens."""
    if not images:
        if session.vision is not None:
            session.vision.release()
        tokens = session.tokenize(text)
        return tokens, len(tokens), 0
    if session.vision is None:
        raise no_vision()
    vp = session.vision.build_prompt(session, text, images)
    return vp.tokens, vp.n_cells, vp.image_tokens


def raw_tokens(session: Session, parts: list[str | int]) -> list[int]:
    """A llama-server prompt's ids: strings tokenized (special tokens parsed, the
    vocabulary's BOS only before a leading string), ids checked against the vocabulary."""
    check_tokens([p for p in parts if isinstance(p, int)], session.n_vocab, "prompt")
    tokens: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, int):
            tokens.append(part)
        elif i == 0:
            tokens += session.tokenize(part)
        else:
            tokens += session.tokenize(part, add_special=False)
    return tokens


def _prepare_raw(session: Session, req: TurnRequest, parts: list[str | int]) -> Prepared:
    tokens = raw_tokens(session, parts)
    if not tokens:
        raise EngineError("empty_prompt", "The prompt is empty.")
    if len(tokens) >= session.n_ctx:
        raise context_full(len(tokens), session.n_ctx)
    grammar = choose_grammar(req, None, False)
    if isinstance(grammar, LazyGrammar):
        grammar = None
    room = session.n_ctx - len(tokens)
    steps = room if req.max_tokens <= 0 else min(req.max_tokens, room)
    return Prepared("", tokens, False, None, grammar, steps)


def choose_grammar(req: TurnRequest, framing: str | None,
                   starts_in_reasoning: bool) -> "str | LazyGrammar | None":
    """The grammar a turn needs: a forced call (required / named tool), the answer's
    schema, the caller's GBNF, or a lazy call grammar for `auto`. A schema the grammar
    builder refuses is an `invalid_request`, with the field it names."""
    try:
        if req.tool_choice == "required" and req.tools:
            if framing is None:
                raise EngineError("template_rejected", "This model's chat template has no tool-"
                                  "call format the server knows, so a call cannot be required.")
            tools = [t for t in req.tools if t["function"]["name"] == req.named_tool] \
                if req.named_tool else req.tools
            return tool_call_grammar(framing, tools,
                                          allow_reasoning=req.think and req.grammar_reasoning,
                                          starts_in_reasoning=starts_in_reasoning,
                                          parallel=req.parallel_calls,
                                          first_index=calls_so_far(req.messages))
        if req.schema is not None:
            # An answer schema constrains the answer, not the reasoning before it.
            return gbnf.json_schema_grammar(req.schema,
                                            allow_reasoning=req.think and req.grammar_reasoning,
                                            starts_in_reasoning=starts_in_reasoning)
        if req.grammar:
            return req.grammar
        if req.tools and req.tool_choice == "auto" and framing is not None:
            return _lazy_call_grammar(framing, req.tools, calls_so_far(req.messages))
    except ValueError as e:
        raise EngineError("invalid_request", str(e), param=getattr(e, "path", None)) from None
    return None


def calls_so_far(messages: list[dict[str, Any]]) -> int:
    """The tool calls the conversation's assistant messages hold."""
    return sum(len(m.get("tool_calls") or ()) for m in messages
               if isinstance(m, dict) and m.get("role") == "assistant"
               and isinstance(m.get("tool_calls") or (), list))


def _lazy_call_grammar(framing: str, tools: list[dict[str, Any]], first_index: int = 0
                       ) -> "LazyGrammar | None":
    """Free text, until the model opens a call: from there the call must name an offered
    tool with arguments that match it (as llama.cpp's server does). A tool list the grammar
    cannot express leaves the calls unconstrained rather than refusing a turn that may
    never call a tool."""
    try:
        text = tool_call_grammar(framing, tools, allow_reasoning=False, parallel=True,
                                      first_index=first_index)
    except ValueError as e:
        log.warning("tool calls will not be held to a grammar: %s", e)
        return None
    fam = families.family(framing)
    words = list(fam.triggers) if fam is not None and fam.triggers else [CALL_OPEN]
    return LazyGrammar(text, words, tool_call_heads(framing, tools, first_index))


@dataclass
class LazyGrammar:
    """A grammar that holds only from a trigger on (a tool call the model opens): the
    family's marker words, and the literal text each call begins with (`triggers`)."""
    text: str
    triggers: list[str]
    heads: list[str] = field(default_factory=list)


def lazy_triggers(session: Session, lazy: LazyGrammar) -> Triggers:
    """The lazy grammar's markers in this model's vocabulary: a token where the marker is
    one, a word pattern in every case (`triggers.resolve`)."""
    return resolve_triggers(lazy.triggers, lazy.heads,
                            lambda w: session.tokenize(w, add_special=False),
                            session.token_text)


def run_turn(session: Session, prepared: Prepared, req: TurnRequest, cancel: threading.Event,
             emit: Callable[[TokenEvent, dict[str, Any]], None],
             on_progress: Callable[[PrefillProgress], None] | None = None) -> TurnResult:
    """Generate `prepared`'s answer: each token to `emit` with its telemetry record, the
    prefill's progress to `on_progress` when the request asks for it."""
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

    if not req.cache_prompt:
        session.clear_kv()
    encodes = session.vision.encodes if session.vision is not None else 0
    gen = session.generate(prepared.tokens, max_tokens=req.max_tokens, cancel=cancel,
                           on_token=on_token, grammar=prepared.grammar,
                           grammar_triggers=prepared.grammar_triggers,
                           grammar_patterns=prepared.grammar_patterns, sampling=req.sampling,
                           on_progress=on_progress if req.progress else None)
    summary = summarize(session, gen, sums, last, time.monotonic() - t0)
    if prepared.image_tokens:
        summary["image_tokens"] = prepared.image_tokens
        summary["images_encoded"] = (session.vision.encodes - encodes
                                     if session.vision is not None else 0)
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
