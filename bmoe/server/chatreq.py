"""Reading the parts of a request that every protocol shares.

Thinking precedence, the token budget and output schemas are the
same on `/v1/chat/completions`, `/v1/messages` and `/v1/responses`; the adapters
call these with the values their protocol carries.
"""

from __future__ import annotations

from typing import Any

from ..engine import params
from ..engine.turn import TurnRequest
from ..http.errors import invalid_request

N_PREDICT_MAX = 2**20
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in one schema; the grammar builder recurses


def thinking(config_values: dict[str, Any], user_keys: list[str], *,
             think: Any = None, enable_thinking: Any = None, effort: Any = None) -> bool:
    """think (bool) > chat_template_kwargs.enable_thinking > reasoning effort >
    the person's `think` setting (if they set it) > on."""
    for value, name in ((think, "think"), (enable_thinking, "chat_template_kwargs.enable_thinking")):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise invalid_request(f"`{name}` must be true or false.")
        return value
    if effort is not None:
        if not isinstance(effort, str):
            raise invalid_request("`reasoning_effort` must be a string such as \"none\" or \"low\".")
        return effort != "none"
    if "think" in user_keys:
        return bool(config_values.get("think", True))
    return True


def budget(value: Any, name: str, config_values: dict[str, Any]) -> int:
    """A max-tokens field: absent/null/0 → the n-predict setting; clamped to its bound."""
    if value is not None:
        if isinstance(value, bool) or not (isinstance(value, int) or
                                           (isinstance(value, float) and value.is_integer())):
            raise invalid_request(f"`{name}` must be a non-negative integer.")
        value = int(value)
        if value < 0:
            raise invalid_request(f"`{name}` must be a non-negative integer.")
    if not value:
        value = int(config_values.get("n-predict") or 0)
    try:
        upper = params.param("n-predict").max or N_PREDICT_MAX
    except KeyError:
        upper = N_PREDICT_MAX
    return min(int(value), int(upper))


def schema_object(value: Any, name: str) -> dict[str, Any] | None:
    """A schema: an object (empty → {"type": "object"}), null → None; boolean refused."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise invalid_request(f"`{name}` must be a JSON object schema; boolean schemas are not supported.")
    if not isinstance(value, dict):
        raise invalid_request(f"`{name}` must be a JSON object schema.")
    if nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise invalid_request(f"`{name}` nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep.")
    return value or {"type": "object"}


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


def refuse_lone_surrogates(body: Any) -> None:
    """Text the model reads must be Unicode: a lone surrogate (``"\\ud800"``, valid JSON
    syntax) has no UTF-8 form, so it cannot be tokenized: a 400, not the tokenizer's fault."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid_request("The request holds a lone UTF-16 surrogate (such as "
                                      "\\ud800), which is not text.") from None
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node


def response_format_schema(response_format: Any, top_level: Any) -> dict[str, Any] | None:
    """The output schema of a chat request (`response_format` and top-level `json_schema`)."""
    top = schema_object(top_level, "json_schema")
    if response_format is None:
        return top
    if not isinstance(response_format, dict):
        raise invalid_request("`response_format` must be an object.")
    kind = response_format.get("type")
    if kind is None or kind == "text":
        return top
    if kind == "json_object":
        inner = schema_object(response_format.get("schema"), "response_format.schema")
        return inner or top or {"type": "object"}
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if wrapper is None:
            return {"type": "object"}
        if not isinstance(wrapper, dict):
            raise invalid_request("`response_format.json_schema` must be an object.")
        for key, types in (("name", str), ("description", str), ("strict", bool)):
            v = wrapper.get(key)
            if v is not None and not isinstance(v, types):
                raise invalid_request(f"`response_format.json_schema.{key}` has the wrong type.")
        return schema_object(wrapper.get("schema"), "response_format.json_schema.schema") or {"type": "object"}
    raise invalid_request(f"`response_format.type` {kind!r} is not supported: use "
                          "\"text\", \"json_object\" or \"json_schema\".")


def function_tool(tool: dict[str, Any], where: str, schema_key: str) -> dict[str, Any]:
    """One tool as the template reads it: `{"type": "function", "function": {name,
    description, parameters}}` from an object with `name`, `description` and a schema
    under `schema_key` (each protocol names it its own way)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_request(f"`{where}.name` is required: a string.")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_request(f"`{where}.description` must be a string.")
    params = schema_object(tool.get(schema_key), f"{where}.{schema_key}")
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": params or {"type": "object", "properties": {}}}}


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
