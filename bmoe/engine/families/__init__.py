"""Chat-format families: which markup a model's template makes it write, and how to read it.

Theory of operation
-------------------
A family is named by its *framing* (the string `Session.tool_framing` holds). `detect`
reads the template's text, as llama.cpp's ``common/chat.cpp`` does, and names the family;
Qwen's two framings (``hermes``, ``qwen3_coder``) are still told apart by rendering a
sample call (`chatparse.detect_framing`), and stay with `chatparse.OutputParser`.

Every other family is a small sans-I/O module with ``parse(text, partial, tools,
starts_in_reasoning) -> ParseView`` over the whole output so far, and a grammar for a
forced call (`grammar_calls`). `ReparseParser` gives those the streaming interface of
`OutputParser`: each piece re-reads the whole text; in a partial read a tail that could
still grow into a marker is held back and a call's arguments show only what is settled,
so each view extends the one before and the last one is the whole parse.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..chatmarkup import HERMES, QWEN3_CODER, THINK_CLOSE, THINK_OPEN, JsonObject
from ..chatparse import OutputParser, ParseView
from . import dsml, gemma4, generic, glm, harmony, json_calls, json_lists, minimax, pythonic, seed_oss

Parse = Callable[[str, bool, "list[JsonObject] | None", bool], ParseView]

GPT_OSS = "gpt_oss"
GLM45 = "glm45"
LLAMA3 = "llama3"
MISTRAL = "mistral"
DEEPSEEK_V31 = "deepseek_v31"
DEEPSEEK_R1 = "deepseek_r1"
KIMI_K2 = "kimi_k2"
MINIMAX_M2 = "minimax_m2"
GEMMA4 = "gemma4"
DEEPSEEK_V32 = "deepseek_v32"
DEEPSEEK_V4 = "deepseek_v4"
LFM2 = "lfm2"
SEED_OSS = "seed_oss"
APERTUS = "apertus"
COMMAND_R7B = "command_r7b"
GENERIC = "generic"


@dataclass(frozen=True)
class Family:
    framing: str
    label: str                              # what /api/info and the load line say
    parse: Parse | None                     # None: chatparse.OutputParser reads it
    think: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)
    triggers: tuple[str, ...] = ()          # words that open a call (lazy grammar)


FAMILIES: dict[str, Family] = {f.framing: f for f in [
    Family(HERMES, "Hermes (Qwen3)", None, triggers=("<tool_call>",)),
    Family(QWEN3_CODER, "Qwen3-Coder XML", None, triggers=("<tool_call>",)),
    Family(GPT_OSS, "GPT-OSS Harmony", harmony.parse, ("<|channel|>analysis<|message|>", "<|end|>"),
           triggers=("<|channel|>commentary to=",)),
    Family(GLM45, "GLM-4.5", glm.parse, triggers=("<tool_call>",)),
    Family(LLAMA3, "Llama 3.x", json_calls.parse_llama3, triggers=("<|python_tag|>", '{"name"')),
    Family(MISTRAL, "Mistral", json_calls.parse_mistral, ("[THINK]", "[/THINK]"),
           triggers=("[TOOL_CALLS]",)),
    Family(DEEPSEEK_V31, "DeepSeek V3.1", json_calls.parse_deepseek_v31,
           triggers=("<｜tool▁calls▁begin｜>",)),
    Family(DEEPSEEK_R1, "DeepSeek R1", json_calls.parse_deepseek_r1,
           triggers=("<｜tool▁calls▁begin｜>",)),
    Family(KIMI_K2, "Kimi K2", json_calls.parse_kimi, triggers=("<|tool_calls_section_begin|>",)),
    Family(MINIMAX_M2, "MiniMax-M2", minimax.parse, triggers=("<minimax:tool_call>",)),
    Family(GEMMA4, "Gemma 4", gemma4.parse, (f"{gemma4.CHANNEL}{gemma4.THOUGHT}", gemma4.CHANNEL_END),
           triggers=(gemma4.CALL,)),
    Family(DEEPSEEK_V32, "DeepSeek V3.2 (DSML)", dsml.parser(v4=False),
           triggers=(dsml.block(v4=False)[0],)),
    Family(DEEPSEEK_V4, "DeepSeek V4 (DSML)", dsml.parser(v4=True), triggers=(dsml.block(v4=True)[0],)),
    Family(LFM2, "LFM2", pythonic.parse, triggers=(pythonic.SECTION,)),
    Family(SEED_OSS, "Seed-OSS", seed_oss.parse, seed_oss.THINK, triggers=(seed_oss.SECTION,)),
    Family(APERTUS, "Apertus", json_lists.parse_apertus, json_lists.APERTUS_THINK,
           triggers=(json_lists.APERTUS_CALLS,)),
    Family(COMMAND_R7B, "Command R7B", json_lists.parse_command_r7b, json_lists.R7B_THINK,
           triggers=(json_lists.R7B_CALLS,)),
    Family(GENERIC, "Generic JSON", generic.parse, triggers=('{"tool_calls"',)),
]}


def detect(template: str) -> str | None:
    """The family a template's text names (its framing), or None for Qwen's two or none.

    None means: ask `chatparse.detect_framing` (a rendered sample call), and fall back
    to ``generic`` when that finds nothing either.
    """
    if not template:
        return None
    if "<|channel|>" in template:
        return GPT_OSS
    if "<|tool_calls_section_begin|>" in template and "<|tool_call_begin|>" in template:
        return KIMI_K2
    named = _detect_newer(template)
    if named is not None:
        return named
    if "<arg_key>" in template and "<role>ASSISTANT</role>" not in template:
        return GLM45
    if "<minimax:tool_call>" in template and '<invoke name=' in template \
            and "]<]minimax[>[" not in template:
        return MINIMAX_M2
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<｜tool▁calls▁begin｜>" in template:
        return DEEPSEEK_V31 if "<｜tool▁call▁begin｜>'+ tool['function']['name']" in template \
            or "tool▁sep｜>' + tool['function']['arguments']" in template \
            else DEEPSEEK_R1 if "```json" in template else DEEPSEEK_V31
    if "<tool_call>" in template:
        return None                          # Qwen: the rendered probe decides
    if "<|start_header_id|>" in template and "<function=" not in template and (
            "<|python_tag|>" in template
                                               or '"parameters": ' in template):
        return LLAMA3
    return None


def _detect_newer(template: str) -> str | None:
    """Gemma 4, DeepSeek V3.2 / V4 (DSML), LFM2, Seed-OSS, Apertus, Command R7B: each
    by a string only its template holds (as llama.cpp's ``chat.cpp`` tells them)."""
    if "'<|tool_call>call:'" in template:
        return GEMMA4
    if "dsml_token" in template and "DSML" in template and (
            "function_calls" in template or "tool_calls" in template):
        return DEEPSEEK_V32 if "function_calls" in template else DEEPSEEK_V4
    if "<|tool_list_start|>" in template and "<|tool_list_end|>" in template:
        return LFM2
    if "List of tools: [" in template and "<|tool_list_start|>" not in template:
        return LFM2                          # LFM2.5: the list without its markers
    if "<seed:tool_call>" in template:
        return SEED_OSS
    if "<|tools_prefix|>" in template and "<|inner_prefix|>" in template:
        return APERTUS
    if "<|START_ACTION|>" in template and "<|START_RESPONSE|>" in template:
        return COMMAND_R7B
    return None


def finish_prompt(framing: str | None, prompt: str, add_generation_prompt: bool = True) -> str:
    """The rendered prompt as the family's model must continue it. Gemma 4's template
    writes no model turn after a message that ends its turn beside tool results; llama.cpp
    opens one (``<|turn>model``), so the model does not start a user turn."""
    if framing == GEMMA4 and add_generation_prompt and prompt.endswith("<turn|>\n"):
        return prompt + gemma4.TURN
    return prompt


def template_messages(framing: str | None, messages: list[JsonObject]) -> list[JsonObject]:
    """The conversation as the family's template reads it. gpt-oss reads replayed
    reasoning from ``thinking`` (and refuses it beside content on a message with calls),
    so ``reasoning_content`` is copied there, as llama.cpp does (LFM2's templates read
    ``thinking`` too)."""
    if framing not in (GPT_OSS, LFM2):
        return messages
    out = []
    for msg in messages:
        if isinstance(msg, dict) and isinstance(msg.get("reasoning_content"), str):
            msg = {**msg, "thinking": msg["reasoning_content"]}
            if msg.get("tool_calls") and framing == GPT_OSS:
                msg.pop("content", None)
        out.append(msg)
    return out


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """A request's reasoning effort as template variables: low / medium / high reach the
    template as ``reasoning_effort`` (gpt-oss writes it into its system message)."""
    return {"reasoning_effort": effort} if effort in ("low", "medium", "high") else {}


_ALNUM = string.ascii_letters + string.digits


def call_id_maker(framing: str | None, fallback: Callable[[], str]) -> Callable[[], str]:
    """New call ids as the family's template takes them back: Mistral's templates refuse
    an id that is not 9 letters and digits (llama.cpp writes such ids for it too)."""
    if framing == MISTRAL:
        return lambda: "".join(secrets.choice(_ALNUM) for _ in range(9))
    return fallback


def family(framing: str | None) -> Family | None:
    return FAMILIES.get(framing) if framing else None


def label(framing: str | None) -> str:
    fam = family(framing)
    return fam.label if fam is not None else "none"


def reasoning_markers(framing: str | None) -> tuple[str, str]:
    fam = family(framing)
    return fam.think if fam is not None else (THINK_OPEN, THINK_CLOSE)


def ends_inside_reasoning(framing: str | None, prompt_text: str) -> bool:
    """Whether the generation prompt leaves the family's reasoning span open."""
    opener, closer = reasoning_markers(framing)
    if framing == GPT_OSS:
        return False
    i = prompt_text.rfind(opener)
    return i >= 0 and prompt_text.find(closer, i) < 0


class ReparseParser:
    """`OutputParser`'s interface over a family's whole-text ``parse``."""

    def __init__(self, parse: Parse, starts_in_reasoning: bool,
                 tools: list[JsonObject] | None) -> None:
        self._parse = parse
        self._starts = starts_in_reasoning
        self._tools = tools
        self._raw = ""
        self._final: ParseView | None = None

    def feed(self, text: str) -> None:
        if self._final is not None:
            raise RuntimeError("feed() after finish()")
        self._raw += text

    def snapshot(self) -> ParseView:
        if self._final is not None:
            return self._final
        return self._parse(self._raw, True, self._tools, self._starts)

    def finish(self) -> ParseView:
        if self._final is None:
            view = self._parse(self._raw, False, self._tools, self._starts)
            if not (view.reasoning or view.content or view.tool_calls) and self._raw.strip():
                view = ParseView(content=self._raw.strip(), fallback_raw=True)
            self._final = view
        return self._final


def output_parser(framing: str | None, starts_in_reasoning: bool = False,
                  tools: list[JsonObject] | None = None, model_family: str | None = None) -> Any:
    """The streaming parser for a turn: ``framing`` when tools were offered (None: no
    calls); ``model_family`` (the session's) still reads its reasoning and channels."""
    fam = family(framing)
    if fam is not None and fam.parse is not None:
        return ReparseParser(fam.parse, starts_in_reasoning, tools)
    own = family(model_family)
    if framing is None and own is not None and own.parse is not None and own.framing != GENERIC:
        return ReparseParser(_without_calls(own.parse), starts_in_reasoning, None)
    return OutputParser(framing, starts_in_reasoning, tools)


def _without_calls(parse: Parse) -> Parse:
    def read(text: str, partial: bool, tools: list[JsonObject] | None, starts: bool) -> ParseView:
        view = parse(text, partial, tools, starts)
        return ParseView(view.reasoning, view.content) if view.tool_calls else view
    return read
