"""GBNF builders: llama.cpp's own grammar parser compiles them, and a small matcher
written here checks which texts they accept."""

from __future__ import annotations

import ctypes
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import jsonschema
import llama_cpp
import pytest

from bmoe.engine.chatparse import OutputParser
from bmoe.engine.grammar import (
    gbnf_literal,
    json_object_grammar,
    json_schema_grammar,
    normalize_schema,
    text_without,
)
from bmoe.engine.families.grammar_calls import tool_call_grammar

# ---------------------------------------------------------------------------
# A small GBNF reader and matcher (the subset llama.cpp's parser reads that the
# builders and the converter write: literals, classes, refs, groups, * + ? {m,n}).

Node = tuple


class Gbnf:
    def __init__(self, source: str) -> None:
        self.src, self.i, self.rules = source, 0, {}
        while True:
            self._skip(newlines=True)
            if self.i >= len(self.src):
                break
            name = self._name()
            self._skip(newlines=False)
            assert self.src.startswith("::=", self.i), self.src[self.i:self.i + 40]
            self.i += 3
            self._skip(newlines=True)
            self.rules[name] = self._alternatives(nested=False)

    def _peek(self) -> str:
        return self.src[self.i] if self.i < len(self.src) else ""

    def _skip(self, newlines: bool) -> None:
        while self.i < len(self.src):
            c = self.src[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(self.src) and self.src[self.i] != "\n":
                    self.i += 1
            else:
                return

    def _name(self) -> str:
        start = self.i
        while self._peek().isalnum() or self._peek() in "-_":
            self.i += 1
        assert self.i > start, self.src[start:start + 40]
        return self.src[start:self.i]

    def _alternatives(self, nested: bool) -> Node:
        seqs = [self._sequence(nested)]
        while self._peek() == "|":
            self.i += 1
            self._skip(newlines=True)
            seqs.append(self._sequence(nested))
        return ("alt", seqs)

    def _sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            self._skip(newlines=nested)
            c = self._peek()
            if c == '"':
                self.i += 1
                item: Node = ("lit", self._chars_until('"'))
            elif c == "[":
                item = self._class()
            elif c == "(":
                self.i += 1
                self._skip(newlines=True)
                item = self._alternatives(nested=True)
                self._skip(newlines=True)
                assert self._peek() == ")"
                self.i += 1
            elif c == ".":
                self.i += 1
                item = ("any",)
            elif c and (c.isalnum() or c in "-_"):
                item = ("ref", self._name())
            else:
                return ("seq", items)
            items.append(self._postfix(item))

    def _postfix(self, item: Node) -> Node:
        while True:
            c = self._peek()
            if c in ("*", "+", "?") and c:
                self.i += 1
                item = ("rep", item, 0 if c != "+" else 1, 1 if c == "?" else None)
            elif c == "{":
                end = self.src.index("}", self.i)
                body = self.src[self.i + 1:end].replace(" ", "")
                self.i = end + 1
                lo, _, hi = body.partition(",")
                item = ("rep", item, int(lo),
                        int(lo) if "," not in body else (int(hi) if hi else None))
            else:
                return item

    def _char(self) -> str:
        c = self.src[self.i]
        self.i += 1
        if c != "\\":
            return c
        e = self.src[self.i]
        self.i += 1
        size = {"x": 2, "u": 4, "U": 8}.get(e)
        if size:
            code = int(self.src[self.i:self.i + size], 16)
            self.i += size
            return chr(code)
        return {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[",
                "]": "]"}[e]

    def _chars_until(self, end: str) -> str:
        out = []
        while self._peek() != end:
            out.append(self._char())
        self.i += 1
        return "".join(out)

    def _class(self) -> Node:
        self.i += 1
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        while self._peek() != "]":
            lo = self._char()
            hi = lo
            if self._peek() == "-" and self.src[self.i + 1] != "]":
                self.i += 1
                hi = self._char()
            ranges.append((lo, hi))
        self.i += 1
        return ("cls", negated, tuple(ranges))

    # -- matching: the set of positions where a node can end, from a start position

    def matches(self, text: str, rule: str = "root") -> bool:
        memo: dict[tuple[int, int], frozenset[int]] = {}
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20000))
        try:
            return len(text) in self._ends(("ref", rule), 0, text, memo)
        finally:
            sys.setrecursionlimit(limit)

    def _ends(self, node: Node, pos: int, text: str,
              memo: dict[tuple[int, int], frozenset[int]]) -> frozenset[int]:
        key = (id(node), pos)
        if key not in memo:
            memo[key] = frozenset(self._compute(node, pos, text, memo))
        return memo[key]

    def _compute(self, node: Node, pos: int, text: str, memo: dict) -> Iterator[int]:
        kind = node[0]
        if kind == "lit":
            if text.startswith(node[1], pos):
                yield pos + len(node[1])
        elif kind == "cls":
            if pos < len(text):
                inside = any(lo <= text[pos] <= hi for lo, hi in node[2])
                if inside != node[1]:
                    yield pos + 1
        elif kind == "any":
            if pos < len(text):
                yield pos + 1
        elif kind == "ref":
            yield from self._ends(self.rules[node[1]], pos, text, memo)
        elif kind == "alt":
            for seq in node[1]:
                yield from self._ends(seq, pos, text, memo)
        elif kind == "seq":
            positions = {pos}
            for item in node[1]:
                positions = {e for p in positions for e in self._ends(item, p, text, memo)}
            yield from positions
        else:
            yield from self._repeat(node, pos, text, memo)

    def _repeat(self, node: Node, pos: int, text: str, memo: dict) -> set[int]:
        _, item, lo, hi = node
        result = {pos} if lo == 0 else set()
        frontier, visited, count = {pos}, set[int](), 0
        while frontier and (hi is None or count < hi):
            count += 1
            nxt = {e for p in frontier for e in self._ends(item, p, text, memo)}
            if count >= lo:
                result |= nxt
                frontier = nxt - visited
                visited |= nxt
            else:
                frontier = nxt
        return result


