"""Embeddings and reranking: `/v1/embeddings`, `/embedding(s)`, `/rerank`, as llama-server.

Theory of operation
-------------------
A model loaded with `--embedding` (an embedding model: BERT and the like) answers these
routes and refuses chat (501); without it they answer 501 as llama-server does. The
engine's side is `bmoe/engine/embed.py`; this module reads the request into token lists
and writes the answer in the route's shape:

- `POST /v1/embeddings` (OpenAI's): `input` is a string, token ids, ids mixed with
  strings (one prompt), or a list of prompts, each a string, ids, `{"prompt_string"}` or
  `{"content": [{"type": "text", ...}]}` (the text parts joined). `encoding_format`
  float or base64 (little-endian float32). Pooling none is refused here (one vector per
  token is not OpenAI's shape).
- `POST /embedding` and `/embeddings` (llama-server's own): the same inputs (`content`
  or `input`), answered as `[{"index", "embedding": [[...], ...]}]`, one vector per
  token with pooling none. `embd_normalize` on both (2 Euclidean by default, -1 none).
- `POST /rerank` (and `/reranking`, `/v1/rerank`, `/v1/reranking`): a reranker (rank
  pooling, `--reranking`) scores `query` against each of `documents`; the answer is
  sorted by `relevance_score`, `top_n` kept, `usage` the tokens read.

Everything a client sends is bounded here and checked again on the engine thread
before llama.cpp sees it: the number of inputs, each id against the vocabulary, each
prompt against the context and the micro-batch (llama.cpp aborts the process on an
encoder input longer than its micro-batch).
"""

from __future__ import annotations

import base64
import struct
from functools import partial
from typing import Any, Callable

from ...engine import embed
from ...engine.errors import EngineError
from ...http.errors import invalid_request
from ...http.routes import RouteTable
from ...http.types import Request, Response
from ...runtime.state import Runtime
from .. import shapes
from .completions import I32_MAX, PROMPT_STRINGS_MAX

Part = str | int
TEXT_CHARS_MAX = 1 << 22        # characters of one input (the body cap bounds it too)


Run = Callable[..., Any]     # (state, fn, *args): fn(session, *args) on the engine thread


def register(table: RouteTable, state: Runtime, run: Run) -> None:
    """The routes' lines of the table; `run` is how they reach the engine (llama_compat's
    `on_engine`: the model's 503 while it loads, the engine's errors as HTTP errors)."""
    def add(path: str, fn: Callable[..., Any]) -> None:
        table.add("POST", path, partial(fn, state, run), shape=shapes.LLAMA, model=True)

    add("/v1/embeddings", openai_embeddings)
    add("/embedding", llama_embeddings)
    add("/embeddings", llama_embeddings)
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        add(path, rerank)


# -- reading the inputs ---------------------------------------------------------------

def _ids_and_text(value: list[Any], field: str) -> list[Part]:
    parts: list[Part] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            if len(part) > TEXT_CHARS_MAX:
                raise invalid_request(f"`{field}[{i}]` is longer than {TEXT_CHARS_MAX} "
                                      "characters.")
            parts.append(part)
        elif isinstance(part, int) and not isinstance(part, bool):
            if not 0 <= part <= I32_MAX:
                raise invalid_request(f"`{field}[{i}]` is {part}, which is not a token id.")
            parts.append(part)
        else:
            raise invalid_request(f"`{field}[{i}]` must be a string or a token id.")
    if sum(isinstance(p, str) for p in parts) > PROMPT_STRINGS_MAX:
        raise invalid_request(f"`{field}` holds more than {PROMPT_STRINGS_MAX} strings.")
    return parts


def _content_parts(value: Any, field: str) -> list[Part]:
    """OpenAI-style content parts: the text parts, joined. This engine's embedding
    models read text only: an image, audio or video part is refused."""
    if not isinstance(value, list):
        raise invalid_request(f"`{field}.content` must be a list of content parts "
                              '({"type": "text", "text": ...}).')
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_audio", "input_video", "image", "audio"):
            raise invalid_request(f"`{field}.content[{i}]` is {kind}: this model reads "
                                  "text only.")
        else:
            raise invalid_request(f"`{field}.content[{i}]` must be a text part "
                                  '({"type": "text", "text": ...}).')
    text = "".join(texts)
    if len(text) > TEXT_CHARS_MAX:
        raise invalid_request(f"`{field}` is longer than {TEXT_CHARS_MAX} characters.")
    return [text]


