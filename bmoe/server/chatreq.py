"""Reading the parts of a request that every protocol shares.

Thinking precedence, the token budget, output schemas and tools are the
same on `/v1/chat/completions`, `/v1/messages` and `/v1/responses`; the adapters
call these with the values their protocol carries.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

from ..engine import params
from ..engine.turn import TurnRequest
from ..http.errors import invalid_request
from . import wire

N_PREDICT_MAX = 2**20
MAX_SCHEMA_DEPTH = wire.MAX_SCHEMA_DEPTH     # the agent's MCP tools are bounded the same way
nesting_depth = wire.nesting_depth


def thinking(config_values: dict[str, Any], user_keys: list[str], *,
             think: bool | None = None, enable_thinking: bool | None = None,
             effort: str | None = None) -> bool:
    """think (bool) > chat_template_kwargs.enable_thinking > reasoning effort >
    the person's `think` setting (if they set it) > on. (The wire models have checked
    the values' types.)"""
    for value in (think, enable_thinking):
        if value is not None:
            return value
    if effort is not None:
        return effort != "none"
    if "think" in user_keys:
        return bool(config_values.get("think", True))
    return True


def budget(value: Any, name: str, config_values: dict[str, Any]) -> int:
    """A max-tokens field: absent/null/0 → the n-predict setting; clamped to its bound.
    A wire model's `TokenBudget` has checked it already; a value from elsewhere is
    checked the same way here."""
    try:
        value = wire.token_budget(value)
    except PydanticCustomError as e:
        raise invalid_request(f"`{name}` {e.message()}.") from None
    if not value:
        value = int(config_values.get("n-predict") or 0)
    try:
        upper = params.param("n-predict").max or N_PREDICT_MAX
    except KeyError:
        upper = N_PREDICT_MAX
    return min(int(value), int(upper))


def response_format_schema(response_format: wire.ResponseFormat | None,
                           top_level: dict[str, Any] | None) -> dict[str, Any] | None:
    """The output schema of a chat request (`response_format` and top-level `json_schema`)."""
    if response_format is None or response_format.type in (None, "text"):
        return top_level
    if response_format.type == "json_object":
        return response_format.schema_ or top_level or {"type": "object"}
    wrapper = response_format.json_schema
    return (wrapper.schema_ if wrapper is not None else None) or {"type": "object"}


def function_tool(name: str, description: str | None,
                  parameters: dict[str, Any] | None) -> dict[str, Any]:
    """One tool as the template reads it: `{"type": "function", "function": {name,
    description, parameters}}` (each protocol names these fields its own way)."""
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters or {"type": "object", "properties": {}}}}


def tool_choice(kind: str | None, name: str | None,
                tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("auto"|"none"|"required", the one tool the call must name or None), from a
    protocol's choice: `kind` ("auto", "none", "required"; None is "auto") or a `name`."""
    if name is not None:
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise invalid_request(f"`tool_choice` names {name!r}, which is not among the "
                                  "function `tools`.")
        return "required", name
    if kind == "required" and not tools:
        raise invalid_request("`tool_choice` asks for a tool call, but there are no function "
                              "`tools` to call.")
    return kind or "auto", None


def checked(req: TurnRequest, required_hint: str = "") -> TurnRequest:
    """`req`, unless its choices cannot hold together (400 invalid_request)."""
    problem = req.conflict()
    if problem is not None:
        if required_hint and "schema cannot" in problem:
            problem = problem[:-1] + " " + required_hint + "."
        raise invalid_request(problem)
    return req


def system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One system message, at the start: a chat template takes no other.

    The leading run of system messages becomes one (their texts joined by a blank
    line); a system message later in the conversation becomes a user message in its
    place, which leaves the prompt before it, and so the KV prefix, unchanged.
    """
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out: list[dict[str, Any]] = []
    texts = [m["content"] for m in messages[:lead] if m["content"]]
    if lead:
        out.append({"role": "system", "content": "\n\n".join(texts)})
    for m in messages[lead:]:
        out.append({**m, "role": "user"} if m["role"] == "system" else m)
    return out
