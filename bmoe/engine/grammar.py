"""GBNF grammars for llama.cpp's grammar sampler: JSON by schema, and forced tool calls.

JSON rules come from llama-cpp-python's port of llama.cpp's JSON-schema converter,
with two rules replaced by llama.cpp's own: a string character excludes raw control
characters and allows only JSON escapes (the port lets ``\\x00``-``\\x1F`` through, and
``json.loads`` refuses what a random model then writes), and whitespace between tokens
is bounded, so a model cannot spend its budget on spaces.

``qwen_call_grammar`` writes the output a ``tool_choice: required`` turn must have in
Qwen's two framings (every family's: ``families/grammar_calls.tool_call_grammar``):
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
import logging
import re
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
from .grammar_guard import GrammarRefused, check_grammar

# llama.cpp's json-schema-to-grammar.cpp rules (the port's differ, see above).
JSON_CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
JSON_DOT_RULE = r'[^"\\\x7F\x00-\x1F]'
SPACE_RULE = r'| " " | "\n"{1,2} [ \t]{0,20}'
# Between the end of reasoning and a call, and between calls: at most a few blanks.
GAP_RULE = r'[ \t\n]{0,4}'

log = logging.getLogger("bmoe.grammar")

# The largest count a grammar spells out exactly (maxLength, maxItems, a pattern's {m,n},
# ...). The converter writes a bound n as n nested optional groups, which llama.cpp
# parses recursively; above this a bound is relaxed to unbounded (`*` / `+`), one warning
# each. Measured in bench/grammar_limits.py: at this count a grammar builds and samples in
# a few milliseconds and sits far below the depth that overflowed a thread's stack.
MAX_EXACT_COUNT = 500
_BOUND_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"),
                ("minProperties", "maxProperties"))

ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not")
# Keywords whose values are data, not subschemas: a "$ref" inside them is not a reference.
_NOT_SCHEMAS = frozenset({"const", "enum", "default", "examples", "$ref"})
_STRUCTURAL = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "properties",
               "items", "prefixItems", "pattern")


# ---------------------------------------------------------------------------
# Schema validation


def normalize_schema(value: object, where: str = "schema") -> dict[str, Any]:
    """The schema to constrain an answer with, or ValueError saying what is wrong.

    ``None`` and ``{}`` mean any JSON object. A schema must be a JSON object: a
    boolean schema is refused, at the root or nested (a nested ``true`` reads as "any
    value"). The schema must also be one the converter can turn into a grammar.
    """
    if value is None:
        return dict(JSON_OBJECT_SCHEMA)
    if isinstance(value, bool):
        raise ValueError(f"{where}: a boolean JSON schema is not supported; "
                         'send a JSON object such as {"type": "object"}.')
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a JSON schema must be a JSON object, not "
                         f"{_json_kind(value)}.")
    if not value:
        return dict(JSON_OBJECT_SCHEMA)
    schema = _prepare(copy.deepcopy(value), where)
    _schema_grammar(schema, where=where)
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
    if isinstance(schema.get("items"), list):
        # the older tuple form (draft 4 to 2019-09: what prefixItems says now)
        schema["items"] = [_prepare(v, f"{where}.items[{i}]")
                           for i, v in enumerate(schema["items"])]
    for key in _SUBSCHEMA_ONE:
        if key in schema and not isinstance(schema[key], (bool, list)):
            schema[key] = _prepare(schema[key], f"{where}.{key}")
    _relax_bounds(schema, where)
    if _is_untyped(schema):
        schema.update(ANY_VALUE)
    return schema


def _relax_bounds(schema: dict[str, Any], where: str) -> None:
    """Counts above MAX_EXACT_COUNT become unbounded (a maximum dropped, a minimum
    made 1); malformed counts are dropped (a schema validator would refuse them; a
    grammar cannot use them)."""
    for low_key, high_key in _BOUND_PAIRS:
        for key in (low_key, high_key):
            value = schema.get(key)
            if key in schema and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
                log.warning("%s.%s is not a count (%r): ignored by the grammar",
                            where, key, value)
                del schema[key]
        low, high = schema.get(low_key), schema.get(high_key)
        if high is not None and high > MAX_EXACT_COUNT:
            log.warning("%s.%s = %d is above the %d a grammar spells out: the output is "
                        "not held to it", where, high_key, high, MAX_EXACT_COUNT)
            del schema[high_key]
        if low is not None and low > MAX_EXACT_COUNT:
            log.warning("%s.%s = %d is above the %d a grammar spells out: relaxed to 1",
                        where, low_key, low, MAX_EXACT_COUNT)
            schema[low_key] = 1
        if low_key in schema and high_key in schema and schema[low_key] > schema[high_key]:
            log.warning("%s: %s is above %s: the maximum is ignored", where, low_key,
                        high_key)
            del schema[high_key]
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        relaxed = relax_pattern(pattern)
        if relaxed != pattern:
            log.warning("%s.pattern repeats more than %d times: relaxed to %r", where,
                        MAX_EXACT_COUNT, relaxed)
            schema["pattern"] = relaxed


_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


def relax_pattern(pattern: str) -> str:
    """``pattern`` with each ``{m,n}`` whose counts exceed MAX_EXACT_COUNT relaxed:
    ``{m,}`` when only the maximum is too large, ``+`` (or ``*`` for m = 0) when the
    minimum is. Escapes and character classes are left as they are."""
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            out.append(_relaxed_quantifier(int(m.group(1)), m.group(2), m.group(3)))
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _relaxed_quantifier(low: int, comma: str | None, high_text: str | None) -> str:
    high = low if comma is None else (int(high_text) if high_text else None)
    if low > MAX_EXACT_COUNT:
        return "+" if low > 0 else "*"
    if high is not None and high > MAX_EXACT_COUNT:
        return f"{{{low},}}"
    if comma is None:
        return f"{{{low}}}"
    return f"{{{low},{'' if high is None else high}}}"


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

    def resolve_refs(self, schema: dict[str, Any], url: str) -> dict[str, Any]:
        """Record every local ``$ref``'s target under its whole address.

        The port skips the siblings of a ``$ref`` (so a root ``{"$ref", "$defs"}`` leaves
        the references inside ``$defs`` unresolved) and fetches remote ones; here every
        subschema is visited, a reference may point anywhere in the document (``#`` is
        the root: a recursive schema), and only local references are accepted.
        """
        def visit(node: Any) -> None:
            if isinstance(node, list):
                for item in node:
                    visit(item)
                return
            if not isinstance(node, dict):
                return
            if "$ref" in node:
                node["$ref"] = self._record_ref(schema, node["$ref"], url)
            for key, value in node.items():
                if key not in _NOT_SCHEMAS:
                    visit(value)
        visit(schema)
        return schema

    def _record_ref(self, root: dict[str, Any], ref: Any, url: str) -> str:
        if isinstance(ref, str) and ref.startswith(url + "#"):
            return ref
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"only references within the schema (\"#/...\") are supported, "
                             f"not {str(ref)[:80]!r}")
        full = url + ref
        if full not in self._refs:
            target: Any = root
            for part in ref[1:].split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    raise ValueError(f"the reference {ref[:80]!r} points at nothing in the "
                                     "schema")
            if not isinstance(target, dict):
                raise ValueError(f"the reference {ref[:80]!r} does not point at a schema object")
            self._refs[full] = target
        return full

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
def _explained(where: str = "schema") -> Iterator[None]:
    """The port reports an unsupported schema with asserts and KeyErrors: say it plainly."""
    try:
        yield
    except GrammarRefused as e:
        raise GrammarRefused(f"{where}: {e}") from None
    except (ValueError, AssertionError) as e:
        reason = str(e).strip() or "a construct the grammar converter does not support"
        raise ValueError(f"{where} cannot be turned into a grammar: {reason}") from None
    except RecursionError:
        raise ValueError(f"{where} cannot be turned into a grammar: it nests too deeply."
                         ) from None
    except (KeyError, TypeError, AttributeError, IndexError):
        raise ValueError(f"{where} cannot be turned into a grammar: it uses a construct "
                         "the grammar converter does not support (check its $ref "
                         "targets and keyword values).") from None


def _format(conv: SchemaConverter, where: str = "the grammar") -> str:
    """The converter's rules as GBNF text, checked by the guard before llama.cpp sees it."""
    rules = conv._rules
    rules["space"] = SPACE_RULE
    if "char" in rules:
        rules["char"] = JSON_CHAR_RULE
    if "dot" in rules:
        rules["dot"] = JSON_DOT_RULE
    grammar: str = conv.format_grammar() + "\n"
    try:
        check_grammar(grammar)
    except GrammarRefused as e:
        raise GrammarRefused(f"{where}: {e}") from None
    return grammar


def _schema_grammar(schema: dict[str, Any], allow_reasoning: bool = False,
                    starts_in_reasoning: bool = False, where: str = "schema") -> str:
    conv = _Converter()
    with _explained(where):
        schema = conv.resolve_refs(copy.deepcopy(schema), "input")
        if not (allow_reasoning or starts_in_reasoning):
            conv.visit(schema, "")
            return _format(conv, where)
        answer = conv.visit(schema, "answer")
    prefix = _reasoning_prefix(conv._rules, allow_reasoning, starts_in_reasoning)
    conv._rules["root"] = prefix + answer
    conv._rules["bmoe-gap"] = GAP_RULE
    return _format(conv, where)


def json_schema_grammar(schema: dict[str, Any], *, allow_reasoning: bool = False,
                        starts_in_reasoning: bool = False, where: str = "schema") -> str:
    """A grammar whose sentences are JSON texts matching ``schema``.

    With ``allow_reasoning`` a reasoning span may come first; with
    ``starts_in_reasoning`` the prompt left ``<think>`` open and the output must close
    it before the answer (at once, when reasoning is not allowed).
    """
    return _schema_grammar(normalize_schema(schema, where), allow_reasoning,
                           starts_in_reasoning, where)


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
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("Each tool must be a function with a name.")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = {"type": "object", "properties": {}}
        out.append((fn["name"], normalize_schema(params, tool_where(i, fn["name"]))))
    if not out:
        raise ValueError("A required tool call needs at least one function tool.")
    return out


def qwen_call_grammar(framing: str, tools: list[dict[str, Any]], *, allow_reasoning: bool,
                      starts_in_reasoning: bool = False, parallel: bool = False) -> str:
    """The output of a turn that must call a tool, in Qwen's framings (hermes,
    qwen3_coder); `families/grammar_calls.tool_call_grammar` dispatches every family.

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
        raise ValueError(f"{framing!r} is not one of Qwen's framings")
    rules = conv._rules
    more = " ( bmoe-gap bmoe-call )*" if parallel else ""
    rules["root"] = f"{_reasoning_prefix(rules, allow_reasoning, starts_in_reasoning)}" \
                    f"bmoe-call{more}"
    rules["bmoe-gap"] = GAP_RULE
    rules["bmoe-call"] = f'{gbnf_literal(CALL_OPEN + chr(10))} ( {" | ".join(bodies)} ) ' \
                         f'{gbnf_literal(CALL_CLOSE)}'
    return _format(conv, "tools")


def qwen_call_heads(framing: str, tools: list[dict[str, Any]]) -> list[str]:
    """The literal beginning of each call `qwen_call_grammar` (no reasoning) holds, up to
    the arguments (`triggers`: the text a lazy grammar may be handed at its trigger)."""
    if framing == HERMES:
        return [CALL_OPEN + "\n"]
    if framing == QWEN3_CODER:
        return [f"{CALL_OPEN}\n<function={name}>\n" for name, _ in function_tools(tools)]
    raise ValueError(f"{framing!r} is not one of Qwen's framings")


def tool_where(index: int, name: str) -> str:
    """A tool's parameters as a field path people can find: ``tools[3] (Workflow).parameters``."""
    return f"tools[{index}] ({name[:64]}).parameters"


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
        with _explained(tool_where(i, name)):
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
        with _explained(tool_where(i, name)):
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