def _one(value: Any, field: str) -> list[Part]:
    if isinstance(value, str):
        return _ids_and_text([value], field)
    if isinstance(value, list):
        return _ids_and_text(value, field)
    if isinstance(value, dict):
        if "content" in value:
            return _content_parts(value["content"], field)
        if value.get("multimodal_data"):
            raise invalid_request(f"`{field}.multimodal_data`: this model reads text only.")
        text = value.get("prompt_string")
        if isinstance(text, str):
            return _ids_and_text([text], field)
        raise invalid_request(f"`{field}` must hold `prompt_string` (a string) or "
                              "`content` (content parts).")
    raise invalid_request(f"`{field}` must be a string, token ids, an object or a list "
                          "of these.")


def read_inputs(value: Any, field: str = "input") -> list[list[Part]]:
    """llama-server's embedding inputs: the prompts they hold (see the module's text)."""
    if value is None:
        raise invalid_request(f"`{field}` is required: a string, token ids, or a list of "
                              "inputs.")
    # as llama-server: a list holding any id is one prompt (ids mixed with text); any
    # other list is a list of prompts
    ints = isinstance(value, list) and any(isinstance(p, int) and not isinstance(p, bool)
                                           for p in value)
    if not isinstance(value, list) or ints:
        return [_one(value, field)]
    if not value:
        raise invalid_request(f"`{field}` must not be empty.")
    if len(value) > embed.MAX_PROMPTS:
        raise invalid_request(f"`{field}` holds more than {embed.MAX_PROMPTS} inputs; send "
                              "fewer a request.")
    return [_one(p, f"{field}[{i}]") for i, p in enumerate(value)]


def _tokens(session: Any, parts: list[Part]) -> list[int]:
    """One prompt's ids: the first string with the model's special tokens added (BERT's
    [CLS] ... [SEP]), later strings without, ids as given (checked by the engine)."""
    out: list[int] = []
    first = True
    for part in parts:
        if isinstance(part, str):
            out += session.tokenize(part, special=True, add_special=first)
        else:
            out.append(part)
        first = False
    return out


def _normalize(body: dict[str, Any]) -> int:
    norm = body.get("embd_normalize", 2)
    if not isinstance(norm, int) or isinstance(norm, bool) or not -1 <= norm <= 64:
        raise invalid_request("`embd_normalize` must be an integer from -1 to 64 (2: "
                              "Euclidean, the default; -1: none).")
    return norm


def _embed_on_engine(session: Any, prompts: list[list[Part]], norm: int,
                     oai: bool) -> tuple[str, list[embed.Embedded]]:
    if not getattr(session, "embeddings", False):
        raise EngineError("not_supported", "This server does not support embeddings. Start "
                          "it with --embeddings (for an embedding model).")
    kind = embed.pooling(session)
    if oai and kind == "none":
        raise EngineError("invalid_request", "Pooling type 'none' is not OAI compatible: "
                          "use /embedding for one vector per token, or start the server "
                          "with another --pooling.")
    return kind, embed.embed(session, [_tokens(session, p) for p in prompts], norm)


def _body(request: Request) -> tuple[dict[str, Any], Any, bool]:
    body = request.json_object()
    if "input" in body:
        return body, body["input"], True
    if "content" in body:
        return body, body["content"], False
    raise invalid_request('"input" or "content" must be provided.')


