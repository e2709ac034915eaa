"""Chat templates a person can name (`chat-template`), for a model whose file has none.

llama-server's ``--chat-template NAME`` picks one of llama.cpp's built-in formats; these
are the common ones, written as the Jinja the model families publish (a system message
is its own turn where the family has one, folded into the first user turn where it has
not). A value that is not a name here is read as Jinja template text itself, as
llama-server reads it.
"""

from __future__ import annotations

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


def looks_like_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def resolve(value: str) -> str | None:
    """The template text for a `chat-template` value: a built-in's by name, the value
    itself when it is Jinja, None when it is neither."""
    name = value.strip().lower()
    if name in BUILTIN:
        return BUILTIN[name]
    return value if looks_like_template(value) else None