def llama_compiles(grammar: str) -> bool:
    """Whether llama.cpp's own grammar parser takes it (no vocab is needed for that)."""
    sampler = llama_cpp.llama_sampler_init_grammar(None, grammar.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def check(grammar: str) -> Gbnf:
    assert llama_compiles(grammar), grammar
    return Gbnf(grammar)


# ---------------------------------------------------------------------------
# the matcher itself, against llama.cpp's verdicts


def test_matcher_and_llama_cpp_agree_on_a_hand_grammar() -> None:
    g = check('root ::= "a" [0-9]{2,3} ( "x" | "y" )* tail\ntail ::= [^\\x00-\\x1F"]?\n')
    assert g.matches("a12") and g.matches("a123xyx!") and not g.matches("a1")
    assert not g.matches("a12345") and not g.matches('a12"')
    assert not llama_compiles("root ::= missing\n")
    assert not llama_compiles('root ::= "unterminated\n')


# ---------------------------------------------------------------------------
# JSON by schema

CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "n": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}


def test_schema_grammar_accepts_json_that_fits() -> None:
    g = check(json_schema_grammar(CITY))
    for value in ({"city": "Paris"}, {"city": 'a "q" \\ é 🙂', "n": -3}):
        assert g.matches(json.dumps(value))
        assert g.matches(json.dumps(value, ensure_ascii=False))
        assert g.matches(json.dumps(value, indent=2))
    assert not g.matches('{"n": 1}')
    assert not g.matches('{"city": "x", "extra": 1}')
    assert not g.matches('{"city": 5}')


def test_schema_grammar_strings_refuse_raw_control_characters() -> None:
    g = check(json_schema_grammar(CITY))
    assert g.matches('{"city": "tab\\there\\u0001"}')
    for bad in ('{"city": "tab\there"}', '{"city": "nl\nx"}', '{"city": "\x00"}',
                '{"city": "\\q"}', '{"city": "\\u12"}'):
        assert not g.matches(bad), bad


def test_schema_grammar_bounds_whitespace() -> None:
    g = check(json_schema_grammar(CITY))
    assert g.matches('{\n  "city": "x"\n}')
    assert not g.matches("{" + " " * 30 + '"city": "x"}')
    assert not g.matches('{"city": "x"}' + "\n" * 5)


