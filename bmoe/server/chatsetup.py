"""What the server learns about a model's chat template once, at load."""

from __future__ import annotations

import logging
from typing import Any

from ..engine.chatparse import detect_framing
from ..engine.session import Session
from ..engine.templating import TemplateError

log = logging.getLogger("bmoe.chat")


def configure_session(session: Session) -> None:
    """Find the template's tool-call framing by rendering a sample call through it."""
    session.tool_framing = None  # type: ignore[attr-defined]
    if session.template is None:
        return

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        return session.render(messages, tools=tools, add_generation_prompt=False)

    try:
        session.tool_framing = detect_framing(render)  # type: ignore[attr-defined]
    except TemplateError as e:
        log.warning("the chat template refused a sample tool call: %s", e)
