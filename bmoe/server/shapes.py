"""Error shapes per protocol family.

`/v1/messages` and `/v1/responses` answer every refusal, the access checks'
included, in their own protocol's shape; every other path uses the server's
`{"error", "code"}`.
"""

from __future__ import annotations

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


def error_shaper(path: str, err: HTTPError) -> Response | None:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return Response.json(anthropic_error(err), status=err.status, headers=err.headers)
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return Response.json(responses_error(err), status=err.status, headers=err.headers)
    return None
