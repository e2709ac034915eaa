"""An adversarial corpus against the REAL routes of a real bmoe-server (tiny MoE loaded).

Wrong JSON types in every field of every route, bodies that are not JSON objects,
invalid UTF-8, deep nesting, huge strings, and protocol abuse (bad request lines and
headers, duplicate Content-Length, chunked trickery, slow senders, clients that vanish
mid-body or mid-stream). Every request must be answered with a 4xx (or, where the value
is in fact acceptable, a 2xx) or dropped: never a 5xx, never a hang; and after each one
the server must still answer ``GET /api/info`` with its model loaded and idle.

The server runs with ``--models-only``, so a model path in the corpus can never make it
open a file, and with ``-n 4`` and a small context, so a request that turns out valid
answers in a few tokens. Routes the server does not have (404) are skipped.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _e2e_support import Conn, Reply, call, port_of
from conftest import ServerProcess, start_server

from bmoe.engine import params

CLOSE, EOF, READ_SOME = "close", "eof", "read-some"
Step = bytes | float | str
H = b"Host: {host}\r\n"
JSON = b"Content-Type: application/json\r\n"
CASE_TIMEOUT_S = 30.0


@dataclass
class Case:
    category: str                      # the route (or protocol group) it attacks
    name: str
    steps: list[Step]
    strict: bool = True                # wrong: only a 4xx (or a drop) is right
    check: Callable[[Reply], bool] | None = None   # a 2xx must also pass this
    route: tuple[str, str] | None = None           # skipped when the server lacks it


def post(path: str, body: bytes, *, method: str = "POST", extra: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\n".encode() + H + JSON + extra + b"Connection: close\r\n"
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def get(path: str, extra: bytes = b"") -> bytes:
    return f"GET {path} HTTP/1.1\r\n".encode() + H + extra + b"Connection: close\r\n\r\n"


def dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def body_case(category: str, method: str, path: str, name: str, body: Any, *, strict: bool = True,
              check: Callable[[Reply], bool] | None = None) -> Case:
    raw = body if isinstance(body, bytes) else dumps(body)
    return Case(category, name, [post(path, raw, method=method)], strict, check, (method, path))


def set_path(base: dict[str, Any], where: str, value: Any) -> dict[str, Any]:
    """A copy of ``base`` with ``value`` at ``where`` ("messages.0.content")."""
    out = copy.deepcopy(base)
    node: Any = out
    keys = where.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


def field_cases(category: str, path: str, base: dict[str, Any],
                fields: dict[str, list[Any]], lenient: dict[str, list[Any]] | None = None) -> list[Case]:
    """One request per (field, value): ``fields`` are wrong (4xx only); ``lenient`` values
    may be acceptable (anything but a 5xx)."""
    cases = []
    for strict, table in ((True, fields), (False, lenient or {})):
        for where, values in table.items():
            for value in values:
                name = f"{where}={json.dumps(value, allow_nan=True)[:40]}"
                cases.append(body_case(category, "POST", path, name, set_path(base, where, value),
                                       strict=strict))
    return cases


NOT_OBJECTS: list[bytes] = [b"[]", b'"s"', b"1", b"null", b"true", b"[{}]", b"{", b"{]", b"\xff\xfe",
                            b'{"a": "\xc3("}', b"\xef\xbb\xbf{}", b"{'a': 1}", b'{"a": NaN}',
                            b'{"a": Infinity}', b"[" * 50_000 + b"]" * 50_000, b'{"a":' * 20_000]
# Wrong in any field that takes a string, a number, a bool or an object of fields.
WRONG = [1, 1.5, True, [], {}, [1], [None], {"$ref": "#"}, -1, 10 ** 30]


def deep(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def nested_lists(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


# --- /v1/chat/completions --------------------------------------------------------------------

CHAT = "/v1/chat/completions"
CHAT_BASE: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat_cases() -> list[Case]:
    cat = "POST " + CHAT
    fields: dict[str, list[Any]] = {
        "messages": [None, 1, "hi", {}, [], [1], [None], ["hi"], [[]], [{}], True],
        "messages.0.role": [None, 1, True, [], {}, "robot", "", "USER", "x" * 200_000],
        "messages.0.content": [1, 1.5, True, {}, [1], [None], ["text"], [{}], [{"type": 1}],
                               [{"type": "text"}], [{"type": "text", "text": 1}],
                               [{"type": "text", "text": ["a"]}], [{"type": "image_url"}],
                               [{"type": "image_url", "image_url": 1}],
                               [{"type": "image_url", "image_url": {"url": 1}}],
                               [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}],
                               [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                               [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                               [{"type": "input_audio", "input_audio": {}}], [{"type": "file"}],
                               [{"type": "bogus"}], nested_lists(500), "\ud800", "a\udcff",
                               [{"type": "text", "text": "\udbff"}]],
        "tools": [1, "x", {}, True, [1], [{}], [{"type": "function"}],
                  [{"type": "function", "function": 1}], [{"type": "function", "function": {}}],
                  [{"type": "function", "function": {"name": 1}}],
                  [{"type": "function", "function": {"name": ""}}],
                  [{"type": "function", "function": {"name": "f", "description": 1}}],
                  [{"type": "function", "function": {"name": "f", "parameters": 1}}],
                  [{"type": "function", "function": {"name": "f", "parameters": True}}],
                  [{"type": "function", "function": {"name": "f", "parameters": []}}],
                  [{"type": "code_interpreter"}], [{"type": 1, "function": {"name": "f"}}]],
        "tool_choice": [1, True, [], "always", "", {}, {"type": "function"},
                        {"type": "function", "function": 1}, {"type": "function", "function": {"name": 1}},
                        {"type": "function", "function": {"name": "missing"}}, "required"],
        "max_tokens": [-1, "5", True, 1.5, [], {}, "x", -1e9, float("nan")],
        "max_completion_tokens": [-1, "5", False, 2.5, [], {}],
        "response_format": [1, "json", [], True, {"type": 1}, {"type": "xml"},
                            {"type": "json_schema", "json_schema": 1},
                            {"type": "json_schema", "json_schema": {"name": 1}},
                            {"type": "json_schema", "json_schema": {"strict": "yes"}},
                            {"type": "json_schema", "json_schema": {"description": []}},
                            {"type": "json_schema", "json_schema": {"schema": 1}},
                            {"type": "json_schema", "json_schema": {"schema": True}},
                            {"type": "json_schema", "json_schema": {"schema": []}},
                            {"type": "json_object", "schema": 1}, {"type": "json_object", "schema": "x"}],
        "json_schema": [1, "x", [], True, False],
        "stream": ["yes", 1, 0, [], {}],
        "stream_options": ["x", 1, [], True],
        "chat_template_kwargs": ["x", 1, [], True, {"enable_thinking": "yes"}, {"enable_thinking": 1},
                                 {"enable_thinking": []}],
        "think": ["yes", 1, 0, [], {}],
        "reasoning_effort": [1, [], {}, True, 0.5],
        "n": [17, "1", 0, -1, [], {}, True],
    }
    lenient: dict[str, list[Any]] = {
        "messages.0.content": [None, "", "x" * 300_000, "\u0000", "\U0001f600", "\ufffe"],
        "model": WRONG + ["x" * 100_000],
        "temperature": WRONG + ["hot"], "top_p": WRONG, "stop": WRONG, "seed": WRONG, "user": WRONG,
        "metadata": WRONG, "logprobs": WRONG, "presence_penalty": WRONG,
        "tools": [[], None, [TOOL, TOOL]],
        "tool_choice": ["none", "auto", None],
        "max_tokens": [0, None, 1.0, 10 ** 30],
        "reasoning_effort": ["none", "high", "x" * 10_000],
        "stream_options": [{"include_usage": "yes"}, {}],
        "response_format": [{"type": "text"}, {"type": "json_object"}, None],
        "chat_template_kwargs": [{}, {"other": [1]}],
    }
    cases = field_cases(cat, CHAT, CHAT_BASE, fields, lenient)
    assistant = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    convo = {"messages": [{"role": "user", "content": "hi"}, assistant,
                          {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
    cases += field_cases(cat, CHAT, convo, {
        "messages.1.tool_calls": [1, "x", {}, [1], [{}], [{"function": 1}], [{"function": {"name": 1}}],
                                  [{"function": {"name": "f", "arguments": 1}}],
                                  [{"function": {"name": "f", "arguments": []}}],
                                  [{"id": 1, "function": {"name": "f"}}]],
        "messages.1.reasoning_content": [1, [], {}, True],
        "messages.2.tool_call_id": [1, [], {}, True],
        "messages.2.role": ["function", 7],
    }, {"messages.1.tool_calls": [[], None, [{"function": {"name": "f", "arguments": "not json"}}],
                                  [{"function": {"name": "f", "arguments": {"a": 1}}}]],
        "messages.1.content": ["", "x", [{"type": "text", "text": "x"}]]})
    for name, messages in {
        "only system": [{"role": "system", "content": "a"}],
        "last is system": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    }.items():
        cases.append(body_case(cat, "POST", CHAT, name, {"messages": messages, "max_tokens": 2}))
    for name, messages in {
        "tool first": [{"role": "tool", "content": "x"}],
        "two systems": [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                        {"role": "user", "content": "c"}],
        "developer": [{"role": "developer", "content": "a"}, {"role": "user", "content": "b"}],
        "assistant first": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
        "last is assistant (a prefill)": [{"role": "user", "content": "a"},
                                          {"role": "assistant", "content": "b"}],
    }.items():
        cases.append(body_case(cat, "POST", CHAT, name, {"messages": messages, "max_tokens": 2},
                               strict=False))
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": deep(300)}}
    for name, extra in {
        "schema with a required tool": {"tools": [TOOL], "tool_choice": "required",
                                        "response_format": {"type": "json_object"}},
        "named tool not among tools": {"tools": [TOOL], "tool_choice": {"type": "function",
                                                                       "function": {"name": "g"}}},
        "nine images": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 9}]},
    }.items():
        cases.append(body_case(cat, "POST", CHAT, name, {**CHAT_BASE, **extra}))
    for name, extra in {
        "deep tool schema": {"tools": [deep_tool]},
        "deep tool schema, required": {"tools": [deep_tool], "tool_choice": "required"},
        "deep output schema": {"response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": deep(300)}}},
        "output schema at the depth cap": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": deep(31)}}},
        "tool schema at the depth cap": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": deep(31)}}], "tool_choice": "required"},
        "schema of odd types": {"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"a": {"type": 7}, "b": {"enum": 1},
                                                          "c": {"$ref": "#/nope"}}}}}},
        "huge tool name": {"tools": [{"type": "function", "function": {"name": "f" * 100_000}}]},
        "n=2 streaming": {"n": 2, "stream": True},    # n choices: answered one after another
    }.items():
        cases.append(body_case(cat, "POST", CHAT, name, {**CHAT_BASE, **extra}, strict=False))
    cases += [body_case(cat, "POST", CHAT, f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    return cases


# --- the server's own routes -------------------------------------------------------------------

def session_cases() -> list[Case]:
    cat = "POST /api/session/load"
    cases = [body_case(cat, "POST", "/api/session/load", f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    models = [1, 1.5, True, False, [], {}, ["/x"], {"path": "/x"}, -1, 10 ** 30, "\u0000", "/tmp/a\u0000b",
              "\ud800", "/etc/passwd", "../../etc/passwd", "/", ".", "..", "/" + "x" * 100_000,
              "/%2e%2e/x.gguf", "/\\..\\x.gguf", "/proc/self/environ", "/dev/zero", "../models/../.."]
    # (A name inside the models folder is a valid request: it would load, or fail to.)
    cases += [body_case(cat, "POST", "/api/session/load", f"model={json.dumps(m)[:30]}", {"model": m})
              for m in models]
    return cases


def rejected(key: str) -> Callable[[Reply], bool]:
    return lambda reply: key in reply.json().get("rejected", {})


def config_cases() -> list[Case]:
    cat = "PUT /api/config"
    path = "/api/config"

    def case(name: str, body: Any, **kw: Any) -> Case:
        raw = body if isinstance(body, bytes) else dumps(body)
        return Case(cat, name, [post(path, raw, method="PUT")], route=("PUT", path), **kw)

    cases = [case(f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    for name, body in {"values": [1, "x", [], True, [["n-predict", 4]]],
                       "reset": ["n-predict", 1, {}, True, [1], [None], [[]], {"n-predict": 1}]}.items():
        cases += [case(f"{name}={json.dumps(v)[:30]}", {name: v}) for v in body]
    for p in params.table():
        wrong: list[Any] = [[], {}, [1], {"a": 1}, "\u0000"]     # refused: a `rejected` entry
        odd: list[Any] = []                                       # a 200 either way
        if p.type in ("int", "float"):
            wrong += ["x", True, "1e999"]
            odd += [10 ** 30, -(10 ** 30)]          # refused where the table sets a bound
        elif p.type == "bool":
            wrong += ["maybe", 2, 0.5]
        elif p.type == "choice":
            wrong += ["nope", 1, True]
        else:
            wrong += [1, True, "/etc/passwd"]
        for value in wrong + odd:
            cases.append(case(f"values.{p.key}={json.dumps(value)[:30]}", {"values": {p.key: value}},
                              strict=False, check=rejected(p.key) if value in wrong else None))
    cases += [case(f"values.{k}", {"values": {k: 1}}, strict=False, check=rejected(k))
              for k in ("nope", "", "x" * 10_000, "__proto__", "\ud800")]
    cases.append(case("reset unknown", {"reset": ["nope"]}, strict=False, check=rejected("nope")))
    return cases


def small_route_cases() -> list[Case]:
    cases = []
    for path in ("/api/cancel", "/api/session/unload"):
        cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    return cases


# --- llama-server's routes (bmoe/server/protocols/completions.py, llama_compat.py) --------------------------

def llama_cases() -> list[Case]:
    """Token ids out of the vocabulary, hostile sampling values, grammars and schemas:
    every id is checked before llama.cpp sees it, so none of these may be a 5xx."""
    cases: list[Case] = []
    base: dict[str, Any] = {"prompt": "hi", "n_predict": 2}
    ids = [-1, 576, 2**31, 2**63, -(2**63)]
    fields: dict[str, list[Any]] = {
        "prompt": [None, 1, True, {}, [], [None], [1.5], [[1, 2], [-3]], [[1], 7], [[1]] * 17,
                   {"prompt_string": 1}, {"prompt_string": "x", "multimodal_data": ["a"]},
                   *[[i] for i in ids], [1, 2, 10**30]],
        "n_predict": [-2, 0, "5", True, 1.5, [], 2**31, -(2**40)],
        "temperature": ["hot", [], {}, True, 1e400, -1e400],
        "top_k": ["5", 1.5, [], 2**40], "top_p": [-0.1, 1.5, "x"], "min_p": [2, -1, []],
        "repeat_penalty": [0, -1, "x"], "repeat_last_n": [-2, 2**40, "x"],
        "seed": [-2, 2**33, "x", 1.5], "n_probs": [-1, 101, 10**9, "x", 1.5, True],
        "logit_bias": [1, "x", True, [1], [[1]], [[1, 2, 3]], {"": 1}, {"1": 101}, {"1": "x"},
                       {"1": True}, *[{str(i): 1} for i in ids], [[576, 1]], [["x" * 300, 1]]],
        "stop": [1, True, {}, [1], ["x" * 300], ["a"] * 17],
        "grammar": [1, [], "root ::= x", "root ::= " + "(" * 5000, "\x00"],
        "json_schema": [1, "x", [], True],
        "mirostat": [1, 2], "typical_p": [0.5], "samplers": [["top_k"], "x"],
        "stream": ["yes", 1], "ignore_eos": ["yes", 1], "cache_prompt": [1, "x"],
        "id_slot": [5, "x", -2, True], "post_sampling_probs": ["x"],
    }
    lenient: dict[str, list[Any]] = {
        "prompt": ["", "\u0000" * 100, "\ud800", "x" * 100_000, [0, "\ud800", 575],
                   [[1, 2], [3]], [[1], "x"], {"prompt_string": "x"}],
        "logit_bias": [{}, [], {"575": -100}, [[1, False]], None, {"x": 1}, [["1", 1]],
                       {"<|im_start|>": -100}, {"01": 1, "1": 2}, [[5, 1], [5, -1]]],
        "stop": [[""], ["\ud800"], "x"], "temperature": [0, -1, 1e30],
        "json_schema": [{}, {"type": "object"}, {"type": "string", "maxLength": 10**6},
                        {"$ref": "#"}, {"type": "array", "minItems": 10**6}],
        "grammar": ['root ::= "a"', "root ::= "],
        "ignore_eos": [True], "n_probs": [100, 0],
    }
    for path in ("/completion", "/v1/completions"):
        cases += field_cases("POST " + path, path, base, fields, lenient)
        cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b)
                  for b in NOT_OBJECTS]
    v1 = {"prompt": "hi", "max_tokens": 2}
    cases += field_cases("POST /v1/completions", "/v1/completions", v1, {
        "max_tokens": [-2, 0, "5", 2**40], "n": [0, 17, "2", True], "best_of": [2, "x"],
        "echo": [True, "x"], "suffix": ["x", 1], "logprobs": [1, True],
        "prompt": [["a", "b"], [[1], [2]]], "stream_options": [1, "x"]})
    cases += field_cases("POST /tokenize", "/tokenize", {"content": "hi"}, {
        "content": [None, 1, [], {}, True], "add_special": [1, "x"], "with_pieces": [1, "x"],
        "parse_special": [1, "x"]}, {"content": ["", "\ud800", "<|im_start|>" * 1000]})
    cases += field_cases("POST /detokenize", "/detokenize", {"tokens": [1]}, {
        "tokens": [None, 1, "x", {}, [None], ["1"], [1.5], *[[i] for i in ids], [1, 576]]},
        {"tokens": [[], [0, 575]]})
    cases += field_cases("POST /apply-template", "/apply-template",
                         {"messages": [{"role": "user", "content": "hi"}]},
                         {"messages": [None, 1, [], [{}]], "return_prompt_ids": [1, "x"]})
    cases += field_cases("POST /api/show", "/api/show", {"model": "tiny-moe.gguf"},
                         {"model": [1, [], {}, True]}, {"model": ["x", "\ud800", ""]})
    for path in ("/tokenize", "/detokenize", "/apply-template"):
        cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b)
                  for b in NOT_OBJECTS[:8]]
    return cases


# --- the agent protocols and decide (when the server has them) ----------------------------------

def messages_cases() -> list[Case]:
    path = "/v1/messages"
    base = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    fields: dict[str, list[Any]] = {
        "messages": [None, 1, "hi", {}, [1], [None], [{}]],
        "messages.0.role": [None, 1, [], "robot", "system"],
        "messages.0.content": [1, True, {}, [1], [{}], [{"type": 1}], "\ud800",
                               [{"type": "text", "text": 1}], [{"type": "image"}],
                               [{"type": "image", "source": 1}],
                               [{"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}],
                               [{"type": "tool_result", "content": 1}],
                               [{"type": "tool_use", "name": 1}], [{"type": "bogus"}]],
        "max_tokens": [-1, "5", True, 1.5, [], {}],
        "system": [1, True, {}, [1], [{"type": "text", "text": 1}]],
        "tools": [1, "x", {}, [1], [{}], [{"name": 1}], [{"name": "f", "input_schema": 1}],
                  [{"name": "f", "input_schema": True}], [{"name": "f", "description": 1}]],
        "tool_choice": [1, "x", [], {"type": 1}, {"type": "bogus"}, {"type": "tool"},
                        {"type": "tool", "name": 1}],
        "stream": ["yes", 1, []],
        "thinking": [1, "x", [], {"type": 1}, {"type": "bogus"}],
        "output_config": [1, "x", [], {"format": 1}, {"format": {"type": "xml"}},
                          {"format": {"type": "json_schema", "schema": 1}}],
    }
    lenient = {"model": WRONG, "temperature": WRONG, "stop_sequences": WRONG, "metadata": WRONG,
               "top_k": WRONG, "messages.0.content": [[{"type": "text"}], [{"type": "tool_result"}]],
               # llama-server answers an empty conversation (its suite checks it), so we do
               "messages": [[]]}
    cases = field_cases("POST " + path, path, base, fields, lenient)
    cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    cases += [body_case("POST /v1/messages/count_tokens", "POST", "/v1/messages/count_tokens",
                        f"{k}={json.dumps(v)[:30]}", set_path(base, k, v))
              for k, vs in fields.items() if k.startswith(("messages", "system", "tools"))
              for v in vs[:4]]
    cases.append(body_case("POST /v1/messages/count_tokens", "POST", "/v1/messages/count_tokens",
                           "lone surrogate", set_path(base, "messages.0.content", "\ud800")))
    return cases


def responses_cases() -> list[Case]:
    path = "/v1/responses"
    base = {"input": "hi", "max_output_tokens": 16}
    fields: dict[str, list[Any]] = {
        "input": [None, 1, True, {}, [1], [None], [{"role": 1}], [{"role": "robot", "content": "x"}], "\ud800",
                  [{"type": "message", "role": "user", "content": 1}],
                  [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 1}]}],
                  [{"type": "function_call", "name": 1}], [{"type": "function_call_output", "call_id": 1}],
                  [{"type": "bogus"}]],
        "instructions": [1, [], {}, True],
        "tools": [1, "x", {}, [1], [{"type": "function", "name": 1}],
                  [{"type": "function", "name": "f", "parameters": 1}]],
        "tool_choice": [1, [], "always", {"type": "function"}, {"type": "function", "name": 1}],
        "max_output_tokens": [-1, "5", True, 1.5, [], {}],
        "stream": ["yes", 1, []],
        "text": [1, "x", [], {"format": 1}, {"format": {"type": "xml"}},
                 {"format": {"type": "json_schema", "schema": 1}}],
        "reasoning": [1, "x", [], {"effort": 1}, {"effort": []}],
    }
    lenient = {"model": WRONG, "temperature": WRONG, "store": WRONG, "metadata": WRONG,
               "previous_response_id": WRONG, "background": WRONG, "truncation": WRONG,
               "tools": [[{}], [{"type": "web_search"}]]}    # tools of other kinds are left out
    cases = field_cases("POST " + path, path, base, fields, lenient)
    cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    return cases


def decide_cases() -> list[Case]:
    path = "/api/decide"
    base = {"prefix": "Pick one.", "suffix": " Answer with the letter.", "choices": ["A", "B"]}
    fields: dict[str, list[Any]] = {
        "prefix": [1, [], {}, True, "\ud800"],
        "suffix": [1, [], {}, True],
        "choices": [None, 1, "AB", [], {}, [1], [None], [[]], ["A", "A"], ["A", 1]],
        "reuse_prefix": ["yes", 1, [], {}],
    }
    lenient = {"prefix": ["", "x" * 100_000], "choices": [[""], ["A" * 10_000]], "extra": WRONG}
    cases = field_cases("POST " + path, path, base, fields, lenient)
    cases += [body_case("POST " + path, "POST", path, f"body {b[:12]!r}", b) for b in NOT_OBJECTS]
    return cases


# --- protocol abuse on real routes ---------------------------------------------------------------

def protocol_cases() -> list[Case]:
    cat = "protocol"
    chat = dumps({**CHAT_BASE})
    head = b"POST " + CHAT.encode() + b" HTTP/1.1\r\n" + H + JSON
    long_stream = post(CHAT, dumps({**CHAT_BASE, "max_tokens": 1_000_000, "stream": True}))
    whole = post("/api/session/load", dumps({"model": "/etc/passwd" + " " * 500}))
    steps: dict[str, tuple[list[Step], bool]] = {
        "no method": ([b" /api/info HTTP/1.1\r\n" + H + b"\r\n"], True),
        "HTTP/2 preface": ([b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"], True),
        "TLS hello": ([b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64))], True),
        "binary garbage": ([bytes(range(256)) * 4], True),
        "absolute target": ([b"GET http://evil.example/api/info HTTP/1.1\r\n" + H + b"\r\n"], False),
        "bad version": ([b"GET /api/info HTTP/3.0\r\n" + H + b"\r\n"], True),
        "NUL in target": ([b"GET /api/in\x00fo HTTP/1.1\r\n" + H + b"\r\n"], True),
        "bad percent": ([b"GET /api/%ff%fe HTTP/1.1\r\n" + H + b"\r\n"], True),
        "target too long": ([b"GET /api/info?" + b"a" * 70_000 + b" HTTP/1.1\r\n" + H + b"\r\n"], True),
        "bad header name": ([b"GET /api/info HTTP/1.1\r\n" + H + b"Bad Name: x\r\n\r\n"], True),
        "header without colon": ([b"GET /api/info HTTP/1.1\r\n" + H + b"NoColon\r\n\r\n"], True),
        "NUL in header": ([b"GET /api/info HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n"], True),
        "folded header": ([b"GET /api/info HTTP/1.1\r\n" + H + b"X-A: a\r\n folded\r\n\r\n"], False),
        "huge header": ([b"GET /api/info HTTP/1.1\r\n" + H + b"X-A: " + b"a" * 70_000 + b"\r\n\r\n"], True),
        "3000 headers": ([b"GET /api/info HTTP/1.1\r\n" + H + b"".join(b"X-%d: v\r\n" % i
                                                                      for i in range(3000)) + b"\r\n"], False),
        "9000 headers": ([b"GET /api/info HTTP/1.1\r\n" + H + b"".join(b"X-%d: v\r\n" % i
                                                                      for i in range(9000)) + b"\r\n"], True),
        "two Hosts": ([b"GET /api/info HTTP/1.1\r\n" + H + H + b"\r\n"], True),
        "CL twice, differing": ([head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"], True),
        "CL negative": ([head + b"Content-Length: -1\r\n\r\n{}"], True),
        "CL not a number": ([head + b"Content-Length: 2x\r\n\r\n{}"], True),
        "CL huge": ([head + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n{}"], True),
        "CL and TE": ([head + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"], True),
        "CL short of the body": ([head + b"Content-Length: 1\r\n\r\n" + chat], True),
        "TE gzip": ([head + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"], True),
        "TE twice": ([head + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"], True),
        "chunk size junk": ([head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"], True),
        "chunk size too big": ([head + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 30 + b"\r\n{}\r\n0\r\n\r\n"], True),
        "chunk longer than said": ([head + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{}\r\n0\r\n\r\n"], True),
        "chunked, then a pipelined request": ([head + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                                               + get("/api/nope")], True),
        "chunked, valid chat": ([head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                 + b"%x\r\n" % len(chat) + chat + b"\r\n0\r\n\r\n"], False),
        "chunked in 1-byte chunks": ([head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                      + b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in chat)
                                      + b"0\r\n\r\n"], False),
        "pipelined bad then good": ([post("/api/cancel", b"{") + get("/api/info")], True),
        "100-continue, then body": ([head + b"Expect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n",
                                     0.2, b"[]"], True),
        "slow head": ([b"GET /api/info HTTP/1.1\r\n", 0.3, H, 0.3, b"X-Slow: 1\r\n", 0.3,
                       b"Connection: close\r\n\r\n"], False),
        "slow body": ([post("/api/cancel", b"{}      ")[:-8], 0.3, b"  ", 0.3, b"  ", 0.3, b"    "], False),
        "vanish in the head": ([b"POST /api/session/load HTTP/1.1\r\n" + H, CLOSE], True),
        "vanish mid-body": ([whole[:-200], CLOSE], True),
        "half-close mid-body": ([whole[:-200], EOF], True),
        "vanish mid-chunked body": ([head + b"Transfer-Encoding: chunked\r\n\r\n400\r\n" + b" " * 100, CLOSE], True),
        "vanish mid-stream": ([long_stream, READ_SOME, CLOSE], False),
        "half-close mid-stream": ([long_stream, READ_SOME, EOF], False),
        "vanish before the answer": ([post(CHAT, dumps({**CHAT_BASE, "max_tokens": 1_000_000})), 0.2, CLOSE], False),
        "vanish from the event stream": ([get("/api/events"), READ_SOME, CLOSE], False),
        "OPTIONS preflight": ([b"OPTIONS " + CHAT.encode() + b" HTTP/1.1\r\n" + H
                               + b"Origin: https://evil.example\r\nAccess-Control-Request-Method: POST\r\n\r\n"], True),
        "PATCH config": ([post("/api/config", b"{}", method="PATCH")], True),
        "DELETE info": ([post("/api/info", b"{}", method="DELETE")], True),
        "GET a POST route": ([get(CHAT)], True),
        "form post": ([post("/api/cancel", b"a=1").replace(JSON, b"Content-Type: application/x-www-form-urlencoded\r\n")], True),
        "evil Host": ([get("/api/info").replace(H, b"Host: evil.example\r\n")], True),
        "evil Origin on a POST": ([post(CHAT, chat, extra=b"Origin: https://evil.example\r\n")], True),
        "same-site fetch": ([post("/api/session/unload", b"{}", extra=b"Sec-Fetch-Site: same-site\r\n")], True),
    }
    return [Case(cat, name, s, strict) for name, (s, strict) in steps.items()]


def corpus() -> list[Case]:
    return (chat_cases() + protocol_cases() + session_cases() + messages_cases() + responses_cases()
            + decide_cases() + config_cases() + small_route_cases() + llama_cases())


# --- running it -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("corpus"), "-m", str(tiny_moe), "-c", "512",
                          "-n", "4", "--models-only")
    try:
        assert server.info()["state"] == "ready"
        yield server
    finally:
        server.stop()


def play(port: int, case: Case) -> tuple[str, Reply | None]:
    """Run one case: its outcome (a status, "dropped", "vanished" or "hung") and reply."""
    conn = Conn(port, timeout=CASE_TIMEOUT_S)
    try:
        for step in case.steps:
            if isinstance(step, bytes):
                try:
                    conn.send(step.replace(b"{host}", b"127.0.0.1:%d" % port))
                except (BrokenPipeError, ConnectionResetError):
                    break                       # the server stopped taking bytes: read its answer
            elif isinstance(step, float):
                time.sleep(step)
            elif step == READ_SOME:
                conn.read_until(b"\r\n\r\n")
            elif step == EOF:
                conn.sock.shutdown(1)
            elif step == CLOSE:
                return "vanished", None
        reply = conn.read_reply()
    except TimeoutError:
        return "hung", None
    except (EOFError, ConnectionResetError):
        return "dropped", None
    finally:
        conn.close()
    return str(reply.status), reply


def healthy(port: int) -> str | None:
    """None when the server answers /api/info with its model ready and no turn left running."""
    deadline = time.monotonic() + 15
    while True:
        reply = call(port, "GET", "/api/info", timeout=10)
        info = reply.json() if reply.status == 200 else None
        if info and info["state"] == "ready" and not info["generating"]:
            return None
        if time.monotonic() > deadline:
            return f"unhealthy: {reply.status} {info and (info['state'], info['generating'])}"
        time.sleep(0.05)


def judge(case: Case, outcome: str, reply: Reply | None) -> str | None:
    """None when the outcome is right for the case, else why not."""
    if outcome == "hung":
        return "hung"
    if not outcome.isdigit():
        return None                                  # dropped, or the client left
    status = int(outcome)
    if status >= 500:
        return f"{status} {reply.body[:200]!r}" if reply else str(status)
    if case.strict and status < 400:
        return f"accepted ({status}): {reply.body[:120]!r}" if reply else "accepted"
    if 200 <= status < 300 and case.check is not None and reply is not None and not case.check(reply):
        return f"not rejected: {reply.body[:200]!r}"
    return None


def present_routes(port: int) -> set[tuple[str, str]]:
    wanted = {c.route for c in corpus() if c.route}
    # A GET runs no handler of a POST route: 405 says the path exists, 404 that it does not.
    return {r for r in wanted if call(port, "GET", r[1]).status != 404}


def test_corpus_is_large_enough() -> None:
    assert len(corpus()) >= 300


def test_adversarial_corpus_against_the_real_routes(srv: ServerProcess,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    port = port_of(srv)
    routes = present_routes(port)
    cases = [c for c in corpus() if c.route is None or c.route in routes]
    skipped = sorted({c.category for c in corpus() if c.route and c.route not in routes})
    results: list[tuple[Case, str, str | None]] = []
    started = time.monotonic()
    for case in cases:
        outcome, reply = play(port, case)
        problem = judge(case, outcome, reply)
        sick = healthy(port)
        results.append((case, outcome, problem or sick))
        if sick:
            break                                    # what follows would only repeat it
    _report(results, skipped, time.monotonic() - started, capsys)
    assert len(results) >= 300
    bad = [(c.category, c.name, o, p) for c, o, p in results if p]
    assert not bad, "\n".join(map(str, bad))


def _report(results: list[tuple[Case, str, str | None]], skipped: list[str], seconds: float,
            capsys: pytest.CaptureFixture[str]) -> None:
    total = Counter(o for _, o, _ in results)
    by_category: dict[str, Counter[str]] = {}
    for case, outcome, _ in results:
        by_category.setdefault(case.category, Counter())[outcome] += 1
    with capsys.disabled():
        print(f"\ncorpus against the real server: {len(results)} requests in {seconds:.1f} s; "
              f"outcomes {dict(sorted(total.items()))}")
        for category, counts in by_category.items():
            print(f"  {category:34} {dict(sorted(counts.items()))}")
        if skipped:
            print(f"  skipped (no such route): {', '.join(skipped)}")
        for case, outcome, problem in results:
            if problem:
                print(f"  FAIL {case.category} | {case.name} -> {outcome}: {problem}")
