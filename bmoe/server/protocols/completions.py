"""llama-server's text completions: `POST /completion` and OpenAI's `POST /v1/completions`.

Theory of operation
-------------------
Both routes are a decoder and an encoder over the one turn service:

* `decode_completion` / `decode_openai` read the body (a pydantic wire model for the
  types, then the checks a type cannot say: ranges, the prompt's shape, the fields
  bmoe cannot honour, refused by name) into a `TurnRequest` with a raw prompt (no
  chat template) and the request's own `Sampling`. Token ids are checked against the
  vocabulary on the engine thread (`bmoe.engine.turn.raw_tokens`,
  `bmoe.engine.sampling.build_chain`) before llama.cpp sees one.
* `LlamaEncoder` / `OpenAIEncoder` turn the events of a turn in the `raw` shape into
  llama-server's JSON or SSE chunks. Stop strings are held back while they may still
  be forming (`StopFilter`), so no client sees part of one.

Errors on these routes have llama-server's shape (`llama_error`), installed for
their paths by `shapes.error_shaper`.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from dataclasses import replace
from typing import Annotated, Any

from pydantic import StrictBool, StrictStr

from ...engine.errors import EngineError
from ...engine.sampling import LOGIT_BIAS_ENTRIES_MAX, LOGIT_BIAS_MAX, N_PROBS_MAX, SEED_RANDOM, Sampling
from ...engine.turn import TurnRequest
from ...http.errors import HTTPError, invalid_request
from ...http.sse import sse_comment, sse_done, sse_event
from ...http.types import Request, Response, StreamResponse
from ...runtime.state import Runtime
from ...runtime.turnevents import (
    Failed,
    Finished,
    Ping,
    Progress,
    RawTokens,
    Shape,
    Started,
    TurnEvent,
    Waiting,
    generation_timings,
    progress_timings,
)
from .. import serving, wire
from ..llama_options import slot_count
from ..shapes import LLAMA, engine_error, llama_error_body
from . import choices
from .choices import Tally

I32_MAX = 2**31 - 1
PROMPT_PARTS_MAX = 1 << 20       # ids and strings in one prompt (the body cap bounds it too)
PROMPT_STRINGS_MAX = 4096        # strings among them: each is one tokenizer call
STOP_WORDS_MAX = 16
SLOTS_MAX = 1 << 16              # an `id_slot` past any --parallel
STOP_WORD_CHARS_MAX = 256


# -- request ------------------------------------------------------------------------

class CompletionBody(wire.Wire):
    prompt: Any = None
    stream: StrictBool | None = None
    stop: list[StrictStr] | StrictStr | None = None
    grammar: StrictStr | None = None
    json_schema: wire.Schema = None
    ignore_eos: StrictBool | None = None
    cache_prompt: StrictBool | None = None
    return_tokens: StrictBool | None = None
    return_progress: StrictBool | None = None
    timings_per_token: StrictBool | None = None
    post_sampling_probs: StrictBool | None = None
    stream_options: wire.StreamOptions | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    # sampling, at llama-server's defaults when absent (`read_sampling`)
    temperature: Annotated[Any, wire.Number()] = None
    top_k: Annotated[Any, wire.Integer(-(2**31), I32_MAX)] = None
    top_p: Annotated[Any, wire.Number(0.0, 1.0)] = None
    min_p: Annotated[Any, wire.Number(0.0, 1.0)] = None
    repeat_penalty: Annotated[Any, wire.Number(1e-6, 1e6)] = None
    repeat_last_n: Annotated[Any, wire.Integer(-1, I32_MAX)] = None
    presence_penalty: Annotated[Any, wire.Number(-1e6, 1e6)] = None
    frequency_penalty: Annotated[Any, wire.Number(-1e6, 1e6)] = None
    seed: Annotated[Any, wire.Integer(-1, 2**32 - 1)] = None
    n_probs: Annotated[Any, wire.Integer(0, N_PROBS_MAX)] = None
    n_predict: Annotated[Any, wire.Integer(-1, I32_MAX)] = None
    max_tokens: Annotated[Any, wire.Integer(-1, I32_MAX)] = None
    best_of: Annotated[Any, wire.Integer(1, I32_MAX)] = None


# Fields llama-server has and bmoe does not: refused when they ask for anything
# (a value other than the one that turns the stage off), never silently dropped.
_OFF = {"typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "top_n_sigma": -1.0, "dynatemp_range": 0.0, "n_keep": 0, "n_discard": 0,
        "t_max_predict_ms": 0, "n_indent": 0}
_EMPTY = ("image_data", "multimodal_data", "lora", "samplers")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, off in _OFF.items():
        value = body.get(name)
        if value is not None and value != off:
            raise invalid_request(f"`{name}` is not supported by this server; leave it out "
                                  f"(or {off!r}).")
    for name in _EMPTY:
        if body.get(name):
            raise invalid_request(f"`{name}` is not supported by this server; leave it out.")
    slot = body.get("id_slot")
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int)
                             or not -1 <= slot < SLOTS_MAX):
        raise invalid_request("`id_slot` must be a slot's number (0 up), or -1 for any.")


def read_slot(body: dict[str, Any], slots: int) -> int:
    """The slot a request names (`id_slot`; -1 or none: slot 0), 400 past the last one."""
    slot = body.get("id_slot")
    if slot is None or slot == -1:
        return 0
    if slot >= slots:
        raise invalid_request(f"`id_slot` {slot} is not a slot: this server has {slots} "
                              f"(0 to {slots - 1}; --parallel sets how many).")
    return int(slot)


PROMPTS_MAX = 16                 # prompts in one /completion batch (each runs in turn)


def split_prompts(value: Any, field: str = "prompt") -> list[Any]:
    """llama-server's `prompt` as the prompts it holds: one (a string, ids, or ids mixed
    with strings), or a list of several — each a string, a list of ids, or an object
    `{"prompt_string": ..., "multimodal_data": [...]}`. Each answers in turn."""
    if isinstance(value, dict):
        return [_object_prompt(value, field)]
    several = isinstance(value, list) and len(value) > 1 and \
        any(isinstance(p, (list, dict)) for p in value)
    if not several:
        return [value]
    if len(value) > PROMPTS_MAX:
        raise invalid_request(f"`{field}` holds more than {PROMPTS_MAX} prompts; send fewer "
                              "a request.")
    return [_object_prompt(p, f"{field}[{i}]") if isinstance(p, dict) else p
            for i, p in enumerate(value)]


def _object_prompt(value: dict[str, Any], field: str) -> Any:
    """`{"prompt_string": TEXT}`: the text. Images and audio (`multimodal_data`) on this
    route are refused: /v1/chat/completions takes a vision model's images."""
    if value.get("multimodal_data"):
        raise invalid_request(f"`{field}.multimodal_data` is not supported on this route: "
                              "send images to a vision model on /v1/chat/completions.")
    text = value.get("prompt_string")
    if not isinstance(text, str):
        raise invalid_request(f"`{field}.prompt_string` must be a string.")
    return text


