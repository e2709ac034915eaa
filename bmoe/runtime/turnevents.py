"""What a turn says while it runs: protocol-neutral events, and the parser that makes them.

Theory of operation
-------------------
The turn service (`turnservice.py`) runs a turn and hands each event below to the
protocol's encoder, which turns it into bytes (SSE chunks) or, for a whole answer,
reads the `Finished` event into one JSON body. Nothing here does I/O or knows a wire
format: an encoder can be tested by feeding it events by hand.

The answer's text comes in one of two shapes, the one the encoder asks for:

* ``revisable`` (OpenAI chat): `TextDelta`, `ReasoningDelta`, `ToolCallStart`,
  `ToolArgsDelta`, and `Reset` when the parser takes back text it had shown (a
  tool call recognised late): the full reasoning and content so far.
* ``blocks`` (Anthropic Messages, Responses): the protocol cannot take text back, so
  the parser's view is cut into append-only blocks (`BlockOpen` / `BlockAppend` /
  `BlockClose` from `bmoe.engine.chatparse`).

Around them: `Opened` (the stream exists, before any wait), `Waiting` and `Ping`
(keep-alives), `Started` (the turn holds the engine; the prompt is prepared),
`Stopped` (the generation ended: the last deltas follow), `Finished` (usage and the
finish reason) or `Failed` (the error, mapped by the
protocol to its own shape).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from ..engine.chatparse import (
    THINK_CLOSE,
    THINK_OPEN,
    AppendOnlyStream,
    BlockClose,
    BlockEvent,
    BlockOpen,
    ChatDeltaStream,
    ParseView,
    choose_call_id,
    conversation_call_ids,
    random_call_ids,
)
from ..engine.errors import EngineError
from ..engine.families import call_id_maker, output_parser, reasoning_markers
from ..engine.session import Generation, PrefillProgress, TokenEvent
from ..engine.turn import Prepared, TurnRequest
from ..http.errors import HTTPError

log = logging.getLogger("bmoe.chat")

Shape = Literal["revisable", "blocks", "raw"]   # raw: the text as generated, no parser


@dataclass(frozen=True)
class Opened:
    model: str                      # the loaded model's name when the stream opened ("" if none)


@dataclass(frozen=True)
class Waiting:
    pass


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Started:
    model: str
    n_prompt: int = 0               # the prompt's tokens, as prepared (with its images')


@dataclass(frozen=True)
class Stopped:
    finish: str                     # the generation ended (stop | length | cancelled); the
                                    # last deltas and `Finished` follow


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class Reset:
    content: str
    reasoning: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class RawTokens:
    """The `raw` shape's delta: a batch of generated tokens as they came (ids, text,
    log-probabilities when asked), for llama-server's /completion."""
    tokens: tuple[TokenEvent, ...]


@dataclass(frozen=True)
class Decoded:
    """A batch of the answer's tokens was decoded: how many and in how long (an encoder's
    running `timings`, llama-server's `timings_per_token`)."""
    n_tokens: int
    wall_ms: float


class RunningTimings:
    """llama-server's `timings` while a turn runs: the prefill's as it last reported
    (`Progress`), the tokens decoded since (`Decoded`)."""

    def __init__(self) -> None:
        self.prompt: dict[str, Any] = {}
        self.n_out = 0
        self.decode_ms = 0.0

    def take(self, ev: "TurnEvent") -> None:
        if isinstance(ev, Progress):
            self.prompt = progress_timings(ev.prefill)
        elif isinstance(ev, Decoded):
            self.n_out += ev.n_tokens
            self.decode_ms += ev.wall_ms

    def body(self) -> dict[str, Any]:
        n, ms = self.n_out, self.decode_ms
        return {**(self.prompt or progress_timings(None)), "predicted_n": n,
                "predicted_ms": ms, "predicted_per_token_ms": ms / n if n else 0.0,
                "predicted_per_second": n / (ms / 1e3) if ms > 0 else 0.0}


