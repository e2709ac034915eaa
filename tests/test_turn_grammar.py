"""The engine's grammar choice for a turn (`bmoe.engine.turn.choose_grammar`), no model."""

from __future__ import annotations

import logging

import pytest

from bmoe.engine.errors import EngineError
from bmoe.engine.turn import LazyGrammar, TurnRequest, choose_grammar

MSG = [{"role": "user", "content": "hi"}]


def tool(name: str, params: object = None) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "description": "",
                                             "parameters": params or {"type": "object"}}}


TOOLS = [tool("a"), tool("b")]


def test_auto_with_tools_is_a_lazy_call_grammar() -> None:
    g = choose_grammar(TurnRequest(MSG, tools=TOOLS), "hermes", False)
    assert isinstance(g, LazyGrammar) and g.triggers == ["<tool_call>"]


def test_no_framing_or_no_tools_is_free_text() -> None:
    assert choose_grammar(TurnRequest(MSG, tools=TOOLS), None, False) is None
    assert choose_grammar(TurnRequest(MSG), "hermes", False) is None
    assert choose_grammar(TurnRequest(MSG, tools=TOOLS, tool_choice="none"), "hermes", False) is None


def test_a_named_tool_holds_the_call_to_it() -> None:
    g = choose_grammar(TurnRequest(MSG, tools=TOOLS, tool_choice="required", named_tool="b"),
                       "hermes", False)
    assert isinstance(g, str) and '\\"b\\"' in g and '\\"a\\"' not in g


def test_required_without_a_framing_is_template_rejected() -> None:
    with pytest.raises(EngineError) as e:
        choose_grammar(TurnRequest(MSG, tools=TOOLS, tool_choice="required"), None, False)
    assert e.value.code == "template_rejected"


def test_schema_and_gbnf() -> None:
    g = choose_grammar(TurnRequest(MSG, schema={"type": "object"}), None, False)
    assert isinstance(g, str) and "root" in g
    assert choose_grammar(TurnRequest(MSG, grammar='root ::= "x"'), None, False) == 'root ::= "x"'


def test_a_schema_the_builder_refuses_is_invalid_request() -> None:
    with pytest.raises(EngineError) as e:
        choose_grammar(TurnRequest(MSG, tools=[tool("a", True)], tool_choice="required"),
                       "hermes", False)
    assert e.value.code == "invalid_request"


def test_auto_with_a_tool_list_the_grammar_cannot_express_runs_free(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bmoe.chat"):
        g = choose_grammar(TurnRequest(MSG, tools=[tool("a", True)]), "hermes", False)
    assert g is None and "will not be held to a grammar" in caplog.text


def test_conflicts_are_sentences() -> None:
    req = TurnRequest(MSG, tools=TOOLS, tool_choice="required", schema={"type": "object"})
    assert req.conflict() == "An output schema cannot be combined with a required tool call."
    assert TurnRequest(MSG, grammar="x", schema={}).conflict() is not None
    assert TurnRequest(MSG, tools=TOOLS).conflict() is None