def read_prompt(value: Any, field: str = "prompt") -> list[str | int]:
    """llama-server's prompt: a string, token ids, or a list mixing both (one prompt)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if len(value) > PROMPT_PARTS_MAX:
            raise invalid_request(f"`{field}` has more than {PROMPT_PARTS_MAX} parts.")
        if len(value) == 1 and isinstance(value[0], list):
            return read_prompt(value[0], field)
        parts: list[str | int] = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, int) and not isinstance(part, bool):
                if not 0 <= part <= I32_MAX:
                    raise invalid_request(f"`{field}[{i}]` is {part}, which is not a token id.")
                parts.append(part)
            elif isinstance(part, (list, dict)):
                raise invalid_request(f"`{field}` holds several prompts; send one prompt a "
                                      "request.")
            else:
                raise invalid_request(f"`{field}[{i}]` must be a string or a token id.")
        if sum(isinstance(p, str) for p in parts) > PROMPT_STRINGS_MAX:
            raise invalid_request(f"`{field}` holds more than {PROMPT_STRINGS_MAX} strings; "
                                  "join them.")
        if parts:
            return parts
    if value is None:
        raise invalid_request(f"`{field}` is required.")
    raise invalid_request(f"`{field}` must be a string, token ids, or a list of both.")


LOGIT_BIAS_TEXT_CHARS_MAX = 256     # a text key of logit_bias (its tokens take the bias)


def read_logit_bias(value: Any) -> tuple[tuple[tuple[int, float], ...],
                                         tuple[tuple[str, float], ...]]:
    """OpenAI's object {"id": bias} or llama-server's [[id, bias], ...]; a key may also be
    a text, whose every token takes the bias (as llama-server reads it). A bias is a
    number in -100..100, or false (never this token). Ids are checked against the
    vocabulary, and texts tokenized, on the engine thread. Answers (ids, texts)."""
    if value is None:
        return (), ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for i, pair in enumerate(value):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise invalid_request(f"`logit_bias[{i}]` must be a pair [token id or text, "
                                      "bias].")
            pairs.append((pair[0], pair[1]))
    else:
        raise invalid_request("`logit_bias` must be an object of token ids (or texts) to "
                              "numbers, or a list of [id or text, bias] pairs.")
    if len(pairs) > LOGIT_BIAS_ENTRIES_MAX:
        raise invalid_request(f"`logit_bias` has more than {LOGIT_BIAS_ENTRIES_MAX} entries.")
    ids: dict[int, float] = {}
    texts: dict[str, float] = {}
    by_key = isinstance(value, dict)
    for key, bias in pairs:
        # a key of the object form is an id when it reads as a number (a negative one is
        # no id: refused); a string in the pair form is always a text, as llama-server
        # reads them
        numeric = by_key and re.fullmatch(r"[+-]?[0-9]+", key.strip()) is not None
        if isinstance(key, str) and not numeric:
            if not key or len(key) > LOGIT_BIAS_TEXT_CHARS_MAX:
                raise invalid_request(f"`logit_bias` text keys are 1 to "
                                      f"{LOGIT_BIAS_TEXT_CHARS_MAX} characters.")
            texts[key] = _bias(bias, key)
            continue
        tok = _token_key(key)
        ids[tok] = _bias(bias, tok)         # named twice: the last one holds (llama-server)
    return tuple(ids.items()), tuple(texts.items())


def _token_key(key: Any) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        tok = key
    elif isinstance(key, str) and (m := re.fullmatch(r"\s*\+?([0-9]{1,10})\s*", key)):
        tok = int(m.group(1))
    else:
        raise invalid_request(f"`logit_bias` key {str(key)[:40]!r} is not a token id (ids "
                              "run from 0).")
    if not 0 <= tok <= I32_MAX:
        raise invalid_request(f"`logit_bias` key {tok} is not a token id.")
    return tok


def _bias(bias: Any, tok: int | str) -> float:
    what = f"token {tok}" if isinstance(tok, int) else f"{tok[:40]!r}"
    if bias is False:
        return -math.inf
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise invalid_request(f"`logit_bias` for {what} must be a number or false.")
    if abs(bias) > LOGIT_BIAS_MAX:
        raise invalid_request(f"`logit_bias` for {what} must be between -100 and 100.")
    return float(bias)


def read_stop(value: Any) -> tuple[str, ...]:
    words = [value] if isinstance(value, str) else list(value or [])
    if len(words) > STOP_WORDS_MAX:
        raise invalid_request(f"`stop` holds more than {STOP_WORDS_MAX} strings.")
    if any(len(w) > STOP_WORD_CHARS_MAX for w in words):
        raise invalid_request(f"`stop` strings are at most {STOP_WORD_CHARS_MAX} characters.")
    return tuple(w for w in words if w)


def server_sampling(state: Runtime) -> Sampling:
    """What a request that sets no sampling gets. llama-server's request defaults are its
    own command line's: here a sampling setting the person made (`--temp`, `--seed`,
    `--top-k`, `--top-p`, in any layer) and llama-server's defaults for the rest."""
    values, made = state.config.values, set(state.config.user_keys)
    base = Sampling()
    return replace(
        base,
        temperature=float(values["temp"]) if "temp" in made else base.temperature,
        seed=int(values["seed"]) if "seed" in made else base.seed,
        top_k=int(values["top-k"]) if "top-k" in made else base.top_k,
        top_p=float(values["top-p"]) if "top-p" in made else base.top_p)


