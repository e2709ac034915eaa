"""Chat templates a person can name (`chat-template`), for a model whose file has none.

llama-server's ``--chat-template NAME`` picks one of llama.cpp's built-in formats. Three
(chatml, gemma, llama3) are written here as the Jinja the model families publish (a
system message is its own turn where the family has one, folded into the first user turn
where it has not). Every other name llama.cpp knows (command-r, mistral-v7, phi4,
deepseek3, ...) is rendered by llama.cpp's own formatter, ``llama_chat_apply_template``,
exactly as llama-server renders it: role and text of each message, no tools. A value
that is not a name is read as Jinja template text itself, as llama-server reads it.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .templating import TemplateError

CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

GEMMA = (
    "{{ bos_token }}"
    "{%- set first = 0 -%}{%- set system = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = (messages[0]['content'] or '') + '\\n\\n' -%}{%- set first = 1 -%}"
    "{%- endif -%}"
    "{%- for message in messages[first:] -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- set prefix = system if loop.first else '' -%}"
    "{{ '<start_of_turn>' + role + '\\n' + prefix + (message['content'] or '') | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] or '') | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)

BUILTIN = {"chatml": CHATML, "gemma": GEMMA, "llama3": LLAMA3}

# The names llama.cpp's formatter knows (src/llama-chat.cpp of the pinned llama.cpp; a
# test holds this list to llama_chat_builtin_templates()). Kept here, not asked of the
# library, so that checking a setting does not load llama.cpp.
LEGACY = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r",
    "deepseek", "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe", "exaone3",
    "exaone4", "falcon3", "gemma", "gigachat", "glmedge", "gpt-oss", "granite",
    "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe", "hunyuan-vl",
    "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3",
    "llama4", "megrez", "minicpm", "mistral-v1", "mistral-v3", "mistral-v3-tekken",
    "mistral-v7", "mistral-v7-tekken", "monarch", "openchat", "orion", "pangu-embedded",
    "phi3", "phi4", "rwkv-world", "seed_oss", "smolvlm", "solar-open", "vicuna",
    "vicuna-orca", "yandex", "zephyr",
)
NAMES = tuple(sorted(set(LEGACY) | set(BUILTIN)))
MAX_PROMPT_BYTES = 1 << 30  # llama.cpp's formatter returns the length as an int32


def looks_like_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def canonical(value: str) -> str | None:
    """The built-in name a `chat-template` value is (case and spaces aside), or None."""
    name = value.strip().lower()
    return name if name in NAMES else None


def resolve(value: str) -> str | None:
    """The template text for a `chat-template` value: a Jinja built-in's text or, for a
    name llama.cpp's formatter renders, the name itself; the value itself when it is
    Jinja; None when it is neither."""
    name = canonical(value)
    if name is not None:
        return BUILTIN.get(name, name)
    return value if looks_like_template(value) else None


def is_legacy(text: str) -> bool:
    """Whether a resolved template text is a name for llama.cpp's formatter."""
    return text in LEGACY and text not in BUILTIN


def _text(content: Any) -> str:
    """A message's text as llama-server's legacy route reads it: the string, or the text
    parts joined by newlines (images and other parts are left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content
                 if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(t for t in parts if isinstance(t, str))
    return ""


class LegacyTemplate:
    """A built-in format rendered by llama.cpp's ``llama_chat_apply_template`` (the same
    call llama-server's ``--no-jinja`` route makes). It renders roles and text only: tools,
    tool calls and template variables are not part of these formats."""

    def __init__(self, name: str) -> None:
        if not is_legacy(name):
            raise ValueError(f"{name!r} is not a format llama.cpp's formatter renders")
        self.text = name

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, enable_thinking: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        # llama_cpp is imported here, not at the top: params imports this module to check
        # a setting, and that must not load llama.cpp's library
        import llama_cpp as lc

        # C strings end at a NUL: one inside a message would cut it there, so it is dropped
        encoded = [(str(m.get("role") or "").replace("\0", "").encode("utf-8", "replace"),
                    _text(m.get("content")).replace("\0", "").encode("utf-8", "replace"))
                   for m in messages]
        size = sum(len(r) + len(c) for r, c in encoded)
        if size > MAX_PROMPT_BYTES // 2:
            raise TemplateError("The conversation is too long for the chat format.")
        chat = (lc.llama_chat_message * max(1, len(encoded)))()
        for i, (role, content) in enumerate(encoded):
            chat[i].role, chat[i].content = role, content
        name = self.text.encode()
        cap = size + size // 4 + 4096
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = lc.llama_chat_apply_template(name, chat, len(encoded), add_generation_prompt,
                                             buf, cap)
            if n < 0:
                raise TemplateError(f"llama.cpp's {self.text} format refused this "
                                    "conversation.")
            if n <= cap:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = n + 1
        raise TemplateError(f"llama.cpp's {self.text} format gave no stable length.")
