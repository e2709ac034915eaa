"""One rule for a lone UTF-16 surrogate (``"\\ud800"``: valid JSON syntax, not a character,
no UTF-8 form), on every route family of a real server: the body is not UTF-8 text, so it
is the spec's ``400 invalid_request``, refused where every body is decoded
(``Request.json``), in each family's own error shape and with the same sentence. The same
body with a plain character instead is answered, so the refusal is the surrogate's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ServerProcess, start_server

LONE = "\ud800"
SENTENCE = ("The request body holds a lone UTF-16 surrogate (such as \\ud800), which is not a "
            "character and has no UTF-8 form.")

Body = Callable[[str], dict[str, Any]]


def chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}


ROUTES: list[tuple[str, str, Body]] = [
    ("chat", "/v1/chat/completions", chat),
    ("messages", "/v1/messages",
     lambda t: {"model": "local", "max_tokens": 1, "messages": [{"role": "user", "content": t}]}),
    ("messages count", "/v1/messages/count_tokens",
     lambda t: {"model": "local", "messages": [{"role": "user", "content": t}]}),
    ("responses", "/v1/responses", lambda t: {"input": t, "max_output_tokens": 1}),
    ("chat, in a tool", "/v1/chat/completions", lambda t: {**chat("x"), "tools": [
        {"type": "function", "function": {"name": "f", "description": t,
                                          "parameters": {"type": "object"}}}]}),
    ("chat, llama's path", "/chat/completions", chat),
    ("completion", "/completion", lambda t: {"prompt": t, "n_predict": 1}),
    ("completions", "/v1/completions", lambda t: {"prompt": t, "max_tokens": 1}),
    ("tokenize", "/tokenize", lambda t: {"content": t}),
    ("apply-template", "/apply-template",
     lambda t: {"messages": [{"role": "user", "content": t}]}),
    ("decide", "/api/decide", lambda t: {"prefix": t, "choices": ["a", "b"]}),
    ("agent", "/api/conversations", lambda t: {"title": t}),
    ("agent, in a key", "/api/conversations", lambda t: {"title": "x", t: 1}),
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> Iterator[ServerProcess]:
    s = start_server(tmp_path_factory.mktemp("surrogates"), "-m", str(tiny_moe), "-c", "2048")
    assert s.info()["state"] == "ready", s.info()
    yield s
    s.stop()


def send(srv: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The body as a client's JSON encoder writes it: non-ASCII as ``\\u`` escapes."""
    raw = json.dumps(body, ensure_ascii=True).encode()
    status, _, reply = srv.request("POST", path, raw=raw)
    return status, reply


def message_of(reply: Any) -> str:
    """The sentence of an error in any family's shape: the server's ``{"error", "code"}``,
    llama-server's, Anthropic's and OpenAI's ``{"error": {"message", ...}}``."""
    err = reply["error"]
    return err if isinstance(err, str) else err["message"]


@pytest.mark.parametrize("family,path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_a_lone_surrogate_is_the_same_400_on_every_route(srv: ServerProcess, family: str,
                                                         path: str, body: Body) -> None:
    status, reply = send(srv, path, body(LONE))
    assert status == 400, (family, reply)
    assert message_of(reply) == SENTENCE, (family, reply)
    if isinstance(reply.get("code"), str):              # the server's own shape
        assert reply["code"] == "invalid_request"
    status, reply = send(srv, path, body("x"))
    assert status in (200, 201), (family, "the body is refused without a surrogate", reply)


@pytest.mark.parametrize("text", ["a\udfffb", "\udc00\ud800", "\ud83d", "x" * 1000 + LONE])
def test_every_lone_surrogate_is_refused(srv: ServerProcess, text: str) -> None:
    status, reply = send(srv, "/tokenize", {"content": text})
    assert (status, message_of(reply)) == (400, SENTENCE), (text[-8:], reply)


def test_an_escaped_pair_is_the_character_it_encodes(srv: ServerProcess) -> None:
    """``\\ud83d\\ude00`` is one emoji, not two surrogates: tokenized as the same emoji
    sent as UTF-8 is, and it reads back as that emoji."""
    status, escaped = send(srv, "/tokenize", {"content": "\U0001F600"})
    assert status == 200 and escaped["tokens"], escaped
    raw = json.dumps({"content": "\U0001F600"}, ensure_ascii=False).encode()
    assert b"\\u" not in raw
    status, _, direct = srv.request("POST", "/tokenize", raw=raw)
    assert status == 200 and direct["tokens"] == escaped["tokens"], (direct, escaped)
    status, _, back = srv.request("POST", "/detokenize", {"tokens": escaped["tokens"]})
    assert status == 200 and back["content"] == "\U0001F600", back