def read_sampling(body: dict[str, Any], parsed: CompletionBody,
                  defaults: Sampling | None = None) -> Sampling:
    """The request's sampling, `defaults` (`server_sampling`) where it sets none (400
    naming a bad field)."""
    d = defaults or Sampling()

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value
    seed = given(parsed.seed, -1 if d.seed == SEED_RANDOM else d.seed)
    bias_ids, bias_texts = read_logit_bias(body.get("logit_bias"))
    return Sampling(
        temperature=given(parsed.temperature, d.temperature),
        top_k=given(parsed.top_k, d.top_k),
        top_p=given(parsed.top_p, d.top_p),
        min_p=given(parsed.min_p, 0.05),
        repeat_penalty=given(parsed.repeat_penalty, 1.0),
        repeat_last_n=given(parsed.repeat_last_n, 64),
        presence_penalty=given(parsed.presence_penalty, 0.0),
        frequency_penalty=given(parsed.frequency_penalty, 0.0),
        seed=SEED_RANDOM if seed == -1 else seed,
        ignore_eos=bool(parsed.ignore_eos),
        logit_bias=bias_ids, logit_bias_text=bias_texts,
        n_probs=given(parsed.n_probs, 0),
        post_sampling_probs=bool(parsed.post_sampling_probs),
        stop=read_stop(parsed.stop),
    )


