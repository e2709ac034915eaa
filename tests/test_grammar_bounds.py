"""No schema or grammar a client sends can crash llama.cpp (issue: a Claude Code request
killed the server).

Three layers are tested here: the converter relaxes counts a grammar cannot spell out,
the guard (`bmoe.engine.grammar_guard`) refuses what llama.cpp cannot hold, and — with
property-based fuzzing — every schema and GBNF text that gets through both is compiled
by the real llama.cpp in a child process and sampled, so a crash fails the test instead
of killing the runner. `BMOE_FUZZ_EXAMPLES` sets the number of examples (500 in CI;
`scripts/fuzz-grammars` runs a longer soak).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _grammar_child import GrammarChild
from bmoe.engine import grammar as gbnf
from bmoe.engine.families.grammar_calls import tool_call_grammar
from bmoe.engine.chatparse import HERMES, QWEN3_CODER
from bmoe.engine.grammar_guard import (
    LLAMA_REPETITION_THRESHOLD,
    MAX_ELEMENTS,
    MAX_GRAMMAR_BYTES,
    MAX_NESTING,
    MAX_RULES,
    GrammarRefused,
    check_grammar,
)

FUZZ_EXAMPLES = int(os.environ.get("BMOE_FUZZ_EXAMPLES", "500"))
T = gbnf.MAX_EXACT_COUNT
EIGHT_MIB = 8 * 1024 * 1024

# The request shapes of the issue, each once as a tool's parameters and as an answer schema.
ISSUE_SCHEMAS: dict[str, dict[str, Any]] = {
    "claude-code-workflow": {"type": "object", "properties": {
        "script": {"type": "string", "maxLength": 524288}}, "required": ["script"]},
    "string-60000": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 60000}}},
    "string-5000": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5000}}},
    "array-100000": {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 100000}}},
    "pattern-50000": {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^a{1,50000}$"}}},
    "recursive-tree": {
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
            "required": ["value"]}},
        "$ref": "#/$defs/node"},
    "recursive-children": {
        "type": "object", "properties": {"root": {"$ref": "#/$defs/tree"}},
        "$defs": {"tree": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "children": {"type": "array", "items": {"$ref": "#/$defs/tree"},
                         "maxItems": 4}}}}},
}


@pytest.fixture(scope="module")
def child(tiny_dense: Path) -> Any:
    with GrammarChild(tiny_dense) as c:
        yield c


def _tool(schema: dict[str, Any], name: str = "Workflow") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def _assert_compiles(child: GrammarChild, text: str, *, lazy: bool = False) -> None:
    triggers = [child.call_open] if lazy else None
    r = child.compile(text, triggers=triggers, steps=3)
    assert not r.crashed, f"llama.cpp crashed (exit {r.returncode}) on:\n{text[:2000]}"
    assert not r.timed_out, f"llama.cpp hung on:\n{text[:2000]}"
    assert r.built, f"llama.cpp refused a grammar the guard passed:\n{text[:2000]}"


# ---------------------------------------------------------------------------
# The issue's requests, end to end through the real grammar engine


@pytest.mark.parametrize("name", sorted(ISSUE_SCHEMAS))
def test_issue_schemas_build_and_sample(child: GrammarChild, name: str) -> None:
    schema = ISSUE_SCHEMAS[name]
    _assert_compiles(child, gbnf.json_schema_grammar(schema))
    _assert_compiles(child, gbnf.json_schema_grammar(schema, allow_reasoning=True))
    for framing in (HERMES, QWEN3_CODER):
        tools = [_tool(schema), _tool({"type": "object", "properties": {}}, "Other")]
        _assert_compiles(child, tool_call_grammar(framing, tools, allow_reasoning=True))
        lazy = tool_call_grammar(framing, tools, allow_reasoning=False, parallel=True)
        _assert_compiles(child, lazy, lazy=True)


def test_relaxing_warns_once_naming_tool_and_field(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bmoe.grammar"):
        tool_call_grammar(HERMES, [_tool({"type": "object"}, "A"),
                                        _tool(ISSUE_SCHEMAS["claude-code-workflow"])],
                               allow_reasoning=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "tools[1] (Workflow).parameters.properties.script.maxLength = 524288" in lines[0]


def test_recursive_schema_is_a_recursive_rule() -> None:
    text = gbnf.json_schema_grammar(ISSUE_SCHEMAS["recursive-tree"])
    rules = dict(line.split(" ::= ", 1) for line in text.strip().splitlines())
    node = next(name for name in rules if name.startswith("ref-input") and "node" in name)
    # The rule refers to itself (through the anyOf alternative): a recursion, not a copy.
    reachable, todo = set(), [node]
    while todo:
        for ref in re.findall(r"[A-Za-z0-9-]+", rules.get(todo.pop(), "")):
            if ref in rules and ref not in reachable:
                reachable.add(ref)
                todo.append(ref)
    assert node in reachable


# ---------------------------------------------------------------------------
# Counts around the threshold


def _nesting(text: str) -> int:
    return check_grammar(text).max_nesting


@pytest.mark.parametrize("key,base", [
    ("maxLength", {"type": "string"}),
    ("maxItems", {"type": "array", "items": {"type": "integer"}}),
])
def test_bounds_exact_up_to_the_threshold(key: str, base: dict[str, Any]) -> None:
    exact = gbnf.json_schema_grammar({**base, key: T})
    relaxed = gbnf.json_schema_grammar({**base, key: T + 1})
    assert _nesting(exact) >= T - 1          # spelled out: T nested optional groups
    assert _nesting(relaxed) < 20            # unbounded: `*` (the number rules nest 15)


def test_minimum_above_threshold_becomes_one() -> None:
    schema = gbnf.normalize_schema({"type": "string", "minLength": 70000, "maxLength": 90000})
    assert schema.get("minLength") == 1 and "maxLength" not in schema
    schema = gbnf.normalize_schema({"type": "array", "minItems": 3, "maxItems": 100000})
    assert schema["minItems"] == 3 and "maxItems" not in schema


@pytest.mark.parametrize("pattern,relaxed", [
    ("^a{1,50000}$", "^a{1,}$"),
    ("^a{60000}$", "^a+$"),
    (f"^a{{{T}}}$", f"^a{{{T}}}$"),
    (f"^a{{0,{T}}}$", f"^a{{0,{T}}}$"),
    (f"^a{{0,{T + 1}}}$", "^a{0,}$"),
    ("^(ab){2,999999}c$", "^(ab){2,}c$"),
    (r"^\{1,99999\}$", r"^\{1,99999\}$"),          # escaped braces are text
    ("^[{1,99999}]$", "^[{1,99999}]$"),            # inside a class they are text
    ("^a{x}$", "^a{x}$"),
])
def test_relax_pattern(pattern: str, relaxed: str) -> None:
    assert gbnf.relax_pattern(pattern) == relaxed


# ---------------------------------------------------------------------------
# The guard's limits


def _nested(n: int) -> str:
    return "root ::= " + "(" * n + '"a"' + ")" * n + "\n"


def test_guard_nesting_limit() -> None:
    assert check_grammar(_nested(MAX_NESTING)).max_nesting == MAX_NESTING
    with pytest.raises(GrammarRefused, match="nests groups more than"):
        check_grammar(_nested(MAX_NESTING + 1))


def test_guard_rule_limit() -> None:
    def chain(n: int) -> str:
        return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)),
                          f'r{n} ::= "a"']) + "\n"
    check_grammar(chain(MAX_RULES - 10))
    with pytest.raises(GrammarRefused, match="more than .* rules"):
        check_grammar(chain(MAX_RULES + 10))


def test_guard_element_and_repetition_limits() -> None:
    big = "x" * 4000
    with pytest.raises(GrammarRefused, match="elements"):
        check_grammar(f'root ::= "{big}"{{2000}}')
    with pytest.raises(GrammarRefused, match="at least 2,001 times"):
        check_grammar(f'root ::= "a"{{{LLAMA_REPETITION_THRESHOLD + 1}}}')
    with pytest.raises(GrammarRefused, match="repeats a group"):
        check_grammar('root ::= ("a"{0,1000}){1000}')
    assert check_grammar('root ::= "a"{1,50000}').rules == 2   # read as unbounded
    assert MAX_ELEMENTS > 0


@pytest.mark.parametrize("text,reason", [
    (123, "must be a string"),
    ("root ::= \"a\"\x00", "NUL"),
    ("root ::= \"\ud800\"", "surrogate"),
    ("r ::= \"a\"", "no 'root' rule"),
    ("root ::= x", "never defines"),
    ("root ::= <[999999]>", "vocabulary has"),
    ("root ::= \"a", "end of the grammar"),
    ("root := \"a\"", "expected ::="),
    ("root ::= [a-", "end of the grammar"),
    ("root ::= \"\\q\"", "unknown escape"),
    ("root ::= \"\\x4\"", "hex digits"),
    ("root ::= (\"a\"", "expected '\\)'"),
    ("root ::= *", "needs something before it"),
    ("root ::= \"a\"{99999999999999999999}", "too large"),
    ("root ::= \"a\"{3", "expected ',' or '}'"),
    ("root ::= \"a\"{20,5}", "maximum is below its minimum"),   # llama.cpp loops on it
    ("root ::= x \"a\"\nx ::= \"b\"? root", "left-recursive"),  # llama.cpp grows without end
    ("root ::= \"a\" )", "end of the line"),
])
def test_guard_refusals_are_sentences(text: Any, reason: str) -> None:
    with pytest.raises(GrammarRefused, match=reason) as info:
        check_grammar(text, n_vocab=1000)
    assert "Error(" not in str(info.value) and "Traceback" not in str(info.value)


@pytest.mark.parametrize("text,ok", [
    ('root ::= ("a"?){0,32}', True),
    ('root ::= ("a"?){0,33}', False),
    ('root ::= ("a"?){200}', False),            # 200 optional items in a row
    ('root ::= ("a"?)*', True),                 # unbounded: llama.cpp handles it at once
    ('root ::= x{0,64}\nx ::= "b"?', False),    # through a rule
    ('root ::= "a"{0,500}', True),              # a long chain of non-empty items is fine
    ('root ::= ("a" space){0,400}\nspace ::= " "?', True),
])
def test_guard_nullable_runs(child: GrammarChild, text: str, ok: bool) -> None:
    """A long run of items that may match nothing makes llama.cpp's parser explore every
    way to skip them (a run of 500 did not finish in 20 s): refused; short runs build."""
    if not ok:
        with pytest.raises(GrammarRefused, match="may each match nothing"):
            check_grammar(text)
        return
    check_grammar(text)
    r = child.compile(text, steps=3)
    assert r.built and r.ms < 2000, r


def test_guard_size_limit() -> None:
    with pytest.raises(GrammarRefused, match="bytes; the limit"):
        check_grammar('root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')


def test_guard_reads_llama_cpp_own_grammars(child: GrammarChild) -> None:
    """The guard must not refuse real grammars: llama.cpp's examples, and ours."""
    import llama_cpp
    shipped = Path(llama_cpp.__file__).parent / "llama_grammar.py"
    texts = re.findall(r'JSON_GBNF = r"""(.*?)"""', shipped.read_text(), re.S)
    texts += [gbnf.json_object_grammar(allow_reasoning=True)]
    for text in texts:
        check_grammar(text)
        _assert_compiles(child, text)


