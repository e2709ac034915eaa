"""Request bodies as declarative wire models (pydantic v2): the rules, the server's own
bodies, and the parts the protocols share. Each protocol's own bodies are declared in its
module under `bmoe/server/protocols/` (`ChatBody`, `MessagesBody`, `ResponsesBody`), by
these rules.

Theory of operation
-------------------
Each body is a model, down to its nested parts: its fields, their JSON types, what is
required. `parse(Model, body)` checks a decoded JSON object against one and answers a
failure with `400 invalid_request` naming the field path
(`messages[2].content[1].source.data`) in a sentence of our own: never the library's
text. The route's error shaper (`shapes.py`) puts it in the route's own shape. Unknown
fields are ignored, as the spec says of every body here (clients send fields of the
protocols' newer versions).

Types are strict (`"5"` is not a number, `1` is not `true`): the protocols are JSON
and a client that sends the wrong type has a bug it wants to hear about. A part whose
shape depends on its `type` (a content block, an input item) is a discriminated union
(`tagged`): an unknown `type` is named with the ones this server reads. Values whose
meaning is more than a type (a token budget, a JSON schema) are annotated types with a
check of their own (`TokenBudget`, `Schema`), so they too fail with their path. What is
left to a protocol's decoder is what no single field says: which tool a choice names,
whether an image's bytes are an image, a part this server knows but does not take.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Callable, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from ..http.errors import invalid_request

M = TypeVar("M", bound=BaseModel)

_KINDS = {"string_type": "a string", "bool_type": "true or false", "int_type": "an integer",
          "float_type": "a number", "list_type": "an array", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object",
          "union_tag_not_found": "an object", "none_required": "null"}
_LABELS = ("function-", "union[", "list[", "dict[", "tagged-union[", "nullable[", "literal[",
           "json-or-python[", "lax-or-strict[")
TOP_LOGPROBS_MAX = 20  # OpenAI's ceiling for a chat request's top_logprobs
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in one schema; the grammar builder recurses


class Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class Other(Wire):
    """A part of a type this server passes over (a hosted tool, a reasoning summary)."""


def field_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """pydantic's location as the path a person reads: `messages[2].content`.

    The location also holds the labels of union members (`str`, `list[...]`, a model's
    class name, a tag `type=text`); field names of the protocols are lower-case words."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (part.startswith(_LABELS) or "=" in part or part[:1].isupper()
                  or part in ("str", "bool", "int", "float", "list", "dict", "none")):
            out += f".{part}" if out else part
    return out


