"""`tojson` of what a filter chain leaves: the sdist's ``llama-cpp-deepseek-r1.jinja``
writes ``tools | map(attribute='function') | tojson(indent=2)``, a generator in Jinja2
(a list in llama.cpp's templates); the tools must come out as the JSON list."""

from __future__ import annotations

import json

import pytest

from _llama_templates import read_template
from bmoe.engine.templating import ChatTemplate, TemplateError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_mapped_list_is_written_as_json() -> None:
    out = ChatTemplate(read_template("llama-cpp-deepseek-r1.jinja")).render(
        [{"role": "user", "content": "Weather?"}], tools=TOOLS)
    assert json.dumps([TOOLS[0]["function"]], indent=2) in out


def test_what_json_cannot_hold_is_still_a_template_error() -> None:
    assert ChatTemplate("{{ messages[0].content | tojson }}").render(
        [{"role": "user", "content": [1, "a"]}]) == '[1, "a"]'
    with pytest.raises(TemplateError, match="not JSON serializable"):
        ChatTemplate("{{ namespace(a=1) | tojson }}").render([{"role": "user", "content": "x"}])
