"""Error shapes per protocol family.

A route says at its registration which shape its errors take (`shape=LLAMA`,
`ANTHROPIC` or `RESPONSES`; see `bmoe/http/routes.py`): `/v1/messages` and
`/v1/responses` answer every refusal, the access checks' included, in their own
protocol's shape, llama-server's routes in llama-server's; every other route uses the
server's `{"error", "code"}`. A path no route answers takes the shape of the route it
lies below (`/v1/messages/x` is Anthropic's 404).
"""

from __future__ import annotations

from typing import Any

from ..engine import params
from ..engine.errors import EngineError
from ..http.errors import HTTPError
from ..http.types import Response

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(err: HTTPError) -> dict:
    kind = ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def responses_error(err: HTTPError) -> dict:
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return {"error": {"message": err.message, "type": kind, "param": None, "code": err.code}}


def llama_error_body(err: HTTPError) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 501: "not_supported_error",
             503: "unavailable_error"}
    kind = kinds.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    if err.code == "context_full":          # llama-server's, with the two sizes
        n, ctx = err.fields.get("n_prompt_tokens"), err.fields.get("n_ctx")
        sizes = f" ({n} tokens; the context holds {ctx})" if n is not None else ""
        return {"error": {"code": err.status, "type": "exceed_context_size_error",
                          "message": f"the request exceeds the available context size{sizes}: "
                                     "raise --ctx-size or shorten the prompt.",
                          **err.fields}}
    return {"error": {"code": err.status, "message": err.message, "type": kind}}


LLAMA = "llama"             # llama-server's error object (bmoe/server/llama_compat.py)
ANTHROPIC = "anthropic"     # the Messages API's
RESPONSES = "responses"     # the Responses API's


def error_shaper(shape: str, err: HTTPError) -> Response | None:
    """``err`` in the shape its route declares; None for a name this module does not know."""
    if shape == LLAMA:
        return Response.json(llama_error_body(err), status=err.status, headers=err.headers)
    if shape == ANTHROPIC:
        return Response.json(anthropic_error(err), status=err.status, headers=err.headers)
    if shape == RESPONSES:
        return Response.json(responses_error(err), status=err.status, headers=err.headers)
    return None


STATUS_OF = {"context_full": 400, "empty_prompt": 400, "template_rejected": 400,
             "needs_chat_mode": 400, "invalid_request": 400, "no_vision": 400,
             "invalid_output": 500, "failed": 500, "not_supported": 501}


def engine_http_error(e: EngineError) -> HTTPError:
    """An engine failure as the HTTP error it is, its `{key}` placeholders as labels."""
    fields = {"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx} \
        if e.code == "context_full" and e.n_prompt is not None else None
    return HTTPError(STATUS_OF.get(e.code, 500), e.code, params.render(e.message, "label"),
                     fields=fields)


ANTHROPIC_TOO_LONG = "prompt is too long: "


def anthropic_engine_error(e: EngineError) -> HTTPError:
    """The Messages API's: a full context is "prompt is too long" (an agent compacts its
    conversation on those words)."""
    err = engine_http_error(e)
    if e.code != "context_full":
        return err
    head = f"{e.n_prompt} tokens > {e.n_ctx} maximum. " if e.n_prompt is not None else ""
    return HTTPError(400, "context_full", ANTHROPIC_TOO_LONG + head + err.message)


def responses_engine_error(e: EngineError) -> HTTPError:
    """The Responses API's: a full context is `context_length_exceeded`, the code Codex
    compacts its conversation on."""
    err = engine_http_error(e)
    if e.code == "context_full":
        return HTTPError(400, "context_length_exceeded", err.message)
    return err


ENGINE_ERRORS = {ANTHROPIC: anthropic_engine_error, RESPONSES: responses_engine_error}


def engine_error(shape: str | None, e: EngineError) -> HTTPError:
    """An engine failure as the protocol of a route of ``shape`` says it: the one place
    each protocol maps `EngineError` (the route table's wrapper and the protocol's stream
    encoder both call it)."""
    return ENGINE_ERRORS.get(shape or "", engine_http_error)(e)
