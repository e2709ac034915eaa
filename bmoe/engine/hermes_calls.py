"""The ``hermes`` tool-call framing (Qwen3): ``<tool_call>\\n{"name": "f", "arguments":
{...}}\\n</tool_call>``.

`HermesCall` consumes the text inside one call from the outer parser (`chatparse.OutputParser`)
and says how much it took; text it leaves is held for the next piece (a partial marker) or,
once the call is done, belongs to the outer parser. It exposes the call's name and the
arguments as JSON text that only ever grows.
"""

from __future__ import annotations

import json

from .chatmarkup import CALL_CLOSE


class HermesCall:
    """``{"name": ..., "arguments": ...}`` scanned one character at a time."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.done = False
        self._body = ""
        self._state = "start"
        self._key = ""
        self._mark = 0            # start of the current key or value in _body
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._fallback_args: str | None = None

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done:
                return i
            if ch == "<" and not self._inside_string():
                rest = text[i:]
                if rest.startswith(CALL_CLOSE):
                    self.close("")
                    return i + len(CALL_CLOSE)
                if CALL_CLOSE.startswith(rest):
                    return i
            self._body += ch
            self._step(ch, len(self._body) - 1)
        return len(text)

    def close(self, tail: str) -> None:
        for ch in tail:
            self._body += ch
            self._step(ch, len(self._body) - 1)
        if self._state == "scalar":
            self._value_end(len(self._body))
        if self.name is None or self._args_start is None:
            self._read_whole_body()
        self.done = True

    def arguments_text(self) -> str:
        if self._fallback_args is not None:
            return self._fallback_args
        if self._args_start is None:
            return "{}" if self.done else ""
        if self._args_end is not None:
            return self._body[self._args_start:self._args_end]
        if self.done or self._body[self._args_start] in "{[":
            return self._body[self._args_start:]
        return ""

    def _inside_string(self) -> bool:
        return self._state in ("key", "string") or (self._state == "nested" and self._in_string)

    def _read_whole_body(self) -> None:
        try:
            obj = json.loads(self._body)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and self.name is None:
            self.name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            self._fallback_args = json.dumps(args, ensure_ascii=False)

    def _step(self, ch: str, pos: int) -> None:
        getattr(self, "_on_" + self._state)(ch, pos)

    def _on_start(self, ch: str, pos: int) -> None:
        if not ch.isspace():
            self._state = "key_or_end" if ch == "{" else "failed"

    def _on_key_or_end(self, ch: str, pos: int) -> None:
        if ch == '"':
            self._state, self._mark, self._escaped = "key", pos, False
        elif ch == "}":
            self._state = "finished"
            self.done = True
        elif not ch.isspace():
            self._state = "failed"

    def _on_key(self, ch: str, pos: int) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            try:
                self._key = json.loads(self._body[self._mark:pos + 1])
            except ValueError:
                self._key = ""
            self._state = "colon"

    def _on_colon(self, ch: str, pos: int) -> None:
        if ch == ":":
            self._state = "value"
        elif not ch.isspace():
            self._state = "failed"

    def _on_value(self, ch: str, pos: int) -> None:
        if ch.isspace():
            return
        self._mark = pos
        if self._key in ("arguments", "parameters") and self._args_start is None:
            self._args_start = pos
        if ch in "{[":
            self._state, self._depth, self._in_string = "nested", 1, False
        elif ch == '"':
            self._state, self._escaped = "string", False
        else:
            self._state = "scalar"

    def _on_nested(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string, self._escaped = True, False
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._value_end(pos + 1)

    def _on_string(self, ch: str, pos: int) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._value_end(pos + 1)

    def _on_scalar(self, ch: str, pos: int) -> None:
        if ch in ",}" or ch.isspace():
            self._value_end(pos)
            self._on_after(ch, pos)

    def _on_after(self, ch: str, pos: int) -> None:
        if ch == ",":
            self._state = "key_or_end"
        elif ch == "}":
            self._state = "finished"
            self.done = True
        elif not ch.isspace():
            self._state = "failed"

    def _on_finished(self, ch: str, pos: int) -> None:
        pass

    def _on_failed(self, ch: str, pos: int) -> None:
        pass

    def _value_end(self, end: int) -> None:
        self._state = "after"
        value_text = self._body[self._mark:end]
        if self._key == "name" and self.name is None and value_text.startswith('"'):
            try:
                name = json.loads(value_text)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        if self._mark == self._args_start:
            self._args_end = end
