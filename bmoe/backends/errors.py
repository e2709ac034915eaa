"""The backends package's one error: a refusal or failure with the status and code a route
answers, and a sentence for a person. The server turns it into an ``HTTPError``."""

from __future__ import annotations


class BackendsError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class FeedError(Exception):
    """A feed that could not be read or does not verify: ``message`` says why, for a person."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