def generation_timings(gen: Generation) -> dict[str, Any]:
    """llama-server's `timings` of a finished generation. The rate of generation is over
    the decode steps: the first token comes from the prompt's last logits."""
    p_ms, d_ms, n_out = gen.prefill_s * 1000.0, gen.decode_s * 1000.0, len(gen.tokens)
    return {"cache_n": gen.n_cached, "prompt_n": gen.n_prefilled, "prompt_ms": p_ms,
            "prompt_per_token_ms": p_ms / gen.n_prefilled if gen.n_prefilled else 0.0,
            "prompt_per_second": gen.n_prefilled / gen.prefill_s if gen.prefill_s > 0 else 0.0,
            "predicted_n": n_out, "predicted_ms": d_ms,
            "predicted_per_token_ms": d_ms / (n_out - 1) if n_out > 1 else 0.0,
            "predicted_per_second": (n_out - 1) / gen.decode_s
            if n_out > 1 and gen.decode_s > 0 else 0.0}


def progress_timings(p: PrefillProgress | None) -> dict[str, Any]:
    """The prompt's part of `timings` while it prefills (nothing decoded yet)."""
    done = p.processed - p.cache if p is not None else 0
    ms = p.elapsed_ms if p is not None and done else 0.0
    return {"cache_n": p.cache if p is not None else 0, "prompt_n": done, "prompt_ms": ms,
            "prompt_per_token_ms": ms / done if done else 0.0,
            "prompt_per_second": done / (ms / 1e3) if ms > 0 else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0,
            "predicted_per_second": 0.0}


@dataclass(frozen=True)
class Progress:
    """How far the prompt's prefill has come (asked with llama-server's `return_progress`)."""
    prefill: PrefillProgress

    def body(self) -> dict[str, Any]:
        """llama-server's `prompt_progress` object."""
        p = self.prefill
        return {"total": p.total, "cache": p.cache, "processed": p.processed,
                "time_ms": p.elapsed_ms if p.processed > p.cache else 0.0}


@dataclass(frozen=True)
class Finished:
    model: str
    view: ParseView                 # the parser's final reading of the answer
    finish: str                     # stop | length | cancelled
    n_prompt: int                   # the prompt's tokens
    n_prefilled: int                # ... of which computed now (the rest came from the KV)
    n_cached: int
    n_output: int
    reasoning_tokens: int           # tokens of batches that left the answer reasoning only
    summary: dict[str, Any] = field(default_factory=dict)   # the `done` keys
    call_ids: tuple[str, ...] = ()  # the ids a stream gave the calls, in order
    generation: Generation | None = None   # the engine's own account (ids, timings, stop)
    prompt_text: str = ""           # the prompt as rendered (llama-server's `verbose`)


@dataclass(frozen=True)
class Failed:
    error: EngineError | HTTPError


TurnEvent = Union[Opened, Waiting, Ping, Started, Stopped, TextDelta, ReasoningDelta, Reset,
                  ToolCallStart, ToolArgsDelta, BlockEvent, RawTokens, Decoded, Progress,
                  Finished, Failed]


def _chat_event(delta: dict[str, Any]) -> list[TurnEvent]:
    """One `ChatDeltaStream` delta as neutral events."""
    if delta.get("reset"):
        return [Reset(delta["content"], delta["reasoning_content"])]
    if "reasoning_content" in delta:
        return [ReasoningDelta(delta["reasoning_content"])]
    if "content" in delta:
        return [TextDelta(delta["content"])]
    call = delta["tool_calls"][0]
    if "id" in call:
        return [ToolCallStart(call["index"], call["id"], call["function"]["name"])]
    return [ToolArgsDelta(call["index"], call["function"]["arguments"])]


