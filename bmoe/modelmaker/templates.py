"""Chat templates for the models bmoe makes itself (Jinja, stored as `tokenizer.chat_template`).

Theory of operation
-------------------
Each template is Qwen3's ChatML template, made robust (content given as parts, missing
content, an unknown role raises) and assembled from three pieces:

* the **tools block** in the system turn, in the tool-call framing's own words:
  ``hermes`` describes tools as Qwen3 does (one JSON object per line inside ``<tools>``) and
  asks for ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  ``qwen3_coder`` describes them as Qwen3-Coder does (``<function><name>…``) and asks for
  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
* the **messages**, as Qwen3 renders them: the first system (or developer) message is
  hoisted into the system turn; an assistant message after the last real user query gets
  its ``reasoning_content`` back as ``<think>\\n…\\n</think>\\n\\n`` (and the final one always
  gets the span, even empty); earlier reasoning is dropped; ``tool_calls`` are rendered in
  the framing; consecutive ``tool`` messages go into one user turn, each wrapped in
  ``<tool_response>\\n…\\n</tool_response>``;
* the **generation prompt**: ``<|im_start|>assistant\\n``; with ``enable_thinking`` false it
  is followed by an empty think span ``<think>\\n\\n</think>\\n\\n`` (Qwen3); the
  *think-prefill* variant (Qwen3-Thinking-2507) ends with ``<think>\\n`` when thinking is
  on, so generation starts inside the reasoning.

Every tag is written with ``-`` whitespace control, so the text renders the same with or
without ``trim_blocks``/``lstrip_blocks`` (llama-cpp-python sets both). The templates use
only ``tojson``, ``raise_exception`` and Jinja2 builtins (``items`` needs Jinja2 ≥ 3.1).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

FRAMINGS = ("hermes", "qwen3_coder")

_MACROS = r"""
{%- macro content_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro extra_keys(obj, handled) -%}
    {%- if obj is mapping -%}
        {%- for key, value in obj|items if key not in handled -%}
            {%- if value is mapping or (value is iterable and value is not string) -%}
                {{- '\n<' ~ key ~ '>' ~ (value | tojson) ~ '</' ~ key ~ '>' -}}
            {%- else -%}
                {{- '\n<' ~ key ~ '>' ~ (value | string) ~ '</' ~ key ~ '>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set sys = namespace(text='', present=false) -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
    {%- set sys.text = content_text(messages[0].content) -%}
    {%- set sys.present = true -%}
{%- endif -%}
"""

_HERMES_CALL = r"""
{%- macro tool_call_text(call) -%}
    {%- set fn = call.function if call.function is defined else call -%}
    {{- '<tool_call>\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
    {%- if fn.arguments is string -%}
        {{- fn.arguments -}}
    {%- elif fn.arguments is mapping -%}
        {{- fn.arguments | tojson -}}
    {%- else -%}
        {{- '{}' -}}
    {%- endif -%}
    {{- '}\n</tool_call>' -}}
{%- endmacro -%}
"""

_HERMES_TOOLS = r"""
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if sys.present -%}
        {{- sys.text + '\n\n' -}}
    {%- endif -%}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
    {%- for tool in tools -%}
        {{- '\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- elif sys.present -%}
    {{- '<|im_start|>system\n' + sys.text + '<|im_end|>\n' -}}
{%- endif -%}
"""

_CODER_CALL = r"""
{%- macro tool_call_text(call) -%}
    {%- set fn = call.function if call.function is defined else call -%}
    {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
    {%- if fn.arguments is mapping -%}
        {%- for key, value in fn.arguments|items -%}
            {{- '<parameter=' ~ key ~ '>\n' -}}
            {%- if value is string -%}
                {{- value -}}
            {%- else -%}
                {{- value | tojson -}}
            {%- endif -%}
            {{- '\n</parameter>\n' -}}
        {%- endfor -%}
    {%- elif fn.arguments is string and fn.arguments | trim not in ['', '{}'] -%}
        {{- raise_exception('qwen3_coder template: tool call arguments must be an object, not a JSON string') -}}
    {%- endif -%}
    {{- '</function>\n</tool_call>' -}}
{%- endmacro -%}
"""

_CODER_TOOLS = r"""
{%- if tools -%}
    {%- if sys.present -%}
        {{- '<|im_start|>system\n' + sys.text -}}
    {%- else -%}
        {{- '<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.' -}}
    {%- endif -%}
    {{- '\n\n# Tools\n\nYou have access to the following tools:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {{- '\n<function>\n<name>' ~ fn.name ~ '</name>' -}}
        {%- if fn.description is defined -%}
            {{- '\n<description>' ~ (fn.description | trim) ~ '</description>' -}}
        {%- endif -%}
        {{- '\n<parameters>' -}}
        {%- if fn.parameters is mapping and fn.parameters.properties is mapping -%}
            {%- for name, field in fn.parameters.properties|items -%}
                {{- '\n<parameter>\n<name>' ~ name ~ '</name>' -}}
                {%- if field.type is defined -%}
                    {{- '\n<type>' ~ (field.type | string) ~ '</type>' -}}
                {%- endif -%}
                {%- if field.description is defined -%}
                    {{- '\n<description>' ~ (field.description | trim) ~ '</description>' -}}
                {%- endif -%}
                {{- extra_keys(field, ['name', 'type', 'description']) -}}
                {{- '\n</parameter>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- extra_keys(fn.parameters, ['type', 'properties']) -}}
        {{- '\n</parameters>' -}}
        {{- extra_keys(fn, ['type', 'name', 'description', 'parameters']) -}}
        {{- '\n</function>' -}}
    {%- endfor -%}
    {{- '\n</tools>' -}}
    {{- '\n\nIf you choose to call a tool ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: the tool calling block MUST begin with an opening <tool_call> tag and end with a closing </tool_call> tag.\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT><|im_end|>\n' -}}
{%- elif sys.present -%}
    {{- '<|im_start|>system\n' + sys.text + '<|im_end|>\n' -}}
{%- endif -%}
"""

_MESSAGES = r"""
{%- set query = namespace(multi_step_tool=true, last_index=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
    {%- set text = content_text(message.content) -%}
    {%- if query.multi_step_tool and message.role == 'user' and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
        {%- set query.multi_step_tool = false -%}
        {%- set query.last_index = (messages|length - 1) - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set text = content_text(message.content) -%}
    {%- if message.role in ['system', 'developer'] -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + text + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + text + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is defined and message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in text -%}
            {%- set reasoning = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
            {%- set content = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- if loop.index0 > query.last_index and (loop.last or reasoning) -%}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- '<|im_start|>assistant\n' + content -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if (loop.first and content) or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- tool_call_text(call) -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unexpected message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
"""

_GENERATION_PROMPT = r"""
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

_GENERATION_PROMPT_PREFILL = r"""
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def chat_template(framing: str = "hermes", think_prefill: bool = False) -> str:
    """The template text for a tool-call framing (`hermes` or `qwen3_coder`)."""
    if framing == "hermes":
        head = _HERMES_CALL + _HERMES_TOOLS
    elif framing == "qwen3_coder":
        head = _CODER_CALL + _CODER_TOOLS
    else:
        raise ValueError(f"unknown template framing {framing!r}; expected one of {FRAMINGS}")
    tail = _GENERATION_PROMPT_PREFILL if think_prefill else _GENERATION_PROMPT
    return (_MACROS + head + _MESSAGES + tail).strip()


def template_key(framing: str, think_prefill: bool = False) -> str:
    return framing + ("-think-prefill" if think_prefill else "")


TEMPLATES: dict[str, str] = {
    template_key(framing, prefill): chat_template(framing, prefill)
    for framing in FRAMINGS
    for prefill in (False, True)
}


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as llama-cpp-python's Jinja2ChatFormatter (and Transformers): plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def render_chat(
    template_text: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """Render a conversation the way llama-cpp-python's Jinja2ChatFormatter would."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    return env.from_string(template_text).render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        raise_exception=_raise_exception,
        bos_token="",
        eos_token="<|im_end|>",
    )
