"""Request bodies as declarative wire models (pydantic v2).

Theory of operation
-------------------
Each body is a model: its fields, their JSON types, what is required. `parse(Model,
body)` checks a decoded JSON object against one and answers a failure with `400
invalid_request` naming the field path (`messages[2].content`) in a sentence of our
own: never the library's text. The route's error shaper (`shapes.py`) puts it in the
route's own shape. Unknown fields are ignored, as the spec says of every body here
(clients send fields of the protocols' newer versions).

Types are strict (`"5"` is not a number, `1` is not `true`): the protocols are JSON
and a client that sends the wrong type has a bug it wants to hear about. Fields whose
meaning depends on more than their type (a token budget: an integer or an integral
float; a schema; a message's content parts) are typed `Any` here and read by the
protocol's decoder, which raises the same `invalid_request` with the path.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from ..http.errors import invalid_request

M = TypeVar("M", bound=BaseModel)

_KINDS = {"string_type": "a string", "bool_type": "true or false", "int_type": "an integer",
          "float_type": "a number", "list_type": "an array", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object",
          "none_required": "null"}


class Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def field_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """pydantic's location as the path a person reads: `messages[2].content`."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "union[", "list[", "dict[")) and \
                part not in ("str", "bool", "int", "float", "list", "dict", "none"):
            out += f".{part}" if out else part
    return out


def sentence(error: Any, prefix: str = "") -> str:
    """One validation error as a sentence naming its field."""
    where = field_path(tuple(error["loc"]), prefix) or "The body"
    kind = error["type"]
    if kind == "missing":
        return f"`{where}` is required."
    if kind in _KINDS:
        return f"`{where}` must be {_KINDS[kind]}."
    if kind == "too_short":
        return f"`{where}` is empty: give at least one."
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        return f"`{where}` must be one of {allowed}."
    return f"`{where}` has a value of the wrong kind."


def first_problem(errors: list[Any], prefix: str = "") -> str:
    """The first bad field, as a sentence; a field that may be one of several types
    (a union: one error per type) is said once, with all of them."""
    first = errors[0]
    where = field_path(tuple(first["loc"]), prefix)
    kinds = [_KINDS[e["type"]] for e in errors
             if e["type"] in _KINDS and field_path(tuple(e["loc"]), prefix) == where]
    if len(kinds) > 1 and where:
        return f"`{where}` must be {' or '.join(dict.fromkeys(kinds))}."
    return sentence(first, prefix)


def parse(model: type[M], body: Any, prefix: str = "") -> M:
    """`body` checked against `model`; 400 invalid_request naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        raise invalid_request(first_problem(errors, prefix)) from None


# -- the server's own bodies --------------------------------------------------------------

class DecideBody(Wire):
    prefix: StrictStr | None = None
    suffix: StrictStr | None = None
    choices: list[StrictStr] = Field(min_length=1)
    reuse_prefix: StrictBool | None = None


class SessionLoadBody(Wire):
    model: StrictStr | None = None


class ConfigBody(Wire):
    values: dict[StrictStr, Any] = Field(default_factory=dict)
    reset: list[StrictStr] = Field(default_factory=list)


class EmptyBody(Wire):
    """`POST /api/cancel` and `/api/session/unload`: any object (its fields are ignored)."""


# -- the protocols' top-level fields ---------------------------------------------------------
# The nested parts (messages, content parts, tools) are read by each protocol's decoder.

class ChatFunction(Wire):
    name: StrictStr = ""
    arguments: StrictStr | dict[str, Any] = "{}"


class ChatToolCall(Wire):
    id: StrictStr = ""
    function: ChatFunction


class ChatMessage(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None   # parts: read by the decoder
    tool_calls: list[ChatToolCall] | None = None
    reasoning_content: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class ChatBody(Wire):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    think: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    grammar: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    json_schema: Any = None
    n: Any = None


class MessagesBody(Wire):
    messages: list[dict[str, Any]]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: StrictBool | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    max_tokens: Any = None


class ResponsesBody(Wire):
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    stream: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Any = None
    background: Any = None
    previous_response_id: Any = None
    conversation: Any = None