def test_json_object_grammar() -> None:
    g = check(json_object_grammar())
    assert g.matches('{"a": [1, 2.5e3, {"b": null, "c": true}], "d": "\\n"}')
    assert g.matches("{}")
    assert not g.matches("[1]") and not g.matches('"x"') and not g.matches('{"a": "\x01"}')


def test_scalar_and_array_roots() -> None:
    g = check(json_schema_grammar({"type": "array", "items": {"type": "number"}}))
    assert g.matches("[1, 2]") and not g.matches('{"a": 1}')
    g = check(json_schema_grammar({"type": "string", "pattern": "^a.c$"}))
    assert g.matches('"abc"') and not g.matches('"a"c"') and not g.matches('"a\x01c"')


def test_schema_with_refs_and_untyped_parts() -> None:
    schema = {"$defs": {"Item": {"type": "object", "properties": {"v": {}},
                                 "required": ["v"]}},
              "type": "object", "properties": {"items": {"type": "array",
                                                         "items": {"$ref": "#/$defs/Item"}}},
              "required": ["items"]}
    g = check(json_schema_grammar(schema))
    assert g.matches('{"items": [{"v": 1}, {"v": "s"}, {"v": [null]}]}')
    assert not g.matches('{"items": [{"w": 1}]}')


@pytest.mark.parametrize("value,expected", [
    (None, {"type": "object"}),
    ({}, {"type": "object"}),
    ({"type": "string"}, {"type": "string"}),
    ({"type": "object", "properties": {"a": True}},
     {"type": "object", "properties": {"a": {"type": ["object", "array", "string", "number",
                                                      "boolean", "null"]}}}),
])
def test_normalize_schema(value: Any, expected: dict) -> None:
    assert normalize_schema(value) == expected


@pytest.mark.parametrize("value,words", [
    (True, "boolean"),
    (False, "boolean"),
    ([{"type": "object"}], "an array"),
    ("object", "a string"),
    ({"type": "object", "properties": {"a": False}}, "schema.properties.a"),
    ({"$ref": "https://example.invalid/s.json"}, "cannot be turned into a grammar"),
    ({"type": "wibble"}, "cannot be turned into a grammar"),
])
def test_normalize_schema_refuses(value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        normalize_schema(value)


def test_normalize_schema_leaves_the_request_alone() -> None:
    value = {"type": "object", "properties": {"a": True}}
    normalize_schema(value)
    assert value == {"type": "object", "properties": {"a": True}}


# ---------------------------------------------------------------------------
# free text without some literals


def test_text_without_against_brute_force() -> None:
    literals = ["</think>", "<tool_call>", "<<a"]
    rules = text_without("t", literals)
    g = check("root ::= t\n" + "\n".join(f"{k} ::= {v}" for k, v in rules.items()) + "\n")
    rng = random.Random(7)
    alphabet = "<</>thinkool_ca x\n"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.2:
            text += rng.choice(literals)
        assert g.matches(text) == (not any(lit in text for lit in literals)), repr(text)


def test_gbnf_literal_round_trips() -> None:
    for text in ['a"b', "back\\slash", "nl\n\tand\r", "\x00\x1f\x7f", "é🙂", "[x]"]:
        g = check(f"root ::= {gbnf_literal(text)}\n")
        assert g.matches(text) and not g.matches(text + "x")


# ---------------------------------------------------------------------------
# forced tool calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "opts": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}},
        "note": {"type": ["string", "null"]},
    }, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
ODD = {"type": "function", "function": {"name": "ns.tool-1", "parameters": {
    "type": "object", "properties": {"x y": {"type": "boolean"}}, "required": ["x y"]}}}
TOOLS: list[dict[str, Any]] = [WEATHER, NOARGS, ODD]


def hermes(name: str, arguments: Any) -> str:
    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": arguments})
            + "\n</tool_call>")