def test_guard_stops_what_crashes_llama_cpp(tiny_dense: Path) -> None:
    """The hazard is real: on a default 8 MiB thread stack llama.cpp dies on this grammar,
    and the guard refuses it before llama.cpp sees it."""
    text = _nested(40_000)
    with pytest.raises(GrammarRefused):
        check_grammar(text)
    with GrammarChild(tiny_dense, stack_bytes=EIGHT_MIB) as raw:
        assert raw.compile(text).crashed


# ---------------------------------------------------------------------------
# Property-based fuzzing: random schemas and GBNF through the real llama.cpp

_COUNTS = st.one_of(st.integers(0, 8), st.sampled_from([T - 1, T, T + 1, 1000, 2000, 5000,
                                                        60000, 524288]),
                    st.integers(0, 10**7))
_REFS = ["a", "b"]


@st.composite
def _patterns(draw: st.DrawFn) -> str:
    atoms = st.sampled_from(["a", "b", "[a-z]", "[^x]", ".", r"\d", r"\w", "(ab|c)", "(x)",
                             r"\{", "é", '"', "\\\\"])

    def quantifier() -> str:
        lo, hi = draw(_COUNTS), draw(_COUNTS)
        return draw(st.sampled_from(["", "*", "+", "?", f"{{{lo}}}", f"{{{lo},}}",
                                     f"{{{lo},{max(lo, hi)}}}", f"{{{hi},{lo}}}"]))
    body = "".join(draw(atoms) + quantifier() for _ in range(draw(st.integers(0, 4))))
    return draw(st.sampled_from([f"^{body}$", body, f"^({body})$"]))


