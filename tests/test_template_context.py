"""What a chat template finds beside the conversation, as llama.cpp's server gives it.

llama.cpp hands every template today's date (`date_string` as Llama 3.x reads it,
`datetime` as firefunction-v2 does) and its Jinja engine reads ``"text" + undefined`` (or
none) as the text; with Jinja2's defaults the real Llama 3.3 template rendered a fixed
"26 Jul 2024" and firefunction-v2's failed outright. The templates are the pinned sdist's.
Also `add_generation_prompt` false (llama-server's field): the prompt ends after the
conversation, through the turn's own rendering path.
"""

from __future__ import annotations

from datetime import date
from types import SimpleNamespace
from typing import Any

import pytest

from _llama_templates import read_template
from bmoe.engine import families
from bmoe.engine.templating import ChatTemplate, TemplateError
from bmoe.engine.turn import TurnRequest, render_prompt

ASK = [{"role": "user", "content": "What is today?"}]


@pytest.mark.parametrize("name,fmt", [("meta-llama-Llama-3.3-70B-Instruct.jinja", "%d %b %Y"),
                                      ("fireworks-ai-llama-3-firefunction-v2.jinja",
                                       "%b %d %Y")])
def test_the_real_templates_say_todays_date(name: str, fmt: str) -> None:
    out = ChatTemplate(read_template(name)).render(ASK)
    assert date.today().strftime(fmt) in out
    assert "26 Jul 2024" not in out


def test_a_requests_own_date_wins() -> None:
    out = ChatTemplate(read_template("meta-llama-Llama-3.3-70B-Instruct.jinja")).render(
        ASK, extra={"date_string": "01 Jan 2030"})
    assert "Today Date: 01 Jan 2030" in out


def test_text_plus_nothing_is_the_text_and_nothing_else_is_loosened() -> None:
    t = ChatTemplate('{{ "a" + missing }}|{{ nothing + "b" }}|{{ 1 + 2 }}|{{ [1] + [2] }}')
    assert t.render([], extra={"nothing": None}) == "a|b|3|[1, 2]"
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 1 + missing }}").render([])


class _Session(SimpleNamespace):
    def render(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return self.template.render(messages, **kw)


def test_add_generation_prompt_false_ends_after_the_conversation() -> None:
    session = _Session(template=ChatTemplate(read_template(
        "meta-llama-Llama-3.3-70B-Instruct.jinja")), tool_framing=families.GENERIC,
        template_kwargs={})
    opened = render_prompt(session, TurnRequest(messages=ASK))   # type: ignore[arg-type]
    closed = render_prompt(session, TurnRequest(messages=ASK,     # type: ignore[arg-type]
                                                generation_prompt=False))
    head = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert opened == closed + head
    assert closed.endswith("What is today?<|eot_id|>")


def test_the_older_tuple_items_form_is_a_tuple_grammar() -> None:
    from bmoe.engine import grammar as gbnf
    text = gbnf.json_schema_grammar(gbnf.normalize_schema(
        {"items": [{"type": "integer"}, {"const": "x"}]}), allow_reasoning=False)
    root = next(line for line in text.splitlines() if line.startswith("root ::="))
    assert '"[" space' in root and '"," space' in root, text
    with pytest.raises(ValueError, match=r"items\[0\]"):
        gbnf.normalize_schema({"items": [3]})


def test_no_jinja_lets_no_reasoning_before_a_schemas_answer() -> None:
    """llama-server's --no-jinja (its legacy chat: no reasoning): the answer schema's
    grammar starts with the JSON, where it otherwise allows a reasoning span first."""
    from bmoe.engine.turn import choose_grammar
    req = TurnRequest(messages=ASK, schema={"const": "42"})
    free = choose_grammar(req, families.GENERIC, False)
    legacy = choose_grammar(TurnRequest(messages=ASK, schema={"const": "42"},
                                        grammar_reasoning=False), families.GENERIC, False)
    assert isinstance(free, str) and isinstance(legacy, str)
    assert "<think>" in free and "<think>" not in legacy