def decode_completion(body: dict[str, Any], budget_field: str = "n_predict",
                      default_budget: int = -1,
                      defaults: Sampling | None = None) -> TurnRequest:
    """`POST /completion`'s body as a turn (400 naming the field otherwise). Without a
    budget the server's `n-predict` setting holds (`-n`, as llama-server's)."""
    parsed = wire.parse(CompletionBody, body)
    _refuse_unsupported(body)
    prompt = read_prompt(parsed.prompt)
    sampling = read_sampling(body, parsed, defaults)
    n_predict = getattr(parsed, budget_field)
    n_predict = default_budget if n_predict is None else n_predict
    if n_predict == 0:
        raise invalid_request(f"`{budget_field}` 0 is not supported: ask for at least one "
                              "token, or -1 for no limit but the context.")
    schema = parsed.json_schema
    if parsed.grammar and schema is not None:
        raise invalid_request("`grammar` and `json_schema` cannot be combined.")
    return TurnRequest(messages=[], max_tokens=max(0, n_predict), think=False, schema=schema,
                       grammar=parsed.grammar or None, raw_prompt=prompt, sampling=sampling,
                       cache_prompt=parsed.cache_prompt is not False,
                       progress=bool(parsed.return_progress or parsed.timings_per_token))


def decode_openai(body: dict[str, Any], default_budget: int = -1,
                  defaults: Sampling | None = None) -> TurnRequest:
    """`POST /v1/completions`: OpenAI's fields on the /completion path."""
    parsed = wire.parse(CompletionBody, body)
    if parsed.echo:
        raise invalid_request("`echo` is not supported: the answer holds the completion only.")
    if parsed.suffix:
        raise invalid_request("`suffix` is not supported.")
    if (parsed.best_of or 1) != 1:
        raise invalid_request("`best_of` above 1 is not supported.")
    if body.get("logprobs") is not None:
        raise invalid_request("`logprobs` is not supported on /v1/completions; use "
                              "`n_probs` on /completion.")
    prompt = parsed.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise invalid_request("`prompt` holds several prompts; send one prompt a request.")
    if parsed.n_predict is None and parsed.max_tokens is not None:
        return decode_completion(body, "max_tokens", default_budget, defaults)
    return decode_completion(body, "n_predict", default_budget, defaults)


# -- response -----------------------------------------------------------------------

class StopFilter:
    """Text as it may be shown: a stop string is cut off, and a tail that could still
    become one is held back until the next text says."""

    def __init__(self, words: tuple[str, ...]) -> None:
        self.words = [w for w in words if w]
        self.buf = ""
        self.done = False

    def feed(self, text: str) -> str:
        if self.done:
            return ""
        self.buf += text
        hits = [(self.buf.find(w), w) for w in self.words if w in self.buf]
        if hits:
            out = self.buf[:min(hits)[0]]
            self.buf, self.done = "", True
            return out
        keep = self._partial()
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out = "" if self.done else self.buf
        self.buf = ""
        return out

    def _partial(self) -> int:
        best = 0
        for w in self.words:
            for n in range(min(len(w) - 1, len(self.buf)), best, -1):
                if self.buf.endswith(w[:n]):
                    best = n
                    break
        return best


def stop_type(fin: Finished) -> str:
    gen = fin.generation
    if gen is not None and gen.stop_word:
        return "word"
    return {"stop": "eos", "length": "limit"}.get(fin.finish, "none")


def timings(fin: Finished) -> dict[str, Any]:
    return generation_timings(fin.generation) if fin.generation is not None else {}