def coder(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def assert_parses_to(text: str, framing: str, starts: bool, calls: list[tuple[str, Any]]) -> None:
    view = OutputParser(framing, starts, TOOLS)
    view.feed(text)
    final = view.finish()
    assert [(c.name, json.loads(c.arguments_text)) for c in final.tool_calls] == calls
    schemas = {t["function"]["name"]: t["function"].get("parameters", {})  # type: ignore[index]
               for t in TOOLS}
    for c in final.tool_calls:
        jsonschema.validate(json.loads(c.arguments_text), schemas[c.name])


def test_hermes_grammar() -> None:
    grammar = tool_call_grammar("hermes", TOOLS, allow_reasoning=True, parallel=True)
    g = check(grammar)
    for name in ("get_weather", "ping", "ns.tool-1"):
        assert f'\\"{name}\\"' in grammar
    good: list[tuple[str, list[tuple[str, Any]]]] = [
        (hermes("get_weather", {"city": "Paris"}), [("get_weather", {"city": "Paris"})]),
        ("<think>\nWeather: use <b>tools</b> </think\n</think>\n\n"
         + hermes("get_weather", {"city": "Rome", "days": 2, "opts": {"unit": "c"},
                                  "note": None})
         + "\n" + hermes("ping", {}),
         [("get_weather", {"city": "Rome", "days": 2, "opts": {"unit": "c"}, "note": None}),
          ("ping", {})]),
        (hermes("ns.tool-1", {"x y": False}), [("ns.tool-1", {"x y": False})]),
    ]
    for text, calls in good:
        assert g.matches(text), text
        assert_parses_to(text, "hermes", False, calls)
    for bad in [hermes("get_time", {}), hermes("get_weather", {}),
                hermes("get_weather", {"city": "x", "days": "2"}),
                "Sure! " + hermes("ping", {}),
                "<think>a</think>b</think>" + hermes("ping", {}),
                "<think>call <tool_call> now</think>" + hermes("ping", {}),
                hermes("ping", {}) + "\nmore text",
                hermes("ping", {}).replace("{}", '{"a": 1}'),
                ""]:
        assert not g.matches(bad), bad


def test_hermes_grammar_without_reasoning_and_from_inside_it() -> None:
    call = hermes("ping", {})
    g = check(tool_call_grammar("hermes", TOOLS, allow_reasoning=False))
    assert g.matches(call) and not g.matches("<think>x</think>" + call)
    g = check(tool_call_grammar("hermes", TOOLS, allow_reasoning=True, starts_in_reasoning=True))
    assert g.matches("I'll ping.\n</think>\n\n" + call)
    assert not g.matches(call)
    g = check(tool_call_grammar("hermes", TOOLS, allow_reasoning=False, starts_in_reasoning=True))
    assert g.matches("</think>\n\n" + call) and not g.matches("x</think>" + call)
    text = "I'll ping.\n</think>\n\n" + call
    assert_parses_to(text, "hermes", True, [("ping", {})])


def test_coder_grammar() -> None:
    grammar = tool_call_grammar("qwen3_coder", TOOLS, allow_reasoning=True, parallel=True)
    g = check(grammar)
    assert "<function=get_weather>" in grammar and "<function=ping>" in grammar
    good: list[tuple[str, list[tuple[str, Any]]]] = [
        (coder("get_weather", {"city": "New <York>\nline two"}),
         [("get_weather", {"city": "New <York>\nline two"})]),
        ("<think>\nhmm\n</think>\n\n"
         + coder("get_weather", {"city": "Oslo", "days": "3", "opts": '{"unit": "f"}',
                                 "note": "null"})
         + "\n" + coder("ping", {}),
         [("get_weather", {"city": "Oslo", "days": 3, "opts": {"unit": "f"}, "note": None}),
          ("ping", {})]),
        (coder("ns.tool-1", {"x y": "true"}), [("ns.tool-1", {"x y": True})]),
    ]
    for text, calls in good:
        assert g.matches(text), text
        assert_parses_to(text, "qwen3_coder", False, calls)
    for bad in [coder("get_time", {}), coder("get_weather", {"days": "3"}),
                coder("get_weather", {"city": "x", "days": "three"}),
                coder("get_weather", {"city": "a</parameter>b"}),
                coder("get_weather", {"city": "a</tool_call>b"}),
                coder("get_weather", {"city": "x", "opts": '{"unit": "k"}'}),
                coder("ns.tool-1", {"x y": "yes"})]:
        assert not g.matches(bad), bad


def test_tool_grammar_refusals() -> None:
    with pytest.raises(ValueError, match="at least one"):
        tool_call_grammar("hermes", [], allow_reasoning=False)
    with pytest.raises(ValueError, match="framing"):          # mistral is a family now
        tool_call_grammar("no-such-framing", TOOLS, allow_reasoning=False)
    bad = {"type": "function", "function": {"name": "b", "parameters": True}}
    with pytest.raises(ValueError, match=r"tools\[0\] \(b\)\.parameters: .*boolean"):
        tool_call_grammar("hermes", [bad], allow_reasoning=False)


def test_tools_sharing_a_definition_name_keep_their_own_rules() -> None:
    def tool(name: str, kind: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "$defs": {"Item": {"type": kind}}, "type": "object",
            "properties": {"v": {"$ref": "#/$defs/Item"}}, "required": ["v"]}}}
    tools = [tool("a", "integer"), tool("b", "string")]
    g = check(tool_call_grammar("hermes", tools, allow_reasoning=False))
    assert g.matches(hermes("a", {"v": 1})) and g.matches(hermes("b", {"v": "s"}))
    assert not g.matches(hermes("a", {"v": "s"})) and not g.matches(hermes("b", {"v": 1}))
    g = check(tool_call_grammar("qwen3_coder", tools, allow_reasoning=False))
    assert g.matches(coder("a", {"v": "1"})) and not g.matches(coder("a", {"v": "x"}))