def _scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(max_size=12))


def _leaves() -> st.SearchStrategy[dict[str, Any]]:
    string = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": _COUNTS, "maxLength": _COUNTS, "pattern": _patterns(),
        "format": st.sampled_from(["date", "time", "date-time", "uuid", "email", "x"])})
    return st.one_of(
        string,
        st.sampled_from([{"type": t} for t in ("integer", "number", "boolean", "null",
                                               "object", "array", "string")]),
        st.builds(lambda v: {"enum": v}, st.lists(_scalars(), min_size=1, max_size=4)),
        st.builds(lambda v: {"const": v}, _scalars()),
        st.builds(lambda r: {"$ref": f"#/$defs/{r}"}, st.sampled_from(_REFS)),
        st.just({"$ref": "#"}),
        st.just({}),
    )


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
    obj = st.builds(
        lambda props, req, extra, counts: {
            "type": "object", "properties": props,
            "required": [k for k in props if req], **extra, **counts},
        st.dictionaries(names, children, max_size=4), st.booleans(),
        st.one_of(st.just({}), st.builds(lambda c: {"additionalProperties": c},
                                         st.one_of(st.booleans(), children))),
        st.fixed_dictionaries({}, optional={"minProperties": _COUNTS,
                                            "maxProperties": _COUNTS}))
    arr = st.builds(lambda items, counts: {"type": "array", "items": items, **counts},
                    children, st.fixed_dictionaries({}, optional={"minItems": _COUNTS,
                                                                  "maxItems": _COUNTS}))
    tup = st.builds(lambda xs: {"type": "array", "prefixItems": xs},
                    st.lists(children, min_size=1, max_size=3))
    union = st.builds(lambda k, xs: {k: xs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                      st.lists(children, min_size=1, max_size=3))
    return st.one_of(obj, arr, tup, union)


_SCHEMAS = st.builds(
    lambda root, defs: {**root, "$defs": defs},
    st.recursive(_leaves(), _containers, max_leaves=12),
    st.fixed_dictionaries({r: st.recursive(_leaves(), _containers, max_leaves=6)
                           for r in _REFS}))

# CI runs the same examples every time (derandomized: a red run is reproducible and a
# green one stays green); scripts/fuzz-grammars sets BMOE_FUZZ_RANDOM=1 to explore.
_FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                 derandomize=os.environ.get("BMOE_FUZZ_RANDOM") != "1",
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])


