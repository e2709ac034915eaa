"""The one error type of the HTTP layer.

An ``HTTPError`` carries the status it becomes and the machine-readable ``code`` a
client decides on; ``message`` is for a person. Handlers raise it anywhere below the
connection; the connection turns it into ``{"error": message, "code": code}`` (or
into the protocol's own shape when the route was registered with a ``shape``).
Anything else that escapes a handler is the server's own fault: a 500, logged with
its traceback on stderr, never shown to the client.
"""

from __future__ import annotations

from typing import Any


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: list[tuple[str, str]] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or []
        self.fields = fields or {}          # numbers a client decides on (a shape may carry)

    def __repr__(self) -> str:
        return f"HTTPError({self.status}, {self.code!r}, {self.message!r})"


def invalid_request(message: str) -> HTTPError:
    return HTTPError(400, "invalid_request", message)


def internal_error() -> HTTPError:
    """The server's own fault, as the client sees it: no detail, no traceback."""
    return HTTPError(500, "internal", "The server failed to answer this request.")


def sole_exception(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (a handler that
    raised inside its own nursery), or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
