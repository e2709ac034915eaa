"""Forced-call grammars in each family's own syntax: `tool_call_grammar` for every
framing (Qwen's two are `grammar.qwen_call_grammar`'s), and `tool_call_heads`, where a
lazy trigger may hand the text to it."""

from __future__ import annotations

import copy
from typing import Any

from .. import grammar as g
from ..chatparse import HERMES, QWEN3_CODER
from . import (APERTUS, COMMAND_R7B, DEEPSEEK_R1, DEEPSEEK_V4, DEEPSEEK_V31, DEEPSEEK_V32, GEMMA4,
               GENERIC, GLM45, GPT_OSS, KIMI_K2, LFM2, LLAMA3, MINIMAX_M2, MISTRAL, SEED_OSS,
               reasoning_markers)
from .dsml import DSML
from .json_calls import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, PYTHON_TAG

_XML_FAMILIES = (GLM45, MINIMAX_M2, DEEPSEEK_V32, DEEPSEEK_V4, SEED_OSS)
# framing: (text before the list of calls, between two calls, after the list)
_LISTED = {
    LFM2: ("<|tool_call_start|>[", ", ", "]<|tool_call_end|>"),
    APERTUS: ("<|tools_prefix|>[", ", ", "]<|tools_suffix|>"),
    COMMAND_R7B: ("<|START_ACTION|>[", ", ", "]<|END_ACTION|>"),
}


KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_MAX_CALLS = 8   # calls one forced Kimi answer may make (each id is spelled out)


def _kimi_head(name: str, index: int) -> str:
    """Kimi's call id is functions.NAME:N, N counting the conversation's calls from 0."""
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"


def _json_family(framing: str, name: str, first_index: int = 0) -> tuple[str, str]:
    """(text before the arguments, text after) of one call."""
    if framing == GPT_OSS:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""
    if framing == KIMI_K2:
        return (KIMI_SECTION[0] + _kimi_head(name, first_index),
                "<|tool_call_end|>" + KIMI_SECTION[1])
    if framing == DEEPSEEK_V31:
        return f"{DS_CALLS}{DS_CALL}{name}{DS_SEP}", f"{DS_CALL_END}{DS_CALLS_END}"
    if framing == DEEPSEEK_R1:
        return (f"{DS_CALLS}{DS_CALL}function{DS_SEP}{name}\n```json\n",
                f"\n```{DS_CALL_END}{DS_CALLS_END}")
    if framing == MISTRAL:
        return f"[TOOL_CALLS]{name}[ARGS]", ""
    if framing == LLAMA3:
        return f'{{"name": "{name}", "parameters": ', "}"
    if framing == GENERIC:
        return f'{{"tool_calls": [{{"name": "{name}", "arguments": ', "}]}"
    if framing == APERTUS:
        return f'{{"{name}": ', "}"
    if framing == COMMAND_R7B:
        return f'{{"tool_call_id": "0", "tool_name": "{name}", "parameters": ', "}"
    raise ValueError(f"no tool-call grammar for framing {framing!r}")