def _as_lazy(text: str) -> str:
    """A lazy grammar as the server builds them: it opens with its trigger's text (llama.cpp
    feeds the trigger token to the grammar, and aborts the process when the grammar cannot
    take it — so a lazy grammar that does not start with its trigger is never built)."""
    body = re.sub(r"(?<![A-Za-z0-9-])root(?![A-Za-z0-9-])", "fuzz-root", text)
    return f'root ::= "<tool_call>" fuzz-root\n{body}'


def _clean_refusal(e: ValueError) -> None:
    text = str(e)
    assert text and "Traceback" not in text and not re.search(r"\w+Error\(", text), text


@_FUZZ
@given(schema=_SCHEMAS, framing=st.sampled_from([None, HERMES, QWEN3_CODER]),
       think=st.booleans())
def test_fuzz_schemas_never_crash(child: GrammarChild, schema: dict[str, Any],
                                  framing: str | None, think: bool) -> None:
    try:
        if framing is None:
            text = gbnf.json_schema_grammar(schema, allow_reasoning=think)
        else:
            params = schema if schema.get("type") == "object" else \
                {"type": "object", "properties": {"x": schema}, "$defs": schema["$defs"]}
            text = tool_call_grammar(framing, [_tool(params)], allow_reasoning=think)
    except ValueError as e:
        _clean_refusal(e)
        event("refused before llama.cpp")
        return
    r = child.compile(text, steps=2)
    event("built by llama.cpp" if r.built else "refused by llama.cpp")
    assert not r.crashed, f"llama.cpp crashed (exit {r.returncode}) on:\n{text[:3000]}"
    assert not r.timed_out, f"llama.cpp hung on:\n{text[:3000]}"


_GBNF_ATOMS = st.one_of(
    st.sampled_from(['"a"', '"\\n"', '"\\x41"', '"\\u00e9"', '[a-z]', '[^"\\\\]', '.', 'x',
                     'y', 'root', '<[5]>', '<[999999]>', '!<[7]>', '<think>', '""', '[]',
                     '"\\q"', '(', ')', '|', '*', '+', '?', '{', '}', ',', '::=', '#c\n',
                     '\n', ' ', '\t', '-', '\\', '"', '\x00', '\u00e9']),
    st.builds(lambda n: "{" + str(n) + "}", _COUNTS),
    st.builds(lambda a, b: "{" + f"{a},{b}" + "}", _COUNTS, _COUNTS),
    st.builds(lambda n: "(" * n, st.sampled_from([1, 2, 50, 2600, 30000])),
    st.builds(lambda n: ")" * n, st.sampled_from([1, 2, 50, 2600, 30000])),
    st.builds(lambda n: '"' + "ab" * n + '"', st.integers(0, 3000)),
)