def _piece(text: str, raw: bytes) -> dict[str, Any]:
    return {"token": text, "bytes": list(raw)}


def token_probs(ev: Any, post_sampling: bool = False) -> dict[str, Any]:
    """One token's entry of `completion_probabilities`: llama-server's logprob form, or
    with `post_sampling_probs` its probability form (what the samplers left)."""
    if post_sampling:
        top = [{"id": t, **_piece(b.decode("utf-8", "replace"), b), "prob": math.exp(lp)}
               for t, lp, b in (ev.top or []) if lp > -math.inf]
        return {"id": ev.token, **_piece(ev.text, ev.text.encode()),
                "prob": math.exp(ev.logprob) if ev.logprob is not None else 0.0,
                "top_probs": top}
    top = [{"id": t, **_piece(b.decode("utf-8", "replace"), b), "logprob": lp}
           for t, lp, b in (ev.top or [])]
    return {"id": ev.token, **_piece(ev.text, ev.text.encode()), "logprob": ev.logprob,
            "top_logprobs": top}


def _as_http(e: EngineError | HTTPError) -> HTTPError:
    return engine_error(LLAMA, e) if isinstance(e, EngineError) else e


class _TextEncoder:
    """What both encoders share: the stop filter, the tokens and their probabilities."""

    shape: Shape = "raw"
    headers: list[tuple[str, str]] = []

    def __init__(self, req: TurnRequest) -> None:
        self.req = req
        self.sampling = req.sampling or Sampling()
        self.filter = StopFilter(self.sampling.stop)
        self.model = ""
        self.text = ""
        self.probs: list[dict[str, Any]] = []

    def new_call_id(self) -> str:
        return ""

    def encode(self, ev: TurnEvent) -> bytes:
        raise NotImplementedError

    def whole(self, fin: Finished) -> dict[str, Any]:
        raise NotImplementedError

    def take(self, ev: RawTokens) -> tuple[str, list[int], list[dict[str, Any]]]:
        text = self.filter.feed("".join(t.text for t in ev.tokens))
        self.text += text
        probs = [token_probs(t, self.sampling.post_sampling_probs) for t in ev.tokens] \
            if self.sampling.n_probs else []
        self.probs += probs
        return text, [t.token for t in ev.tokens], probs

    def rest(self) -> str:
        tail = self.filter.flush()
        self.text += tail
        return tail

    def error_event(self, e: EngineError | HTTPError) -> bytes:
        return sse_event(None, llama_error_body(_as_http(e)))

    def keepalive(self, ev: TurnEvent) -> bytes | None:
        if isinstance(ev, Waiting):
            return sse_comment("waiting for a turn")
        if isinstance(ev, Ping):
            return sse_comment("ping")
        if isinstance(ev, Started):
            self.model = ev.model
            return b""
        return None


