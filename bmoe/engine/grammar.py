"""GBNF grammars for llama.cpp's grammar sampler: JSON by schema, and forced tool calls.

JSON rules come from llama-cpp-python's port of llama.cpp's JSON-schema converter,
with two rules replaced by llama.cpp's own: a string character excludes raw control
characters and allows only JSON escapes (the port lets ``\\x00``-``\\x1F`` through, and
``json.loads`` refuses what a random model then writes), and whitespace between tokens
is bounded, so a model cannot spend its budget on spaces.

``tool_call_grammar`` writes the output a ``tool_choice: required`` turn must have:
an optional reasoning span, then one or more calls in the template's framing, each
naming an offered tool with arguments that match its parameters schema. The framing's
tags are single special tokens whose text is the tag, and the sampler matches token
text, so the tags are plain literals here.

Rule names of our own start with ``bmoe-``; the converter's start with ``tool<i>`` or
are its primitives, so the two never collide. Schema errors are ``ValueError`` with a
message meant for the person who sent the schema.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, SchemaConverter

from .chatparse import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNCTION_CLOSE,
    HERMES,
    PARAM_CLOSE,
    QWEN3_CODER,
    THINK_CLOSE,
    THINK_OPEN,
    schema_types,
)

# llama.cpp's json-schema-to-grammar.cpp rules (the port's differ, see above).
JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
JSON_DOT_RULE = r'[^"\\\x7F\x00-\x1F]'
SPACE_RULE = r'| " " | "\n"{1,2} [ \t]{0,20}'
# Between the end of reasoning and a call, and between calls: at most a few blanks.
GAP_RULE = r'[ \t\n]{0,4}'

ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not")
_STRUCTURAL = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "properties",
               "items", "prefixItems", "pattern")


# ---------------------------------------------------------------------------
# Schema validation


def normalize_schema(value: object) -> dict[str, Any]:
    """The schema to constrain an answer with, or ValueError saying what is wrong.

    ``None`` and ``{}`` mean any JSON object. A schema must be a JSON object: a
    boolean schema is refused, at the root or nested (a nested ``true`` reads as "any
    value"). The schema must also be one the converter can turn into a grammar.
    """
    if value is None:
        return dict(JSON_OBJECT_SCHEMA)
    if isinstance(value, bool):
        raise ValueError("A boolean JSON schema is not supported; "
                         'send a JSON object such as {"type": "object"}.')
    if not isinstance(value, dict):
        raise ValueError(f"A JSON schema must be a JSON object, not {_json_kind(value)}.")
    if not value:
        return dict(JSON_OBJECT_SCHEMA)
    schema = _prepare(copy.deepcopy(value), "schema")
    _schema_grammar(schema)
    return schema


def _json_kind(value: object) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    return "an array" if isinstance(value, list) else "null"


def _prepare(schema: Any, where: str) -> dict[str, Any]:
    """Refuse nested false/non-object schemas; make untyped ones explicit."""
    if schema is True:
        return dict(ANY_VALUE)
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object schema (a boolean schema "
                         "is not supported).")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {k: _prepare(v, f"{where}.{key}.{k}") for k, v in schema[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            schema[key] = [_prepare(v, f"{where}.{key}[{i}]") for i, v in enumerate(schema[key])]
    for key in _SUBSCHEMA_ONE:
        if key in schema and not isinstance(schema[key], bool):
            schema[key] = _prepare(schema[key], f"{where}.{key}")
    if _is_untyped(schema):
        schema.update(ANY_VALUE)
    return schema


def _is_untyped(schema: dict[str, Any]) -> bool:
    if "type" in schema or any(key in schema for key in _STRUCTURAL):
        return False
    extra = schema.get("additionalProperties")
    return extra is None or extra is True


# ---------------------------------------------------------------------------
# The converter, with llama.cpp's string and space rules


class _Converter(SchemaConverter):
    """The port's converter, naming a $ref's rule after its whole address.

    The port names it after the last path segment, so two tools that both define
    ``$defs/Item`` would share one rule.
    """

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self._rules["space"] = SPACE_RULE

    def _resolve_ref(self, ref: str) -> str:
        name = INVALID_RULE_CHARS_RE.sub("-", "ref-" + ref)
        if name not in self._rules and ref not in self._refs_being_resolved:
            self._refs_being_resolved.add(ref)
            name = self.visit(self._refs[ref], name)
            self._refs_being_resolved.remove(ref)
        return name

    def deref(self, schema: dict[str, Any]) -> dict[str, Any]:
        seen = 0
        while isinstance(schema.get("$ref"), str) and schema["$ref"] in self._refs and seen < 32:
            schema, seen = self._refs[schema["$ref"]], seen + 1
        return schema


@contextmanager
def _explained() -> Iterator[None]:
    """The port reports an unsupported schema with asserts and KeyErrors."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"This JSON schema cannot be turned into a grammar: {e}") from e
    except (AssertionError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError) as e:
        raise ValueError(f"This JSON schema cannot be turned into a grammar: {e!r}") from e


def _format(conv: SchemaConverter) -> str:
    rules = conv._rules
    rules["space"] = SPACE_RULE
    if "char" in rules:
        rules["char"] = JSON_CHAR_RULE
    if "dot" in rules:
        rules["dot"] = JSON_DOT_RULE
    grammar: str = conv.format_grammar()
    return grammar + "\n"


def _schema_grammar(schema: dict[str, Any], allow_reasoning: bool = False,
                    starts_in_reasoning: bool = False) -> str:
    conv = _Converter()
    with _explained():
        schema = conv.resolve_refs(copy.deepcopy(schema), "input")
        if not (allow_reasoning or starts_in_reasoning):
            conv.visit(schema, "")
            return _format(conv)
        answer = conv.visit(schema, "answer")
    prefix = _reasoning_prefix(conv._rules, allow_reasoning, starts_in_reasoning)
    conv._rules["root"] = prefix + answer
    conv._rules["bmoe-gap"] = GAP_RULE
    return _format(conv)


def json_schema_grammar(schema: dict[str, Any], *, allow_reasoning: bool = False,
                        starts_in_reasoning: bool = False) -> str:
    """A grammar whose sentences are JSON texts matching ``schema``.

    With ``allow_reasoning`` a reasoning span may come first; with
    ``starts_in_reasoning`` the prompt left ``<think>`` open and the output must close
    it before the answer (at once, when reasoning is not allowed).
    """
    return _schema_grammar(normalize_schema(schema), allow_reasoning, starts_in_reasoning)


def json_object_grammar(*, allow_reasoning: bool = False,
                        starts_in_reasoning: bool = False) -> str:
    """``response_format: json_object``: any JSON object."""
    return json_schema_grammar(dict(JSON_OBJECT_SCHEMA), allow_reasoning=allow_reasoning,
                               starts_in_reasoning=starts_in_reasoning)


# ---------------------------------------------------------------------------
# GBNF text helpers


def gbnf_literal(text: str) -> str:
    """A GBNF string literal matching ``text`` exactly."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _class_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 \
        else f"\\U{code:08X}"


def text_without(name: str, literals: Sequence[str]) -> dict[str, str]:
    """Rules for any text that contains none of ``literals``; ``name`` is its entry.

    A matching automaton over the literals' prefixes: each state is the longest tail
    of the text so far that is a proper prefix of a literal. A character that would
    complete a literal has no transition; one that leads back to the start is folded
    into the state's negated class.
    """
    prefixes = sorted({lit[:k] for lit in literals for k in range(len(lit))},
                      key=lambda p: (len(p), p))
    names = {p: name if not p else f"{name}-{i}" for i, p in enumerate(prefixes)}
    alphabet = sorted({ch for lit in literals for ch in lit})
    rules = {}
    for prefix in prefixes:
        moves = {ch: _next_state(prefix + ch, literals, names) for ch in alphabet}
        special = [ch for ch, nxt in moves.items() if nxt != ""]
        alts = ["[^" + "".join(_class_char(ch) for ch in special) + f"] {name}"]
        alts += [f"{gbnf_literal(ch)} {names[nxt]}" for ch, nxt in moves.items() if nxt]
        rules[names[prefix]] = "( " + " | ".join(alts) + " )?"
    return rules


def _next_state(text: str, literals: Sequence[str], states: dict[str, str]) -> str | None:
    if any(text.endswith(lit) for lit in literals):
        return None
    for start in range(len(text) + 1):
        if text[start:] in states:
            return text[start:]
    return ""


# ---------------------------------------------------------------------------
# Forced tool calls


def function_tools(tools: Iterable[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, normalized parameters schema) for each function tool, in order."""
    out = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("Each tool must be a function with a name.")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = {"type": "object", "properties": {}}
        try:
            schema = normalize_schema(params)
        except ValueError as e:
            raise ValueError(f"Tool {fn['name']!r}: {e}") from e
        out.append((fn["name"], schema))
    if not out:
        raise ValueError("A required tool call needs at least one function tool.")
    return out


def tool_call_grammar(framing: str, tools: list[dict[str, Any]], *, allow_reasoning: bool,
                      starts_in_reasoning: bool = False, parallel: bool = False) -> str:
    """The output of a turn that must call a tool, in the template's framing.

    ``starts_in_reasoning``: the prompt left ``<think>`` open, so the output begins
    inside the span and must close it (at once, when reasoning is not allowed).
    ``parallel``: several calls may follow each other (else exactly one, as
    llama.cpp's server does unless ``parallel_tool_calls`` is set).
    """
    functions = function_tools(tools)
    if framing == HERMES:
        conv, bodies = _hermes_bodies(functions)
    elif framing == QWEN3_CODER:
        conv, bodies = _coder_bodies(functions)
    else:
        raise ValueError(f"no tool-call grammar for framing {framing!r}")
    rules = conv._rules
    more = " ( bmoe-gap bmoe-call )*" if parallel else ""
    rules["root"] = f"{_reasoning_prefix(rules, allow_reasoning, starts_in_reasoning)}" \
                    f"bmoe-call{more}"
    rules["bmoe-gap"] = GAP_RULE
    rules["bmoe-call"] = f'{gbnf_literal(CALL_OPEN + chr(10))} ( {" | ".join(bodies)} ) ' \
                         f'{gbnf_literal(CALL_CLOSE)}'
    return _format(conv)


def _reasoning_prefix(rules: dict[str, str], allow: bool, starts_inside: bool) -> str:
    close = f"{gbnf_literal(THINK_CLOSE)} bmoe-gap "
    if starts_inside and not allow:
        return close
    if not allow:
        return ""
    rules.update(text_without("bmoe-think-text", [THINK_CLOSE, CALL_OPEN]))
    if starts_inside:
        return "bmoe-think-text " + close
    return f"( {gbnf_literal(THINK_OPEN)} bmoe-think-text {close})? "


def _hermes_bodies(functions: list[tuple[str, dict[str, Any]]]
                   ) -> tuple[SchemaConverter, list[str]]:
    conv, bodies = _Converter(), []
    conv._rules["bmoe-call-end"] = '"\\n"?'
    for i, (name, params) in enumerate(functions):
        with _explained():
            params = conv.resolve_refs(copy.deepcopy(params), f"tool{i}")
            wrapper = {"type": "object",
                       "properties": {"name": {"const": name}, "arguments": params},
                       "required": ["name", "arguments"]}
            bodies.append(conv.visit(wrapper, f"tool{i}") + " bmoe-call-end")
    return conv, bodies


def _coder_bodies(functions: list[tuple[str, dict[str, Any]]]
                  ) -> tuple[SchemaConverter, list[str]]:
    conv, bodies = _Converter(), []
    conv._rules.update(text_without("bmoe-param-text", [PARAM_CLOSE, CALL_CLOSE]))
    for i, (name, params) in enumerate(functions):
        with _explained():
            params = conv.resolve_refs(copy.deepcopy(params), f"tool{i}")
            bodies.append(_coder_function(conv, f"tool{i}", name, conv.deref(params)))
    return conv, bodies


def _coder_function(conv: _Converter, rule: str, name: str, params: dict[str, Any]) -> str:
    properties = params.get("properties") or {}
    required = [k for k in properties if k in set(params.get("required") or [])]
    optional = [k for k in properties if k not in required]
    parts = [_coder_parameter(conv, f"{rule}-p{i}", key, properties[key])
             for i, key in enumerate(required + optional)]
    args = parts[:len(required)] + [f"{part}?" for part in parts[len(required):]]
    conv._rules[f"bmoe-{rule}"] = " ".join(
        [gbnf_literal(f"<function={name}>\n"), *args, gbnf_literal(FUNCTION_CLOSE + "\n")])
    return f"bmoe-{rule}"


def _string_enum(schema: dict[str, Any]) -> list[str]:
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return []


def _coder_parameter(conv: _Converter, rule: str, key: str, schema: dict[str, Any]) -> str:
    resolved = conv.deref(schema)
    types = schema_types(resolved)
    if types == frozenset({"string"}) and _string_enum(resolved):
        value = "( " + " | ".join(gbnf_literal(v) for v in _string_enum(resolved)) + " )"
    elif types == frozenset({"string"}) and isinstance(resolved.get("maxLength"), int):
        # A bounded value: raw text without markup, at most maxLength characters.
        value = f"[^<]{{0,{max(0, resolved['maxLength'])}}}"
    elif not types or "string" in types:
        value = "bmoe-param-text"  # raw text, as llama.cpp's grammar keeps it
    else:
        value = conv.visit(schema, rule)
    conv._rules[f"bmoe-{rule}"] = " ".join(
        [gbnf_literal(f"<parameter={key}>\n"), value, gbnf_literal("\n" + PARAM_CLOSE + "\n")])
    return f"bmoe-{rule}"
