"""Small checks for request bodies: a field of the wrong type is a 400, never a 500."""

from __future__ import annotations

from typing import Any

from ..http.errors import invalid_request

_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer", float: "a number",
               list: "an array", dict: "an object", type(None): "null"}


def _describe(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


def _matches(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def field(obj: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None,
          *, where: str = "") -> Any:
    """`obj[key]` when it has one of `types`; `default` when absent or null."""
    if not isinstance(types, tuple):
        types = (types,)
    value = obj.get(key)
    if value is None:
        return default
    if not _matches(value, types):
        name = f"{where}.{key}" if where else key
        raise invalid_request(f"`{name}` must be {_describe(types)}.")
    return value


def required(obj: dict[str, Any], key: str, types: type | tuple[type, ...], *, where: str = "") -> Any:
    value = field(obj, key, types, None, where=where)
    if value is None:
        name = f"{where}.{key}" if where else key
        raise invalid_request(f"`{name}` is required.")
    return value


def object_list(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_request(f"`{name}` must be an array.")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid_request(f"`{name}[{i}]` must be an object.")
    return value
