"""Forced-call grammars in each family's own syntax (`grammar.tool_call_grammar` asks here
for every framing but Qwen's two)."""

from __future__ import annotations

import copy
from typing import Any

from .. import grammar as g
from . import DEEPSEEK_R1, DEEPSEEK_V31, GENERIC, GLM45, GPT_OSS, KIMI_K2, LLAMA3, MINIMAX_M2, MISTRAL
from .json_calls import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP


def _json_family(framing: str, name: str) -> tuple[str, str]:
    """(text before the arguments, text after) of one call."""
    if framing == GPT_OSS:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""
    if framing == KIMI_K2:
        return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
                "<|tool_call_argument_begin|>", "<|tool_call_end|><|tool_calls_section_end|>")
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
    raise ValueError(f"no tool-call grammar for framing {framing!r}")


def family_call_grammar(framing: str, tools: list[dict[str, Any]], *, allow_reasoning: bool,
                        starts_in_reasoning: bool = False, parallel: bool = False) -> str:
    functions = g.function_tools(tools)
    conv = g._Converter()
    bodies = []
    for i, (name, params) in enumerate(functions):
        with g._explained(g.tool_where(i, name)):
            params = conv.resolve_refs(copy.deepcopy(params), f"tool{i}")
            if framing in (GLM45, MINIMAX_M2):
                bodies.append(_xml_call(conv, framing, f"tool{i}", name, conv.deref(params)))
                continue
            before, after = _json_family(framing, name)
            args = conv.visit(params, f"tool{i}")
            bodies.append(" ".join([g.gbnf_literal(before), args]
                                   + ([g.gbnf_literal(after)] if after else [])))
    rules = conv._rules
    rules["bmoe-call"] = "( " + " | ".join(bodies) + " )"
    rules["bmoe-gap"] = g.GAP_RULE
    more = " ( bmoe-gap bmoe-call )*" if parallel and framing in (GLM45, MINIMAX_M2) else ""
    rules["root"] = f"{_prefix(framing, rules, allow_reasoning, starts_in_reasoning)}bmoe-call{more}"
    return g._format(conv, "tools")


def _prefix(framing: str, rules: dict[str, str], allow: bool, starts_inside: bool) -> str:
    if framing == GPT_OSS:
        if not allow:
            return ""
        rules.update(g.text_without("bmoe-think-text", ["<|end|>", "<|channel|>"]))
        return ('( "<|channel|>analysis<|message|>" bmoe-think-text '
                '"<|end|><|start|>assistant" )? ')
    if framing == MISTRAL:
        return ""
    return g._reasoning_prefix(rules, allow, starts_inside)


_XML = {  # framing: (call open, parameter open, parameter close, call close)
    GLM45: ("<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n",
            "</tool_call>"),
    MINIMAX_M2: ('<minimax:tool_call>\n<invoke name="{name}">\n', '<parameter name="{key}">',
                 "</parameter>\n", "</invoke>\n</minimax:tool_call>"),
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
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            value = "( " + " | ".join(g.gbnf_literal(v) for v in enum) + " )"
        elif not types or "string" in types:
            value = "bmoe-arg-text"            # raw text, as GLM writes a string
        else:
            value = conv.visit(properties[key], f"{rule}-p{i}")
        conv._rules[f"bmoe-{rule}-p{i}"] = " ".join([
            g.gbnf_literal(param_open.format(key=key)), value, g.gbnf_literal(param_close)])
        parts.append(f"bmoe-{rule}-p{i}" + ("" if key in required else "?"))
    conv._rules[f"bmoe-{rule}"] = " ".join(
        [g.gbnf_literal(call_open.format(name=name)), *parts, g.gbnf_literal(call_close)])
    return f"bmoe-{rule}"