def _model(state: Runtime, body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else state.model_name()


async def openai_embeddings(state: Runtime, run: Run, request: Request) -> Response:
    body, value, oai = _body(request)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid_request("`encoding_format` must be float or base64.")
    prompts = read_inputs(value, "input" if oai else "content")
    _, results = await run(state, _embed_on_engine, prompts, _normalize(body), oai)
    if not oai:
        return Response.json(_llama_shape(results))
    data = []
    for i, r in enumerate(results):
        vector = r.vectors[0]
        if fmt == "base64":
            raw = struct.pack(f"<{len(vector)}f", *vector)
            data.append({"embedding": base64.b64encode(raw).decode("ascii"), "index": i,
                         "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vector, "index": i, "object": "embedding"})
    used = sum(r.n_tokens for r in results)
    return Response.json({"model": _model(state, body), "object": "list",
                          "usage": {"prompt_tokens": used, "total_tokens": used},
                          "data": data})


def _llama_shape(results: list[embed.Embedded]) -> list[dict[str, Any]]:
    return [{"index": i, "embedding": r.vectors} for i, r in enumerate(results)]


async def llama_embeddings(state: Runtime, run: Run, request: Request) -> Response:
    body, value, _ = _body(request)
    prompts = read_inputs(value, "content" if "content" in body and "input" not in body
                          else "input")
    _, results = await run(state, _embed_on_engine, prompts, _normalize(body), False)
    return Response.json(_llama_shape(results))


# -- reranking ------------------------------------------------------------------------

def _rerank_prompt(session: Any, query: str, document: str) -> list[int]:
    """llama-server's reranking prompt: the model's `rerank` template with {query} and
    {document} filled in, or else BOS query EOS SEP document EOS (as the vocabulary
    adds them: what BERT cross-encoders were trained on)."""
    import llama_cpp as lc
    raw = lc.llama_model_chat_template(session.model, b"rerank")
    if raw:
        text = raw.decode("utf-8", "replace")
        text = text.replace("{query}", query).replace("{document}", document)
        return list(session.tokenize(text, special=True, add_special=False))
    vocab = session.vocab
    eos = lc.llama_vocab_eos(vocab)
    if eos < 0:
        eos = lc.llama_vocab_sep(vocab)
    add_eos = bool(lc.llama_vocab_get_add_eos(vocab)) and eos >= 0
    out: list[int] = []
    if lc.llama_vocab_get_add_bos(vocab) and lc.llama_vocab_bos(vocab) >= 0:
        out.append(lc.llama_vocab_bos(vocab))
    out += session.tokenize(query, special=False, add_special=False)
    if add_eos:
        out.append(eos)
    if lc.llama_vocab_get_add_sep(vocab) and lc.llama_vocab_sep(vocab) >= 0:
        out.append(lc.llama_vocab_sep(vocab))
    out += session.tokenize(document, special=False, add_special=False)
    if add_eos:
        out.append(eos)
    return out


def _rerank_on_engine(session: Any, query: str, documents: list[str]) -> list[embed.Embedded]:
    if not getattr(session, "embeddings", False) or embed.pooling(session) != "rank":
        raise EngineError("not_supported", "This server does not support reranking. Start "
                          "it with --reranking (for a reranker model).")
    return embed.embed(session, [_rerank_prompt(session, query, d) for d in documents])


async def rerank(state: Runtime, run: Run, request: Request) -> Response:
    body = request.json_object()
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid_request("`query` must be a string.")
    documents = body.get("documents", body.get("texts"))
    tei = "texts" in body and "documents" not in body
    if not isinstance(documents, list) or not documents:
        raise invalid_request("`documents` must be a non-empty list of strings.")
    if len(documents) > embed.MAX_PROMPTS:
        raise invalid_request(f"`documents` holds more than {embed.MAX_PROMPTS} entries.")
    texts = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise invalid_request(f"`documents[{i}]` must be a string.")
        texts.append(text)
    top_n = body.get("top_n", len(texts))
    if not isinstance(top_n, int) or isinstance(top_n, bool):
        raise invalid_request("`top_n` must be an integer.")
    results = await run(state, _rerank_on_engine, query, texts)
    label = "score" if tei else "relevance_score"
    ranked: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        item: dict[str, Any] = {"index": i, label: r.vectors[0][0] if r.vectors and
                                r.vectors[0] else -1e6}
        if tei and body.get("return_text"):
            item["text"] = texts[i]
        ranked.append(item)
    ranked.sort(key=lambda item: item[label], reverse=True)
    ranked = ranked[:max(0, top_n)]
    if tei:
        return Response.json(ranked)
    used = sum(r.n_tokens for r in results)
    return Response.json({"model": _model(state, body), "object": "list",
                          "usage": {"prompt_tokens": used, "total_tokens": used},
                          "results": ranked})


