"""Rendering a conversation through the model's own chat template.

The template is the Jinja text stored in the GGUF (`tokenizer.chat_template`). It is
rendered the way llama.cpp's server and Hugging Face's transformers render it: a
sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII text as it is.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    """The template refused the conversation (it called raise_exception or failed)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Immutable, but a template may change a list (Kimi-K2-Thinking appends to and pops
    from one), as llama.cpp's own Jinja engine allows; `render` hands the template a copy
    of the conversation, so the caller's lists are never changed."""

    # `"text" + x` where x is undefined or none is the text, as llama.cpp's engine reads
    # it (firefunction-v2 adds `functions`, which no caller defines when there are none)
    intercepted_binops = frozenset({"+"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, list) and attr in ("append", "extend", "pop", "insert"):
            return True
        return super().is_safe_attribute(obj, attr, value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if isinstance(left, str) and _is_nothing(right):
                return left
            if isinstance(right, str) and _is_nothing(left):
                return right
        return super().call_binop(context, operator, left, right)


def _is_nothing(value: Any) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' mark of the assistant's
    own text (for training masks; LFM2.5 uses it). It renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _as_list(value: Any) -> Any:
    """What a Jinja filter chain leaves (``tools | map(attribute='function')`` is a
    generator in Jinja2, a list in llama.cpp's templates) written as the list it is."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys, default=_as_list)


@dataclass(frozen=True)
class Caps:
    system_role: bool          # a system message is rendered (else: folded into the next)
    string_arguments: bool     # a call's arguments are read as text only (else: an object)


_SYSTEM_MARK = "bmoe-system-probe-5d1c"
_SYSTEM_PROBE = [{"role": "system", "content": _SYSTEM_MARK},
                 {"role": "user", "content": "Hello"}]
_ARG_MARK = "bmoe-argument-probe-7e2a"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool", "description": "A tool.",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}}}}]


def _call_probe(as_object: bool) -> list[dict[str, Any]]:
    args: Any = {"probe_arg": _ARG_MARK}
    call = {"id": "call_probe", "type": "function",
            "function": {"name": "probe_tool",
                         "arguments": args if as_object else json.dumps(args)}}
    return [{"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_probe", "name": "probe_tool",
             "content": "ok"},
            {"role": "user", "content": "Thanks"}]


class ChatTemplate:
    def __init__(self, text: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = _Sandbox(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.text = text
        self._template = env.from_string(text)
        self._bos = bos_token
        self._eos = eos_token
        self._caps: Caps | None = None

    @property
    def caps(self) -> "Caps":
        """What the template does with a system message and a call's arguments, tried
        once on sample conversations (as llama.cpp's `jinja::caps` does)."""
        if self._caps is None:
            as_object = self._try(_call_probe(True))
            # an object printed as it is comes out as Python's repr, not the JSON its
            # model was trained on: such a template reads the arguments as text
            printed = as_object is None or _ARG_MARK not in as_object \
                or f"'probe_arg': '{_ARG_MARK}'" in as_object
            as_text = self._try(_call_probe(False))
            system = self._try(_SYSTEM_PROBE)
            self._caps = Caps(system_role=system is not None and _SYSTEM_MARK in system,
                              string_arguments=printed and as_text is not None
                              and _ARG_MARK in as_text)
        return self._caps

    def _try(self, messages: list[dict[str, Any]]) -> str | None:
        for tools in (None, _PROBE_TOOLS):      # some templates render only with tools
            try:
                return self._apply(messages, tools, False, True, None)
            except Exception:        # a template may refuse the sample: it does not show it
                continue
        return None

    def adapt(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as this template takes it (llama.cpp's workarounds): a system
        message folded into the next one where the template has no system role; a call's
        arguments as JSON text where the template reads them only as text."""
        caps = self.caps
        fold = not caps.system_role and bool(messages) and messages[0].get("role") == "system"
        if not fold and not caps.string_arguments:
            return messages
        out = copy.deepcopy(messages)
        if fold:
            first = out.pop(0)
            if out and isinstance(out[0].get("content"), str) \
                    and isinstance(first.get("content"), str):
                out[0] = {**out[0], "content": first["content"] + "\n" + out[0]["content"]}
        if caps.string_arguments:
            for m in out:
                for call in m.get("tool_calls") or ():
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and not isinstance(fn.get("arguments"), str):
                        fn["arguments"] = json.dumps(fn.get("arguments"), ensure_ascii=False)
        return out

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        return self._apply(self.adapt(messages), tools, add_generation_prompt,
                           enable_thinking, extra)

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, enable_thinking: bool,
               extra: dict[str, Any] | None) -> str:
        # llama.cpp's extra context: today's date in the two forms templates read (Llama
        # 3.x's date_string, firefunction's datetime); a request's variables win
        now = datetime.now()
        kwargs: dict[str, Any] = {"date_string": now.strftime("%d %b %Y"),
                                  "datetime": now.strftime("%b %d %Y")}
        kwargs.update(extra or {})
        kwargs.update(
            messages=copy.deepcopy(messages),
            tools=copy.deepcopy(tools) or None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self._bos,
            eos_token=self._eos,
        )
        try:
            return self._template.render(**kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"The model's chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"The model's chat template could not render this conversation: {e}") from e