class LlamaEncoder(_TextEncoder):
    """Turn events → llama-server's /completion JSON, or its `data: {...}` chunks."""

    def __init__(self, req: TurnRequest, prompt_text: str, n_predict: int,
                 streaming: bool, return_tokens: bool, slot: int = 0) -> None:
        super().__init__(req)
        self.prompt_text = prompt_text
        self.n_predict = n_predict
        self.streaming = streaming
        self.return_tokens = return_tokens
        self.slot = slot
        self.n_out = 0
        self.show_progress = False           # `return_progress`: the prefill's chunks
        self.per_token = False               # `timings_per_token`: timings on every chunk
        self._prompt: dict[str, Any] = {}    # the prefill's timings, as it last reported
        self._decode_ms = 0.0

    def settings(self, fin: Finished | None = None) -> dict[str, Any]:
        out = {**self.sampling.settings(), "n_predict": self.n_predict,
               "stream": self.streaming, "grammar": self.req.grammar or "",
               "model": self.model}
        gen = fin.generation if fin is not None else None
        if gen is not None:                 # what the sampler added: ids, texts, ignore_eos
            out["logit_bias"] = [{"token": t, "bias": b if math.isfinite(b) else None}
                                 for t, b in gen.logit_bias]
        return out

    def encode(self, ev: TurnEvent) -> bytes:
        early = self.keepalive(ev)
        if early is not None:
            return early
        if isinstance(ev, Progress):
            self._prompt = progress_timings(ev.prefill)
            if not self.show_progress:
                return b""
            return sse_event(None, {"index": 0, "content": "", "tokens": [], "stop": False,
                                    "id_slot": self.slot, "tokens_predicted": 0,
                                    "prompt_progress": ev.body(),
                                    "timings": self._running_timings()})
        if isinstance(ev, RawTokens):       # a chunk per token, as llama-server streams
            return b"".join(self._token_chunk(RawTokens((t,))) for t in ev.tokens)
        if isinstance(ev, Finished):
            return sse_event(None, self.final(ev, self.rest(), streamed=True))
        if isinstance(ev, Failed):
            return self.error_event(ev.error)
        return b""

    def _token_chunk(self, one: RawTokens) -> bytes:
        text, ids, probs = self.take(one)
        self.n_out += len(ids)
        self._decode_ms += sum(t.wall_ms for t in one.tokens)
        body: dict[str, Any] = {"index": 0, "content": text,
                                "tokens": ids if self.return_tokens else [], "stop": False,
                                "id_slot": self.slot, "tokens_predicted": self.n_out}
        if probs:
            body["completion_probabilities"] = probs
        if self.per_token:
            body["timings"] = self._running_timings()
        return sse_event(None, body)

    def _running_timings(self) -> dict[str, Any]:
        """The timings so far: the prefill's as it last reported, the tokens decoded since."""
        n, ms = self.n_out, self._decode_ms
        return {**(self._prompt or progress_timings(None)), "predicted_n": n,
                "predicted_ms": ms, "predicted_per_token_ms": ms / n if n else 0.0,
                "predicted_per_second": n / (ms / 1e3) if ms > 0 else 0.0}

    def final(self, fin: Finished, content: str, streamed: bool) -> dict[str, Any]:
        gen = fin.generation
        tokens = list(gen.tokens) if gen is not None and self.return_tokens and not streamed \
            else []
        body: dict[str, Any] = {
            "index": 0, "content": content, "tokens": tokens, "id_slot": self.slot, "stop": True,
            "model": fin.model, "tokens_predicted": fin.n_output, "tokens_evaluated": fin.n_prompt,
            "generation_settings": self.settings(fin), "prompt": self.prompt_text,
            "has_new_line": "\n" in self.text, "truncated": False,
            "stop_type": stop_type(fin), "stopping_word": gen.stop_word if gen else "",
            "tokens_cached": gen.n_past if gen else 0, "timings": timings(fin)}
        if self.probs and not streamed:
            body["completion_probabilities"] = self.probs
        return body

    def whole(self, fin: Finished) -> dict[str, Any]:
        self.rest()
        return self.final(fin, self.text, streamed=False)


class OpenAIEncoder(_TextEncoder):
    """Turn events → OpenAI's `text_completion` JSON, or its chunks and `[DONE]`; one
    encoder per choice, the last of a stream ending it."""

    def __init__(self, req: TurnRequest, include_usage: bool, index: int = 0, n: int = 1,
                 tally: Tally | None = None, id_: str = "", created: int = 0) -> None:
        super().__init__(req)
        self.tally = tally or Tally()
        self.id = id_ or "cmpl-" + secrets.token_hex(12)
        self.created = created or int(time.time())
        self.include_usage = include_usage
        self.index = index
        self.last = index == n - 1

    def _body(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": "bmoe",
                "choices": [{"index": self.index, "logprobs": None, **choice}]}

    def encode(self, ev: TurnEvent) -> bytes:
        early = self.keepalive(ev)
        if early is not None:
            return early
        if isinstance(ev, RawTokens):
            text, _, _ = self.take(ev)
            return sse_event(None, self._body({"text": text, "finish_reason": None})) \
                if text else b""
        if isinstance(ev, Finished):
            self.model = ev.model
            self.tally.count(ev)
            out = sse_event(None, self._body({"text": self.rest(),
                                              "finish_reason": finish_reason(ev)}))
            if not self.last:
                return out
            if self.include_usage:
                body = self._body({})
                body["choices"] = []
                body["usage"] = self.tally.usage()
                out += sse_event(None, body)
            return out + sse_done()
        if isinstance(ev, Failed):
            self.tally.failed = True
            return self.error_event(ev.error) + sse_done()
        return b""

    def error_bytes(self, err: HTTPError) -> bytes:
        return self.error_event(err) + sse_done()

    def whole(self, fin: Finished) -> dict[str, Any]:
        self.rest()
        self.model = fin.model                  # (`encode` counted it when it finished)
        body = self._body({"text": self.text, "finish_reason": finish_reason(fin)})
        body["usage"] = self.tally.usage()
        body["timings"] = timings(fin)
        return body


