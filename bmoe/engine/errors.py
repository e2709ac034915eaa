"""Engine failures, as values a client decides on.

`code` is one of the failure kinds of the telemetry contract (`context_full`,
`empty_prompt`, `template_rejected`, `needs_chat_mode`, `invalid_request`,
`invalid_output`, `failed`) or `no_vision`. Messages name settings with `{key}`
placeholders from the parameter table; whoever shows the message renders them
(labels in the server, flags in the CLI).
"""

from __future__ import annotations


class EngineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"EngineError({self.code!r}, {self.message!r})"


class LoadError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__("failed", message)
