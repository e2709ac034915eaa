"""Rendering a conversation through the model's own chat template.

The template is the Jinja text stored in the GGUF (`tokenizer.chat_template`). It is
rendered the way llama.cpp's server and Hugging Face's transformers render it: a
sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII text as it is.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from collections.abc import Iterator
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

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
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