def finish_reason(fin: Finished) -> str:
    return "length" if fin.finish == "length" else "stop"


# -- handlers -----------------------------------------------------------------------

def server_budget(state: Runtime) -> int:
    """The `n-predict` setting as llama-server's default `n_predict` (0 there: -1)."""
    value = state.config.values.get("n-predict")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else -1


async def completion(state: Runtime, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    prompts = split_prompts(body.get("prompt"))
    if len(prompts) > 1:
        return await completion_batch(state, body, prompts)
    if isinstance(body.get("prompt"), dict):
        body = {**body, "prompt": prompts[0]}
    req = decode_completion(body, default_budget=server_budget(state),
                            defaults=server_sampling(state))
    prompt = body.get("prompt")
    streaming = bool(body.get("stream"))
    encoder = LlamaEncoder(req, prompt if isinstance(prompt, str) else "",
                           req.max_tokens or -1, streaming, bool(body.get("return_tokens")),
                           read_slot(body, slot_count(state)))
    encoder.show_progress = bool(body.get("return_progress"))     # (types checked)
    encoder.per_token = bool(body.get("timings_per_token"))
    fields = read_response_fields(body)
    if fields and not streaming:
        serving.require_model(state)
        return Response.json(pick_fields(await serving.whole(state, req, encoder, True), fields))
    return await serving.serve(state, [req], [encoder], streaming=streaming, collect=True)


RESPONSE_FIELDS_MAX = 64


def read_response_fields(body: dict[str, Any]) -> list[str]:
    """llama-server's `response_fields`: the answer's fields to keep, each a path
    (`generation_settings/n_predict`)."""
    value = body.get("response_fields")
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > RESPONSE_FIELDS_MAX or \
            not all(isinstance(f, str) and 0 < len(f) <= 256 for f in value):
        raise invalid_request(f"`response_fields` must be a list of at most "
                              f"{RESPONSE_FIELDS_MAX} field paths (`a/b`).")
    return list(value)


def pick_fields(answer: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """The fields asked, each under its path as written; a path the answer has not is
    left out (as llama-server leaves it)."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = answer
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


async def completion_batch(state: Runtime, body: dict[str, Any],
                           prompts: list[Any]) -> Response:
    """Several prompts in one /completion: each answered in turn, the answers as a list
    in the prompts' order (llama-server's batch)."""
    if body.get("stream"):
        raise invalid_request("`prompt` holds several prompts: a stream answers one; send "
                              "them one a request, or without `stream`.")
    slot = read_slot(body, slot_count(state))
    turns = []
    for prompt in prompts:                  # every one is checked before any runs
        one = {**body, "prompt": prompt}
        req = decode_completion(one, default_budget=server_budget(state),
                                defaults=server_sampling(state))
        encoder = LlamaEncoder(req, prompt if isinstance(prompt, str) else "",
                               req.max_tokens or -1, False, bool(body.get("return_tokens")),
                               slot)
        turns.append((req, encoder))
    serving.require_model(state)
    answers = []
    for index, (req, encoder) in enumerate(turns):
        answer = await serving.whole(state, req, encoder, collect=True)
        answers.append({**answer, "index": index})
    return Response.json(answers)


async def openai_completion(state: Runtime, request: Request) -> Response | StreamResponse:
    body = request.json_object()
    req = decode_openai(body, server_budget(state), server_sampling(state))
    read_slot(body, slot_count(state))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # checked
    n = choices.read_n(body)
    reqs = choices.seeded(req, n, req.sampling or Sampling())
    tally = choices.Tally()
    first = OpenAIEncoder(reqs[0], include_usage, 0, n, tally)
    encoders = [first] + [OpenAIEncoder(r, include_usage, i, n, tally, first.id, first.created)
                          for i, r in enumerate(reqs[1:], 1)]
    return await serving.serve(state, reqs, encoders, streaming=bool(body.get("stream")),
                               merge=merge_choices, collect=True, failed=lambda: tally.failed)


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """n answers as one: every choice, the usage of the last (the tally's), the first's
    timings."""
    merged = dict(bodies[-1])
    merged["choices"] = [b["choices"][0] for b in bodies]
    merged["timings"] = bodies[0]["timings"]
    return merged