def family_call_grammar(framing: str, tools: list[dict[str, Any]], *, allow_reasoning: bool,
                        starts_in_reasoning: bool = False, parallel: bool = False,
                        first_index: int = 0) -> str:
    """``first_index``: the calls the conversation holds already (Kimi numbers its ids
    over the conversation)."""
    functions = g.function_tools(tools)
    conv = g._Converter()
    if framing == KIMI_K2:
        return _kimi_grammar(conv, functions, allow_reasoning, starts_in_reasoning,
                             KIMI_MAX_CALLS if parallel else 1, first_index)
    bodies = []
    for i, (name, params) in enumerate(functions):
        with g._explained(g.tool_where(i, name)):
            params = conv.resolve_refs(copy.deepcopy(params), f"tool{i}")
            if framing in _XML_FAMILIES:
                bodies.append(_xml_call(conv, framing, f"tool{i}", name, conv.deref(params)))
                continue
            if framing in (GEMMA4, LFM2):
                bodies.append(_keyed_call(conv, framing, f"tool{i}", name, conv.deref(params)))
                continue
            before, after = _json_family(framing, name)
            args = conv.visit(params, f"tool{i}")
            bodies.append(" ".join([g.gbnf_literal(before), args]
                                   + ([g.gbnf_literal(after)] if after else [])))
    rules = conv._rules
    rules["bmoe-call"] = "( " + " | ".join(bodies) + " )"
    rules["bmoe-gap"] = g.GAP_RULE
    calls = "bmoe-call" + (" ( bmoe-gap bmoe-call )*"
                           if parallel and framing in (*_XML_FAMILIES, GEMMA4) else "")
    if framing == LLAMA3:                # the tag is optional before the JSON call
        calls = f"{g.gbnf_literal(PYTHON_TAG)}? {calls}"
    if framing in _LISTED:
        before, between, after = _LISTED[framing]
        more = f" ( {g.gbnf_literal(between)} bmoe-call )*" if parallel else ""
        calls = f"{g.gbnf_literal(before)} bmoe-call{more} {g.gbnf_literal(after)}"
    rules["root"] = f"{_prefix(framing, rules, allow_reasoning, starts_in_reasoning)}{calls}"
    return g._format(conv, "tools")


def _kimi_grammar(conv: Any, functions: list[tuple[str, Any]], allow_reasoning: bool,
                  starts_in_reasoning: bool, n_calls: int, first: int) -> str:
    """One section of up to ``n_calls`` calls, the k-th with the id functions.NAME:first+k
    (as the model numbers them, so the ids stay unique over the conversation)."""
    args = []
    for i, (name, params) in enumerate(functions):
        with g._explained(g.tool_where(i, name)):
            params = conv.resolve_refs(copy.deepcopy(params), f"tool{i}")
            args.append((name, conv.visit(params, f"tool{i}")))
    rules = conv._rules
    chain = ""
    for k in reversed(range(n_calls)):
        rule = f"bmoe-call-{k}"
        rules[rule] = "( " + " | ".join(
            f'{g.gbnf_literal(_kimi_head(name, first + k))} {a} '
            f'{g.gbnf_literal("<|tool_call_end|>")}' for name, a in args) + " )"
        chain = f"{rule}" + (f" ( {chain} )?" if chain else "")
    calls = f"{g.gbnf_literal(KIMI_SECTION[0])} {chain} {g.gbnf_literal(KIMI_SECTION[1])}"
    rules["bmoe-gap"] = g.GAP_RULE          # the reasoning prefix's rules use it
    rules["root"] = f"{_prefix(KIMI_K2, rules, allow_reasoning, starts_in_reasoning)}{calls}"
    return g._format(conv, "tools")


def tool_call_grammar(framing: str, tools: list[dict[str, Any]], *, allow_reasoning: bool,
                      starts_in_reasoning: bool = False, parallel: bool = False,
                      first_index: int = 0) -> str:
    """The output of a turn that must call a tool, in the template's framing.

    ``starts_in_reasoning``: the prompt left the reasoning span open, so the output
    begins inside it and must close it (at once, when reasoning is not allowed).
    ``parallel``: several calls may follow each other (else exactly one, as llama.cpp's
    server does unless ``parallel_tool_calls`` is set). ``first_index``: the calls the
    conversation holds already, for the families that number their call ids over the
    conversation (Kimi K2).
    """
    if framing in (HERMES, QWEN3_CODER):
        return g.qwen_call_grammar(framing, tools, allow_reasoning=allow_reasoning,
                                   starts_in_reasoning=starts_in_reasoning, parallel=parallel)
    return family_call_grammar(framing, tools, allow_reasoning=allow_reasoning,
                               starts_in_reasoning=starts_in_reasoning, parallel=parallel,
                               first_index=first_index)


def tool_call_heads(framing: str, tools: list[dict[str, Any]], first_index: int = 0
                    ) -> list[str]:
    """The literal beginning of each call `tool_call_grammar` (no reasoning) holds, up to
    the arguments (`triggers`: the text a lazy grammar may be handed at its trigger)."""
    if framing in (HERMES, QWEN3_CODER):
        return g.qwen_call_heads(framing, tools)
    return call_heads(framing, tools, first_index)


