"""Engine failures, as values a client decides on.

`code` is one of the failure kinds of the telemetry contract (`context_full`,
`empty_prompt`, `template_rejected`, `needs_chat_mode`, `invalid_request`,
`invalid_output`, `failed`) or `no_vision`. Messages name settings with `{key}`
placeholders from the parameter table; whoever shows the message renders them
(labels in the server, flags in the CLI).

The numbers a client decides on travel as fields, never only inside the text:
`param` is the parameter key the failure is about (`ctx-size` for a full context),
`n_prompt` and `n_ctx` the prompt's size and the context's for `context_full`.
"""

from __future__ import annotations


class EngineError(Exception):
    def __init__(self, code: str, message: str, *, param: str | None = None,
                 n_prompt: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx

    def __repr__(self) -> str:
        return f"EngineError({self.code!r}, {self.message!r})"


class Aborted(Exception):
    """llama_decode stopped at the abort callback's request (the turn was cancelled):
    raised by `Session.decode` and the projector's prefill, caught by whoever drives the
    turn. Not an EngineError: nothing failed. `pos` is where the stopped decode began."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


class LoadError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__("failed", message)


def context_full(n_prompt: int, n_ctx: int) -> EngineError:
    return EngineError(
        "context_full",
        f"The conversation is {n_prompt} tokens and the context ({{ctx-size}}) holds "
        f"{n_ctx}: no room for an answer. Raise {{ctx-size}} or shorten the conversation.",
        param="ctx-size", n_prompt=n_prompt, n_ctx=n_ctx)


def no_vision() -> EngineError:
    return EngineError("no_vision", "The loaded model reads no images: it was loaded without "
                       "an image projector. Send text only, or load the model with its "
                       "projector ({mmproj}, or a projector of the same model in its folder).")