# ---------------------------------------------------------------------------
# token by token through llama.cpp's grammar sampler, with the tags as single tokens

SPECIAL_TOKENS = ["<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-character table: the base of a byte-level BPE vocab."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def write_vocab(path: Path) -> None:
    """A vocab-only GGUF: byte tokens, one merge chain, and the chat tags as specials."""
    tokens = [*_byte_symbols(), "th", "thi", "thin", "think", *SPECIAL_TOKENS]
    types = [1] * 260 + [3, 4, 4, 4, 4]  # normal; control for the end, user-defined tags
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["t h", "th i", "thi n", "thin k"])
    writer.add_eos_token_id(260)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class VocabSampler:
    def __init__(self, path: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        assert n >= 0
        return list(buf[:n])

    def _allowed(self, sampler: Any, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
        candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
        return data[0].logit != -math.inf

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether sampling under ``grammar`` can write ``text`` and then stop."""
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        assert sampler
        try:
            for token in self.tokenize(text):
                if not self._allowed(sampler, token):
                    return False
                llama_cpp.llama_sampler_accept(sampler, token)
            return self._allowed(sampler, llama_cpp.llama_vocab_eos(self.vocab))
        finally:
            llama_cpp.llama_sampler_free(sampler)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VocabSampler]:
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    write_vocab(path)
    sampler = VocabSampler(path)
    yield sampler
    sampler.close()


def test_tags_are_single_tokens(vocab: VocabSampler) -> None:
    tags = "<think>x</think><tool_call>y</tool_call>"
    assert len(vocab.tokenize(tags)) == 6


def test_sampler_follows_the_hermes_grammar(vocab: VocabSampler) -> None:
    grammar = tool_call_grammar("hermes", TOOLS, allow_reasoning=True, parallel=True)
    text = ("<think>\nWeather <b>first</b>.\n</think>\n\n"
            + hermes("get_weather", {"city": "Zürich", "days": 2}) + "\n" + hermes("ping", {}))
    assert vocab.accepts(grammar, text)
    assert not vocab.accepts(grammar, hermes("get_time", {}))
    assert not vocab.accepts(grammar, hermes("ping", {})[:-1])  # cannot stop mid-call


def test_sampler_follows_the_coder_grammar(vocab: VocabSampler) -> None:
    grammar = tool_call_grammar("qwen3_coder", TOOLS, allow_reasoning=True,
                                starts_in_reasoning=True)
    text = "ok\n</think>\n\n" + coder("get_weather", {"city": "a <b>\nc", "days": "3"})
    assert vocab.accepts(grammar, text)
    assert not vocab.accepts(grammar, "ok\n</think>\n\n" + coder("get_weather", {"days": "3"}))


def test_sampler_follows_the_json_grammar(vocab: VocabSampler) -> None:
    grammar = json_object_grammar()
    assert vocab.accepts(grammar, '{"a": "x\\u0001", "b": [1, 2]}')
    assert not vocab.accepts(grammar, '{"a": "x\ty"}')


def test_json_answer_after_reasoning() -> None:
    answer = '{"city": "Oslo"}'
    g = check(json_schema_grammar(CITY, allow_reasoning=True))
    assert g.matches(answer) and g.matches("<think>\nNorway.\n</think>\n\n" + answer)
    assert not g.matches("<think>x</think>y</think>" + answer)
    g = check(json_schema_grammar(CITY, allow_reasoning=True, starts_in_reasoning=True))
    assert g.matches("Norway.\n</think>\n\n" + answer) and not g.matches(answer)
    g = check(json_object_grammar(starts_in_reasoning=True))
    assert g.matches("</think>\n\n{}") and not g.matches("x</think>{}")
    g = check(json_schema_grammar({"type": "string"}, allow_reasoning=True))
    assert g.matches('<think>a</think>"s"') and not g.matches("<think>a</think>{}")
    parser = OutputParser(None, True)
    parser.feed("Norway.\n</think>\n\n" + answer)
    assert json.loads(parser.finish().content) == {"city": "Oslo"}


def test_one_call_unless_parallel() -> None:
    one = check(tool_call_grammar("hermes", TOOLS, allow_reasoning=False))
    two = hermes("ping", {}) + "\n" + hermes("ping", {})
    assert one.matches(hermes("ping", {}))
    assert not one.matches(two)
    assert check(tool_call_grammar("hermes", TOOLS, allow_reasoning=False,
                                   parallel=True)).matches(two)


def test_coder_bounded_and_enum_strings() -> None:
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]},
                                         "tag": {"type": "string", "maxLength": 3}},
        "required": ["color", "tag"]}}}]
    g = check(tool_call_grammar("qwen3_coder", tools, allow_reasoning=False))
    call = ("<tool_call>\n<function=pick>\n<parameter=color>\n{c}\n</parameter>\n"
            "<parameter=tag>\n{t}\n</parameter>\n</function>\n</tool_call>")
    assert g.matches(call.format(c="red", t="ab"))
    assert not g.matches(call.format(c="green", t="ab"))
    assert not g.matches(call.format(c="blue", t="abcd"))


def _kimi(name: str, index: int, args: dict[str, Any]) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
            f"{json.dumps(args)}<|tool_call_end|>")


def test_sampler_follows_kimis_numbered_calls(vocab: VocabSampler) -> None:
    """Kimi K2 numbers its call ids over the conversation (functions.NAME:N): a forced
    answer goes on from the calls the conversation holds, one id after another."""
    begin, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    one = tool_call_grammar("kimi_k2", TOOLS, allow_reasoning=False, first_index=3)
    assert vocab.accepts(one, begin + _kimi("ping", 3, {}) + end)
    assert not vocab.accepts(one, begin + _kimi("ping", 0, {}) + end)
    assert not vocab.accepts(one, begin + _kimi("ping", 3, {}) + _kimi("ping", 4, {}) + end)
    many = tool_call_grammar("kimi_k2", TOOLS, allow_reasoning=False, parallel=True,
                             first_index=2)
    calls = [_kimi("get_weather", 2, {"city": "Rome", "days": 1}), _kimi("ping", 3, {}),
             _kimi("ping", 4, {})]
    assert vocab.accepts(many, begin + "".join(calls) + end)
    assert not vocab.accepts(many, begin + calls[0] + calls[0] + end)   # an id twice
    eight = "".join(_kimi("ping", 2 + k, {}) for k in range(8))
    assert vocab.accepts(many, begin + eight + end)
    assert not vocab.accepts(many, begin + eight + _kimi("ping", 10, {}) + end)


def test_calls_so_far_counts_the_assistants_calls() -> None:
    from bmoe.engine.turn import calls_so_far
    call = {"id": "x", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    assert calls_so_far([{"role": "user", "content": "hi"}]) == 0
    assert calls_so_far([{"role": "assistant", "content": None, "tool_calls": [call, call]},
                         {"role": "tool", "tool_call_id": "x", "content": "1"},
                         {"role": "assistant", "content": "ok", "tool_calls": None},
                         {"role": "assistant", "tool_calls": [call]}]) == 3
