"""The one error type of the HTTP layer.

An ``HTTPError`` carries the status it becomes and the machine-readable ``code`` a
client decides on; ``message`` is for a person. Handlers raise it anywhere below the
connection; the connection turns it into ``{"error": message, "code": code}`` (or
into the protocol's own shape when the route was registered with a ``shape``).
Anything else that escapes a handler is the server's own fault: a 500, logged with
its traceback on stderr, never shown to the client.
"""

from __future__ import annotations

import errno
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


_STORAGE = {
    errno.ENOSPC: ("disk_full", "the disk holding it is full. Free some space and try again"),
    errno.EDQUOT: ("disk_full", "the disk quota is used up. Free some space and try again"),
    errno.EROFS: ("read_only", "its folder is on a read-only file system. Make the data "
                               "folder writable (or start the server with another one)"),
    errno.EACCES: ("not_writable", "the server may not write there. Give it the right to "
                                   "write in the data folder"),
}


def storage_error(exc: BaseException) -> HTTPError | None:
    """A file the server keeps that could not be written (disk full, read-only, no
    permission): `507` with a sentence naming the file, not a `500` (the server's own
    fault): the change the request asked for is not on disk, the server goes on serving."""
    if not isinstance(exc, OSError) or exc.errno not in _STORAGE:
        return None
    code, why = _STORAGE[exc.errno]
    name = f" {exc.filename}" if exc.filename else ""
    return HTTPError(507, code, f"The server could not save the file{name}: {why}. "
                                "This change is not on disk.")


def sole_exception(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (a handler that
    raised inside its own nursery), or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