def call_heads(framing: str, tools: list[dict[str, Any]], first_index: int = 0) -> list[str]:
    """The literal text each call of `family_call_grammar` (without reasoning) starts
    with, up to its arguments: where a lazy trigger may hand the text to the grammar."""
    heads = []
    for name, _params in g.function_tools(tools):
        if framing in _XML_FAMILIES:
            head = _XML[framing][0].format(name=name)
        elif framing == GEMMA4:
            head = f"<|tool_call>call:{name}{{"
        elif framing == LFM2:
            head = f"{name}("
        else:
            head = _json_family(framing, name, first_index)[0]
        heads.append(_LISTED[framing][0] + head if framing in _LISTED else head)
        if framing == LLAMA3:
            heads.append(PYTHON_TAG + head)
    return heads


def _prefix(framing: str, rules: dict[str, str], allow: bool, starts_inside: bool) -> str:
    if framing == GPT_OSS:
        if not allow:
            return ""
        rules.update(g.text_without("bmoe-think-text", ["<|end|>", "<|channel|>"]))
        return ('( "<|channel|>analysis<|message|>" bmoe-think-text '
                '"<|end|><|start|>assistant" )? ')
    if framing == MISTRAL:
        return ""
    opener, closer = reasoning_markers(framing)
    if opener == g.THINK_OPEN:
        return g._reasoning_prefix(rules, allow, starts_inside)
    return _think_prefix(rules, opener, closer, allow, starts_inside)


def _think_prefix(rules: dict[str, str], opener: str, closer: str, allow: bool,
                  starts_inside: bool) -> str:
    """`grammar._reasoning_prefix` with the family's own reasoning markers."""
    close = f"{g.gbnf_literal(closer)} bmoe-gap "
    if starts_inside and not allow:
        return close
    if not allow:
        return ""
    rules.update(g.text_without("bmoe-think-text", [closer]))
    if starts_inside:
        return "bmoe-think-text " + close
    return f"( {g.gbnf_literal(opener)} bmoe-think-text {close})? "


_XML = {  # framing: (call open, parameter open, parameter close, call close)
    GLM45: ("<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n",
            "</tool_call>"),
    MINIMAX_M2: ('<minimax:tool_call>\n<invoke name="{name}">\n', '<parameter name="{key}">',
                 "</parameter>\n", "</invoke>\n</minimax:tool_call>"),
    DEEPSEEK_V32: (f'<{DSML}function_calls>\n<{DSML}invoke name="{{name}}">\n',
                   f'<{DSML}parameter name="{{key}}" string="{{string}}">', f"</{DSML}parameter>\n",
                   f"</{DSML}invoke>\n</{DSML}function_calls>"),
    DEEPSEEK_V4: (f'<{DSML}tool_calls>\n<{DSML}invoke name="{{name}}">\n',
                  f'<{DSML}parameter name="{{key}}" string="{{string}}">', f"</{DSML}parameter>\n",
                  f"</{DSML}invoke>\n</{DSML}tool_calls>"),
    SEED_OSS: ("<seed:tool_call>\n<function={name}>\n", "<parameter={key}>", "</parameter>\n",
               "</function>\n</seed:tool_call>"),
}


def _xml_call(conv: Any, framing: str, rule: str, name: str, params: dict[str, Any]) -> str:
    call_open, param_open, param_close, call_close = _XML[framing]
    properties = params.get("properties") or {}
    required = [k for k in properties if k in set(params.get("required") or [])]
    optional = [k for k in properties if k not in required]
    conv._rules.update(g.text_without("bmoe-arg-text", [param_close.strip()]))
    parts = []
    for i, key in enumerate(required + optional):
        schema = conv.deref(properties[key])
        types = g.schema_types(schema)
        enum = schema.get("enum") if types == frozenset({"string"}) else None
        text = True
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            value = "( " + " | ".join(g.gbnf_literal(v) for v in enum) + " )"
        elif not types or "string" in types:
            value = "bmoe-arg-text"            # raw text, as GLM writes a string
        else:
            value, text = conv.visit(properties[key], f"{rule}-p{i}"), False
        opening = param_open.format(key=key, string="true" if text else "false")
        conv._rules[f"bmoe-{rule}-p{i}"] = " ".join([
            g.gbnf_literal(opening), value, g.gbnf_literal(param_close)])
        parts.append(f"bmoe-{rule}-p{i}" + ("" if key in required else "?"))
    conv._rules[f"bmoe-{rule}"] = " ".join(
        [g.gbnf_literal(call_open.format(name=name)), *parts, g.gbnf_literal(call_close)])
    return f"bmoe-{rule}"