class ReasoningKept:
    """llama-server's `--reasoning-format none` and `deepseek-legacy`: a thinking model's
    reasoning stays in the content as the model wrote it, tags and all (`none`: only
    there; `deepseek-legacy`: in reasoning_content too). Tool calls are still read: then
    the content is the reasoning in its tags followed by the text."""

    def __init__(self, parser: Any, fmt: str, tools: bool,
                 markers: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> None:
        self._parser = parser
        self._markers = markers              # the family's own (Gemma 4's thought channel)
        self._keep_reasoning = fmt == "deepseek-legacy"
        self._tools = tools
        self._raw = ""

    def feed(self, text: str) -> None:
        self._raw += text
        self._parser.feed(text)

    def snapshot(self) -> ParseView:
        return self._view(self._parser.snapshot())

    def finish(self) -> ParseView:
        return self._view(self._parser.finish())

    def _view(self, view: ParseView) -> ParseView:
        if not self._tools:                  # nothing but reasoning to read: the raw text
            content = self._raw.strip()
        elif view.reasoning:
            opener, closer = self._markers
            content = f"{opener}\n{view.reasoning}\n{closer}\n\n{view.content}".strip()
        else:
            content = view.content
        return ParseView(view.reasoning if self._keep_reasoning else "", content,
                         view.tool_calls, view.fallback_raw)


REASONING_KEPT = ("none", "deepseek-legacy")


class TurnOutput:
    """The parser's reading of one generation, as events of one shape (or none)."""

    def __init__(self, prepared: Prepared, req: TurnRequest, shape: Shape | None,
                 new_call_id: Callable[[], str] | None = None,
                 reasoning_format: str = "auto") -> None:
        tools = req.offered_tools()
        self.parser = output_parser(prepared.framing if tools else None,
                                    prepared.starts_in_reasoning, tools, prepared.family)
        if reasoning_format in REASONING_KEPT:
            self.parser = ReasoningKept(self.parser, reasoning_format, bool(tools),
                                        reasoning_markers(prepared.family))
        self.shape = shape
        # a call keeps the id its model wrote when the format carries one and the
        # conversation does not hold it yet; others get the family's kind of new id
        new_id = call_id_maker(prepared.family, new_call_id or random_call_ids())
        taken = conversation_call_ids(req.messages)
        self._new_id, self._taken = new_id, taken
        self._chat = ChatDeltaStream(new_id, taken) if shape == "revisable" else None
        self._blocks = AppendOnlyStream(new_id, taken) if shape == "blocks" else None
        self._whole_ids: tuple[str, ...] | None = None
        self.view = ParseView()
        self.reasoning_tokens = 0

    def feed_batch(self, tokens: list[TokenEvent]) -> list[TurnEvent]:
        """One batch of the engine's tokens; the `raw` shape skips the parser."""
        text = "".join(ev.text for ev in tokens)
        if self.shape != "raw":
            # asked-for log-probabilities travel beside the parser's reading, before it
            done: list[TurnEvent] = [Decoded(len(tokens), sum(t.wall_ms for t in tokens))]
            if any(ev.logprob is not None for ev in tokens):
                done.append(RawTokens(tuple(tokens)))
            return done + self.feed(text, len(tokens))
        self.view = ParseView(content=self.view.content + text)
        return [RawTokens(tuple(tokens))]

    def feed(self, text: str, n_tokens: int) -> list[TurnEvent]:
        if text:
            self.parser.feed(text)
            self.view = self.parser.snapshot()
        view = self.view
        if view.reasoning and not view.content and not view.tool_calls:
            self.reasoning_tokens += n_tokens
        return self._events(view, final=False)

    def finish(self) -> list[TurnEvent]:
        if self.shape == "raw":
            return []
        self.view = self.parser.finish()
        if self.view.fallback_raw:
            log.warning("the answer parsed to nothing; returning the raw text as content")
        return self._events(self.view, final=True)

    def call_ids(self) -> tuple[str, ...]:
        """The calls' ids in order: the stream's, or (a whole answer) chosen once from the
        final view as a stream would."""
        stream = self._chat or self._blocks
        if stream is not None:
            return tuple(stream.call_ids)
        if self._whole_ids is None:
            taken = set(self._taken)
            self._whole_ids = tuple(choose_call_id(c, taken, self._new_id)
                                    for c in self.view.tool_calls)
        return self._whole_ids

    def _events(self, view: ParseView, final: bool) -> list[TurnEvent]:
        if self._chat is not None:
            deltas = self._chat.finish(view) if final else self._chat.update(view)
            return [ev for d in deltas for ev in _chat_event(d)]
        if self._blocks is not None:
            return list(self._blocks.finish(view) if final else self._blocks.update(view))
        return []


def opens_tool_call(ev: TurnEvent) -> bool:
    return isinstance(ev, ToolCallStart) or (isinstance(ev, BlockOpen) and ev.kind == "tool_call")


__all__ = ["Opened", "Waiting", "Ping", "Started", "Stopped", "TextDelta", "ReasoningDelta", "Reset",
           "ToolCallStart", "ToolArgsDelta", "BlockOpen", "BlockClose", "Finished", "Failed",
           "TurnEvent", "TurnOutput", "Shape", "RawTokens", "Decoded", "RunningTimings",
           "opens_tool_call"]