@st.composite
def _gbnf_texts(draw: st.DrawFn) -> str:
    rules = []
    for name in draw(st.lists(st.sampled_from(["root", "x", "y", "r-1"]), min_size=1,
                              max_size=4)):
        body = "".join(draw(st.lists(_GBNF_ATOMS, min_size=1, max_size=12)))
        rules.append(f"{name} ::= {body}")
    return "\n".join(rules) + draw(st.sampled_from(["", "\n"]))


_RULE_NAMES = ["root", "x", "y", "r-1", "n0"]


@st.composite
def _valid_gbnf(draw: st.DrawFn) -> str:
    """Well-formed GBNF (every rule used is defined) with big counts, deep groups and
    token references, so most examples reach llama.cpp itself."""
    terminals = st.one_of(
        st.sampled_from(['"a"', '"\\n"', '"\\x41"', '"\\u00e9"', '[a-z]', '[^"\\\\]', '.',
                         '"<tool_call>"', '<think>', '!<think>', '"é👍"', '[\\u0100-\\uFFFF]']),
        st.builds(lambda n: f"<[{n}]>", st.integers(0, 560)),
        st.builds(lambda n: '"' + "ab" * n + '"', st.integers(1, 400)),
        st.sampled_from(_RULE_NAMES))

    def quantified(item: str) -> str:
        kind = draw(st.integers(0, 9))
        if kind < 6:                       # mostly the plain operators
            return item + ["", "", "*", "+", "?", ""][kind]
        lo = draw(st.integers(0, 6) if kind < 9 else
                  st.sampled_from([0, 1, 499, 500, 2000, 2001, 60000]))
        hi = draw(st.integers(lo, lo + 6) if kind < 9 else st.sampled_from([500, 2000, 50000]))
        return item + draw(st.sampled_from([f"{{{lo}}}", f"{{{lo},}}", f"{{{lo},{hi}}}"]))

    def sequence(depth: int) -> str:
        items = []
        for _ in range(draw(st.integers(1, 3))):
            if depth < 2 and draw(st.integers(0, 3)) == 0:
                alts = " | ".join(sequence(depth + 1) for _ in range(draw(st.integers(1, 3))))
                items.append(quantified(f"( {alts} )"))
            else:
                items.append(quantified(draw(terminals)))
        return " ".join(items)

    nest = draw(st.sampled_from([0] * 12 + [10, 500, 2500, 2501, 20000]))
    rules = {name: sequence(0) for name in _RULE_NAMES}
    rules["root"] = "(" * nest + rules["root"] + ")" * nest
    return "\n".join(f"{name} ::= {body}" for name, body in rules.items()) + "\n"


@_FUZZ
@given(text=_valid_gbnf(), lazy=st.booleans())
def test_fuzz_wellformed_gbnf_never_crashes(child: GrammarChild, text: str, lazy: bool) -> None:
    _guard_then_compile(child, text, lazy, steps=3)


@_FUZZ
@given(text=_gbnf_texts(), lazy=st.booleans())
def test_fuzz_gbnf_never_crashes(child: GrammarChild, text: str, lazy: bool) -> None:
    _guard_then_compile(child, text, lazy, steps=2)


def _guard_then_compile(child: GrammarChild, text: str, lazy: bool, steps: int) -> None:
    """The guard refuses `text` with a clean sentence, or llama.cpp builds and samples it
    (or refuses it) without crashing or hanging."""
    text = _as_lazy(text) if lazy else text
    try:
        check_grammar(text, n_vocab=child.n_vocab)
    except GrammarRefused as e:
        _clean_refusal(e)
        event("refused by the guard")
        return
    r = child.compile(text, triggers=[child.call_open] if lazy else None, steps=steps)
    event("built by llama.cpp" if r.built else "refused by llama.cpp")
    assert not r.crashed, f"llama.cpp crashed (exit {r.returncode}) on:\n{text[:3000]}"
    assert not r.timed_out, f"llama.cpp hung on:\n{text[:3000]}"