# -- keyed arguments: Gemma 4's {key:value} and LFM2's NAME(key=value) ------------------

_GEMMA_RULES = {
    "bmoe-gemma-value": "bmoe-gemma-string | bmoe-gemma-dict | bmoe-gemma-list | "
                        "bmoe-gemma-number | \"true\" | \"false\" | \"null\"",
    "bmoe-gemma-string": '"<|\\"|>" bmoe-gemma-text "<|\\"|>"',
    "bmoe-gemma-key": "[a-zA-Z_] [a-zA-Z0-9_]{0,63}",
    "bmoe-gemma-dict": '"{" ( bmoe-gemma-key ":" bmoe-gemma-value '
                       '( "," bmoe-gemma-key ":" bmoe-gemma-value )* )? "}"',
    "bmoe-gemma-list": '"[" ( bmoe-gemma-value ( "," bmoe-gemma-value )* )? "]"',
    "bmoe-gemma-number": '"-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? '
                         '( [eE] [-+]? [0-9]{1,3} )?',
    "bmoe-gemma-int": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
}


def _keyed_call(conv: Any, framing: str, rule: str, name: str, params: dict[str, Any]) -> str:
    """One call whose arguments are ``key<sep>value`` pairs joined by commas: required keys
    first, in the schema's order, then the optional ones (each may be left out)."""
    gemma = framing == GEMMA4
    if gemma:
        conv._rules.update(_GEMMA_RULES)
        conv._rules.update(g.text_without("bmoe-gemma-text", ['<|"|>']))
    properties = params.get("properties") or {}
    required = [k for k in properties if k in set(params.get("required") or [])]
    optional = [k for k in properties if k not in required]
    pairs = []
    for i, key in enumerate(required + optional):
        value = (_gemma_value(conv, properties[key]) if gemma
                 else conv.visit(properties[key], f"{rule}-p{i}"))
        conv._rules[f"bmoe-{rule}-p{i}"] = f"{g.gbnf_literal(key + (':' if gemma else '='))} {value}"
        pairs.append(f"bmoe-{rule}-p{i}")
    sep = g.gbnf_literal("," if gemma else ", ")
    head, rest = pairs[:len(required)], pairs[len(required):]
    if not head and rest:
        head, rest, wrap = rest[:1], rest[1:], True
    else:
        wrap = False
    body = f" {sep} ".join(head) + "".join(f" ( {sep} {p} )?" for p in rest)
    if wrap:
        body = f"( {body} )?"
    opening, closing = (f"<|tool_call>call:{name}{{", "}<tool_call|>") if gemma else (f"{name}(", ")")
    conv._rules[f"bmoe-{rule}"] = f"{g.gbnf_literal(opening)} {body} {g.gbnf_literal(closing)}"
    return f"bmoe-{rule}"


def _gemma_value(conv: Any, schema: Any) -> str:
    schema = conv.deref(schema) if isinstance(schema, dict) else {}
    types = g.schema_types(schema)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "( " + " | ".join(g.gbnf_literal(f'<|"|>{v}<|"|>') for v in enum) + " )"
    if types == frozenset({"string"}):
        return "bmoe-gemma-string"
    if types == frozenset({"integer"}):
        return "bmoe-gemma-int"
    if types == frozenset({"number"}):
        return "bmoe-gemma-number"
    if types == frozenset({"boolean"}):
        return '( "true" | "false" )'
    return "bmoe-gemma-value"