def tagged(key: str = "type", default: Callable[[dict[str, Any]], Any] | None = None,
           only: tuple[str, ...] | None = None) -> Discriminator:
    """The discriminator of a union of parts told apart by `key`: its members carry
    `Tag(f"{key}={value}")`. `default` names the kind of a part without `key`; with
    `only`, a kind not among them is the member tagged `{key}=*` (passed over)."""
    def kind(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None                      # "must be an object"
        name = value.get(key)
        if name is None and default is not None:
            name = default(value)
        if not isinstance(name, str):
            return f"{key}="                  # missing, or not a string
        if only is not None and name not in only:
            return f"{key}=*"
        return f"{key}={name}"
    return Discriminator(kind)


def problem(message: str) -> PydanticCustomError:
    return PydanticCustomError("bmoe", message)


def _schema(value: Any) -> Any:
    """A JSON schema: an object (empty → {"type": "object"}) or null; nesting bounded."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise problem("must be a JSON object schema; boolean schemas are not supported")
    if not isinstance(value, dict):
        raise problem("must be a JSON object schema")
    if nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise problem(f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
    return value or {"type": "object"}


def token_budget(value: Any) -> int | None:
    """A token budget: a non-negative integer (an integral float is one), or null."""
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or
                                       (isinstance(value, float) and value.is_integer())):
        raise problem("must be a non-negative integer")
    if value < 0:
        raise problem("must be a non-negative integer")
    return int(value)


def Number(lo: float = -math.inf, hi: float = math.inf) -> AfterValidator:  # noqa: N802
    """A finite number in [lo, hi] (null stays null): `Annotated[Any, Number(0, 1)]`."""
    def check(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise problem("must be a finite number")
        if not lo <= value <= hi:
            raise problem(f"must be between {lo:g} and {hi:g}")
        return float(value)
    return AfterValidator(check)


def Integer(lo: int, hi: int) -> AfterValidator:  # noqa: N802
    """An integer in [lo, hi] (an integral float is one; null stays null)."""
    def check(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise problem("must be an integer")
        if not lo <= value <= hi:
            raise problem(f"must be between {lo} and {hi}")
        return value
    return AfterValidator(check)


Schema = Annotated[Any, AfterValidator(_schema)]
TokenBudget = Annotated[Any, AfterValidator(token_budget)]


def nesting_depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (a loop: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _one_of(quoted: str) -> str:
    """`'a', 'b', 'c'` (pydantic's list) as `"a", "b" or "c"`."""
    names = [f'"{n}"' for n in re.findall(r"'([^']*)'", quoted) if n != "*"]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def sentence(error: Any, prefix: str = "") -> str:
    """One validation error as a sentence naming its field."""
    where = field_path(tuple(error["loc"]), prefix) or "The body"
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"`{where}` is required."
    if kind in _KINDS:
        return f"`{where}` must be {_KINDS[kind]}."
    if kind == "too_short":
        return f"`{where}` is empty: give at least one."
    if kind == "string_too_short":
        return f"`{where}` must not be empty."
    if kind == "literal_error":
        return f"`{where}` must be {_one_of(ctx.get('expected', ''))}."
    if kind == "union_tag_invalid":
        key, _, value = str(ctx.get("tag", "")).partition("=")
        expected = re.sub(r"'\w+=", "'", str(ctx.get("expected_tags", "")))
        if not value:
            return f"`{where}.{key}` is required: {_one_of(expected)}."
        return f"`{where}.{key}` is {value!r}; here it must be {_one_of(expected)}."
    if kind == "bmoe":
        return f"`{where}` {error['msg']}."
    return f"`{where}` has a value of the wrong kind."


def _alternative(error: Any) -> str | None:
    """What one member of a union wanted, when the value had none of their types."""
    if error["type"] in _KINDS:
        return _KINDS[error["type"]]
    if error["type"] == "literal_error":
        return "one of " + _one_of((error.get("ctx") or {}).get("expected", ""))
    return None


def first_problem(errors: list[Any], prefix: str = "") -> str:
    """The first bad field, as a sentence.

    A field that may be one of several types (a union) has one error per type: where
    one member got further (its error lies deeper, inside the value), that one is the
    problem; where none did, all the types are said at once."""
    paths = [field_path(tuple(e["loc"]), prefix) for e in errors]
    deeper = [e for e, p in zip(errors, paths, strict=False)
              if not any(q.startswith((p + ".", p + "[")) for q in paths)
              or _alternative(e) is None]
    first = deeper[0] if deeper else errors[0]
    where = field_path(tuple(first["loc"]), prefix)
    kinds = [k for e, p in zip(errors, paths, strict=False) if p == where and (k := _alternative(e))]
    if len(kinds) > 1 and where:
        joint = ", or " if any(" or " in k for k in kinds) else " or "
        return f"`{where}` must be {joint.join(dict.fromkeys(kinds))}."
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


# -- shared by the protocols (each protocol's own bodies are in its module under
#    protocols/) --------------------------------------------------------------------

class FunctionDef(Wire):
    """A function tool: OpenAI chat's `function`, a Responses `function` tool."""
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: Schema = None


class JsonSchemaFormat(Wire):
    name: StrictStr | None = None
    description: StrictStr | None = None
    strict: StrictBool | None = None
    schema_: Schema = Field(None, alias="schema")


class ResponseFormat(Wire):
    type: Literal["text", "json_object", "json_schema"] | None = None
    schema_: Schema = Field(None, alias="schema")
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Wire):
    include_usage: StrictBool | None = None
