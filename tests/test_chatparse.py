"""The chat output parser and the two delta producers, without a model."""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Callable
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bmoe.engine.chatparse import (
    AppendOnlyStream,
    BlockAppend,
    BlockClose,
    BlockOpen,
    ChatDeltaStream,
    OutputParser,
    ParseView,
    ToolCallView,
    coerce_parameter,
    detect_framing,
    sequential_call_ids,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "ratio": {"type": "number"},
        "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": ["string", "null"]},
        "loose": {"description": "no type"},
    }, "required": ["city"]}}}
WRITE = {"type": "function", "function": {
    "name": "write_file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}
TOOLS = [WEATHER, WRITE]


# ---------------------------------------------------------------------------
# helpers


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in random chunks."""
    out = [[text], list(text)]
    for seed in range(4):
        rng = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def run(pieces: list[str], framing: str | None = None, starts_in_reasoning: bool = False,
        tools: list | None = None) -> tuple[list[ParseView], ParseView]:
    parser = OutputParser(framing, starts_in_reasoning, tools)
    views = []
    for piece in pieces:
        parser.feed(piece)
        views.append(parser.snapshot())
    return views, parser.finish()


def parse(text: str, framing: str | None = None, starts_in_reasoning: bool = False,
          tools: list | None = None) -> ParseView:
    """The final view, checked to be the same however the text is split."""
    finals = [run(p, framing, starts_in_reasoning, tools)[1] for p in splits(text)]
    assert all(f == finals[0] for f in finals), finals
    return finals[0]


def assert_append_only_calls(views: list[ParseView]) -> None:
    previous: dict[int, str] = {}
    for view in views:
        for i, call in enumerate(view.tool_calls):
            assert call.arguments_text.startswith(previous.get(i, "")), (previous, call)
            previous[i] = call.arguments_text


def args(view: ParseView, i: int = 0) -> Any:
    return json.loads(view.tool_calls[i].arguments_text)


# ---------------------------------------------------------------------------
# UTF-8


def test_split_utf8_through_decoder_into_parser() -> None:
    text = '<think>déjà vu</think>Ça va 🙂<tool_call>\n{"name": "get_weather", ' \
           '"arguments": {"city": "Zürich"}}\n</tool_call>'
    data = text.encode()
    # the session decodes a token's bytes this way (a split character is held back)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parser = OutputParser("hermes", False, TOOLS)
    for i in range(len(data)):
        parser.feed(decoder.decode(data[i:i + 1]))
        view = parser.snapshot()
        assert "\ufffd" not in view.content + view.reasoning
    parser.feed(decoder.decode(b"", final=True))
    final = parser.finish()
    assert (final.reasoning, final.content) == ("déjà vu", "Ça va 🙂")
    assert args(final) == {"city": "Zürich"}


# ---------------------------------------------------------------------------
# reasoning and content


def test_plain_content() -> None:
    assert parse("Hello, world.") == ParseView(content="Hello, world.")


def test_reasoning_from_the_start_of_the_prompt() -> None:
    view = parse("Let me think.\n</think>\n\nThe answer is 4.", starts_in_reasoning=True)
    assert (view.reasoning, view.content) == ("Let me think.", "The answer is 4.")


def test_reasoning_opened_by_the_model() -> None:
    view = parse("<think>\nhmm\n</think>\n\nHi.")
    assert (view.reasoning, view.content) == ("hmm", "Hi.")


def test_unterminated_reasoning_is_reasoning() -> None:
    view = parse("still thinking <tool", starts_in_reasoning=True)
    assert view == ParseView(reasoning="still thinking <tool")


def test_partial_tags_are_held_back() -> None:
    parser = OutputParser(None, False, None)
    parser.feed("Hi <thi")
    assert parser.snapshot().content == "Hi"
    parser.feed("nk>deep")
    assert parser.snapshot() == ParseView(reasoning="deep", content="Hi")
    parser.feed("</thi")
    assert parser.snapshot().reasoning == "deep"
    parser.feed("nk>ok <b>")
    assert parser.finish() == ParseView(reasoning="deep", content="Hi ok <b>")


def test_text_that_only_looks_like_a_tag_is_released() -> None:
    parser = OutputParser("hermes", False, None)
    parser.feed("a <tool_")
    assert parser.snapshot().content == "a"
    parser.feed("kit> b")
    assert parser.snapshot().content == "a <tool_kit> b"


def test_closing_tag_without_opening_reclassifies_content() -> None:
    views, final = run(["I should", " answer", "</thi", "nk>", "\n\nYes."])
    assert [v.content for v in views[:2]] == ["I should", "I should answer"]
    assert (final.reasoning, final.content) == ("I should answer", "Yes.")


def test_second_closing_tag_is_dropped() -> None:
    view = parse("a</think>b</think>c", starts_in_reasoning=True)
    assert (view.reasoning, view.content) == ("a", "bc")


def test_no_framing_reads_no_calls() -> None:
    view = parse('<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>')
    assert view.tool_calls == ()
    assert view.content.startswith("<tool_call>")


def test_fallback_raw_when_nothing_parses() -> None:
    view = parse("<tool_call>\nnot json at all\n</tool_call>", "hermes")
    assert view.fallback_raw
    assert view.content == "<tool_call>\nnot json at all\n</tool_call>"
    assert parse("<think>\n\n</think>\n\n", "hermes") == ParseView()
    assert parse("", "hermes") == ParseView()


def test_feed_after_finish_is_refused() -> None:
    parser = OutputParser(None)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_unknown_framing_is_refused() -> None:
    with pytest.raises(ValueError):
        OutputParser("xml")


# ---------------------------------------------------------------------------
# hermes


HERMES_TWO = ('<think>\nweather first\n</think>\n\nChecking.\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"opts": {"a": [1, "}]\\"<tool_call>"]}}}\n</tool_call>\n'
              '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", '
              '"content": "x</tool_call>y"}}\n</tool_call>')


def test_hermes_two_calls() -> None:
    view = parse(HERMES_TWO, "hermes")
    assert (view.reasoning, view.content) == ("weather first", "Checking.")
    assert [c.name for c in view.tool_calls] == ["get_weather", "write_file"]
    assert args(view, 0) == {"city": "Paris", "opts": {"a": [1, '}]"<tool_call>']}}
    assert args(view, 1) == {"path": "a.txt", "content": "x</tool_call>y"}
    assert all(c.complete for c in view.tool_calls)


def test_hermes_arguments_are_the_text_the_model_wrote() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"b":1,  "a" : [ ]}}\n</tool_call>'
    assert parse(text, "hermes").tool_calls[0].arguments_text == '{"b":1,  "a" : [ ]}'


def test_hermes_arguments_grow_append_only() -> None:
    for pieces in splits(HERMES_TWO):
        views, final = run(pieces, "hermes")
        assert_append_only_calls([*views, final])


def test_hermes_call_appears_once_its_name_is_whole() -> None:
    parser = OutputParser("hermes")
    parser.feed('<tool_call>\n{"name": "get_wea')
    assert parser.snapshot().tool_calls == ()
    parser.feed('ther", "arguments": {"ci')
    assert parser.snapshot().tool_calls == (ToolCallView("get_weather", '{"ci', False),)


def test_hermes_arguments_before_name() -> None:
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'
    view = parse(text, "hermes")
    assert view.tool_calls == (ToolCallView("f", '{"x": 1}', True),)


def test_hermes_parameters_key_and_missing_arguments() -> None:
    assert args(parse('<tool_call>{"name": "f", "parameters": {"k": 2}}</tool_call>',
                      "hermes")) == {"k": 2}
    assert parse('<tool_call>{"name": "f"}</tool_call>', "hermes").tool_calls == (
        ToolCallView("f", "{}", True),)


def test_text_after_a_call_is_never_content() -> None:
    text = 'Before.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nAfter.'
    view = parse(text, "hermes")
    assert view.content == "Before."
    assert len(view.tool_calls) == 1


def test_hermes_truncated_call() -> None:
    view = parse('<tool_call>\n{"name": "f", "arguments": {"path": "a/', "hermes")
    assert view.tool_calls == (ToolCallView("f", '{"path": "a/', True),)


def test_tool_call_inside_reasoning_ends_it() -> None:
    text = 'hmm <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    view = parse(text, "hermes", starts_in_reasoning=True)
    assert view.reasoning == "hmm"
    assert view.tool_calls[0].name == "f"


# ---------------------------------------------------------------------------
# qwen3_coder


CODER_CALL = ('<tool_call>\n<function=get_weather>\n'
              '<parameter=city>\nNew "York"\n</parameter>\n'
              '<parameter=days>\n3\n</parameter>\n'
              '<parameter=metric>\ntrue\n</parameter>\n'
              '<parameter=ratio>\n0.5\n</parameter>\n'
              '<parameter=opts>\n{"unit": "c", "deep": [1, 2]}\n</parameter>\n'
              '<parameter=tags>\n["a", "b"]\n</parameter>\n'
              '<parameter=note>\nnull\n</parameter>\n'
              '<parameter=loose>\n42\n</parameter>\n'
              '</function>\n</tool_call>')


def test_coder_values_typed_by_schema() -> None:
    view = parse(CODER_CALL, "qwen3_coder", tools=TOOLS)
    assert view.tool_calls[0].name == "get_weather"
    assert args(view) == {"city": 'New "York"', "days": 3, "metric": True, "ratio": 0.5,
                          "opts": {"unit": "c", "deep": [1, 2]}, "tags": ["a", "b"],
                          "note": None, "loose": 42}


def test_coder_string_values_stay_strings() -> None:
    text = ('<tool_call>\n<function=write_file>\n<parameter=path>\n42\n</parameter>\n'
            '<parameter=content>\ndef f():\n    return "<x>"\n\n</parameter>\n'
            '</function>\n</tool_call>')
    view = parse(text, "qwen3_coder", tools=TOOLS)
    assert args(view) == {"path": "42", "content": 'def f():\n    return "<x>"\n'}


def test_coder_without_tools_guesses_json() -> None:
    text = ('<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n'
            '<parameter=s>\nhello\n</parameter>\n</function>\n</tool_call>')
    assert args(parse(text, "qwen3_coder")) == {"n": 7, "s": "hello"}


def test_coder_arguments_grow_append_only_and_stream_strings() -> None:
    for pieces in splits(CODER_CALL):
        views, final = run(pieces, "qwen3_coder", tools=TOOLS)
        assert_append_only_calls([*views, final])
    parser = OutputParser("qwen3_coder", False, TOOLS)
    parser.feed('<tool_call>\n<function=write_file>\n<parameter=content>\nline one\n')
    assert parser.snapshot().tool_calls[0].arguments_text == '{"content": "line one'
    parser.feed("</param")
    assert parser.snapshot().tool_calls[0].arguments_text == '{"content": "line one'


def test_coder_two_calls_and_missing_call_open() -> None:
    text = ('Sure.\n<function=write_file>\n<parameter=path>\na\n</parameter>\n'
            '<parameter=content>\nb\n</parameter>\n</function>\n'
            '<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n'
            '</function>\n</tool_call>')
    view = parse(text, "qwen3_coder", tools=TOOLS)
    assert view.content == "Sure."
    assert [c.name for c in view.tool_calls] == ["write_file", "get_weather"]
    assert args(view, 1) == {"city": "Rome"}


def test_coder_function_text_for_unknown_names_is_content() -> None:
    view = parse("#include <functional>\n<function=nope>", "qwen3_coder", tools=TOOLS)
    assert view.content == "#include <functional>\n<function=nope>"


def test_coder_truncated_call_closes_its_json() -> None:
    text = '<tool_call>\n<function=write_file>\n<parameter=content>\npartial </para'
    view = parse(text, "qwen3_coder", tools=TOOLS)
    assert args(view) == {"content": "partial </para"}
    view = parse('<tool_call>\n<function=get_weather>\n<parameter=days>\n1', "qwen3_coder",
                 tools=TOOLS)
    assert args(view) == {"days": 1}


def test_coder_no_parameters() -> None:
    view = parse("<tool_call>\n<function=f>\n</function>\n</tool_call>", "qwen3_coder")
    assert view.tool_calls == (ToolCallView("f", "{}", True),)


@pytest.mark.parametrize("raw,types,expected", [
    ("42", frozenset(["string"]), "42"),
    ("42", frozenset(["integer"]), 42),
    ("4.5", frozenset(["integer"]), "4.5"),
    ("4", frozenset(["number"]), 4),
    ("NaN", frozenset(["number"]), "NaN"),
    ('"quoted"', frozenset(), '"quoted"'),
    ("[1]", frozenset(["string", "array"]), [1]),
    ("true", frozenset(), True),
    ("no", frozenset(["boolean"]), "no"),
])
def test_coerce_parameter(raw: str, types: frozenset[str], expected: Any) -> None:
    assert json.loads(coerce_parameter(raw, types)) == expected


# ---------------------------------------------------------------------------
# framing detection

QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function or tool_call %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}"""

CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
If you choose to call a function ONLY reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}
<tool_call>
<function={{ tool_call.name }}>
{% for args_name, args_value in tool_call.arguments|items %}<parameter={{ args_name }}>
{{ args_value }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}"""

PLAIN_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}"""

STRICT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role not in ["user", "assistant"] %}{{ raise_exception("roles!") }}{% endif %}
{%- if message.role == "assistant" %}{% for c in message.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}
{%- endfor %}"""


def renderer(source: str) -> Callable[[list[dict], list[dict]], str]:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    return lambda messages, tools: template.render(messages=messages, tools=tools)


def test_detect_framing_hermes() -> None:
    assert detect_framing(renderer(QWEN3_TEMPLATE)) == "hermes"


def test_detect_framing_qwen3_coder() -> None:
    assert detect_framing(renderer(CODER_TEMPLATE)) == "qwen3_coder"


def test_detect_framing_none() -> None:
    assert detect_framing(renderer(PLAIN_TEMPLATE)) is None


def test_detect_framing_retries_without_the_tool_message() -> None:
    assert detect_framing(renderer(STRICT_TEMPLATE)) == "hermes"


def test_detect_framing_survives_a_failing_template() -> None:
    def broken(messages: list[dict], tools: list[dict]) -> str:
        raise jinja2.TemplateError("no")
    assert detect_framing(broken) is None


# ---------------------------------------------------------------------------
# ChatDeltaStream


def replay_chat(pieces: list[str], framing: str | None = None, starts_in_reasoning: bool = False,
                tools: list | None = None) -> tuple[list[dict], ParseView]:
    parser = OutputParser(framing, starts_in_reasoning, tools)
    stream = ChatDeltaStream(sequential_call_ids())
    deltas: list[dict] = []
    for piece in pieces:
        parser.feed(piece)
        deltas += stream.update(parser.snapshot())
    final = parser.finish()
    deltas += stream.finish(final)
    return deltas, final


def client_view(deltas: list[dict]) -> dict[str, Any]:
    """What an OpenAI client that knows ``reset`` reassembles."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}}
    for delta in deltas:
        if delta.get("reset"):
            out["content"], out["reasoning"] = delta["content"], delta["reasoning_content"]
            continue
        out["content"] += delta.get("content", "")
        out["reasoning"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            slot = out["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert slot["name"] is None and call["type"] == "function"
                slot.update(id=call["id"], name=call["function"]["name"])
            slot["arguments"] += call["function"]["arguments"]
    return out


@pytest.mark.parametrize("text,framing,starts,tools", [
    (HERMES_TWO, "hermes", False, None),
    (CODER_CALL, "qwen3_coder", True, TOOLS),
    ("abc</think>def", None, False, None),
])
def test_chat_deltas_reassemble_the_final_view(text: str, framing: str | None, starts: bool,
                                               tools: list | None) -> None:
    for pieces in splits(text):
        deltas, final = replay_chat(pieces, framing, starts, tools)
        seen = client_view(deltas)
        assert (seen["content"], seen["reasoning"]) == (final.content, final.reasoning)
        assert [(c["name"], c["arguments"]) for _, c in sorted(seen["calls"].items())] == \
            [(c.name, c.arguments_text) for c in final.tool_calls]
        assert [c["id"] for _, c in sorted(seen["calls"].items())] == \
            [f"call_{i}" for i in range(len(final.tool_calls))]


def test_chat_reset_delta() -> None:
    deltas, _ = replay_chat(["I think", "</think>", "Done."])
    assert deltas == [{"content": "I think"},
                      {"reset": True, "content": "", "reasoning_content": "I think"},
                      {"content": "Done."}]


def test_chat_tool_call_first_delta() -> None:
    deltas, _ = replay_chat(['<tool_call>\n{"name": "f", "arguments": ', '{"a"', ": 1}}",
                             "\n</tool_call>"], "hermes")
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
    ]


def test_chat_call_no_view_showed_arrives_whole() -> None:
    stream = ChatDeltaStream(sequential_call_ids("x_"))
    final = ParseView(tool_calls=(ToolCallView("f", '{"a": 1}', True),))
    assert stream.finish(final) == [
        {"tool_calls": [{"index": 0, "id": "x_0", "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]
    assert stream.call_ids == ["x_0"]


def test_chat_default_ids_are_random() -> None:
    a, b = ChatDeltaStream(), ChatDeltaStream()
    view = ParseView(tool_calls=(ToolCallView("f", "{}", True),))
    a.update(view)
    b.update(view)
    assert a.call_ids[0].startswith("call_") and a.call_ids != b.call_ids


# ---------------------------------------------------------------------------
# AppendOnlyStream


def replay_blocks(pieces: list[str], framing: str | None = None, starts: bool = False,
                  tools: list | None = None) -> tuple[list, ParseView]:
    parser = OutputParser(framing, starts, tools)
    stream = AppendOnlyStream(sequential_call_ids())
    events: list = []
    for piece in pieces:
        parser.feed(piece)
        events += stream.update(parser.snapshot())
    final = parser.finish()
    return events + stream.finish(final), final


def blocks_of(events: list) -> list[tuple[str, str, str | None]]:
    """(kind, text, name) per block, checking that blocks never overlap."""
    open_index: int | None = None
    out: list[list[Any]] = []
    for event in events:
        if isinstance(event, BlockOpen):
            assert open_index is None and event.index == len(out)
            open_index = event.index
            out.append([event.kind, "", event.name])
        elif isinstance(event, BlockAppend):
            assert event.index == open_index and event.text
            out[-1][1] += event.text
        else:
            assert isinstance(event, BlockClose) and event.index == open_index
            assert event.text == out[-1][1]
            open_index = None
    assert open_index is None
    return [tuple(b) for b in out]  # type: ignore[misc]


def test_append_only_blocks_in_order() -> None:
    for pieces in splits(HERMES_TWO):
        events, final = replay_blocks(pieces, "hermes")
        assert blocks_of(events) == [
            ("reasoning", final.reasoning, None), ("text", final.content, None),
            ("tool_call", final.tool_calls[0].arguments_text, "get_weather"),
            ("tool_call", final.tool_calls[1].arguments_text, "write_file")]


def test_append_only_coder_call() -> None:
    for pieces in splits(CODER_CALL):
        events, final = replay_blocks(pieces, "qwen3_coder", True, TOOLS)
        assert blocks_of(events) == [("tool_call", final.tool_calls[0].arguments_text,
                                      "get_weather")]
        opened = [e for e in events if isinstance(e, BlockOpen)]
        assert opened[0].call_id == "call_0"


def test_append_only_never_takes_back() -> None:
    events, final = replay_blocks(["I think", "</think>", "Done", " now."])
    assert blocks_of(events) == [("text", "I think", None), ("reasoning", "I think", None)]
    assert final.content == "Done now."


def test_append_only_sends_a_reclassified_text_once_it_extends_again() -> None:
    stream = AppendOnlyStream(sequential_call_ids())
    events = stream.update(ParseView(content="ab"))
    assert stream.update(ParseView(content="x")) == []
    events += stream.update(ParseView(content="abc"))
    events += stream.finish(ParseView(content="abc"))
    assert blocks_of(events) == [("text", "abc", None)]


def test_append_only_text_waits_while_a_call_is_open() -> None:
    stream = AppendOnlyStream(sequential_call_ids())
    call = ToolCallView("f", '{"a": ', False)
    events = stream.update(ParseView(content="Hi", tool_calls=(call,)))
    events += stream.update(ParseView(content="Hi there", tool_calls=(call,)))
    assert [type(e).__name__ for e in events] == [
        "BlockOpen", "BlockAppend", "BlockClose", "BlockOpen", "BlockAppend"]
    done = ToolCallView("f", '{"a": 1}', True)
    events += stream.finish(ParseView(content="Hi there", tool_calls=(done,)))
    assert blocks_of(events) == [("text", "Hi", None), ("tool_call", '{"a": 1}', "f"),
                                 ("text", " there", None)]


def test_append_only_call_no_view_showed_arrives_whole() -> None:
    stream = AppendOnlyStream(sequential_call_ids("toolu_"))
    events = stream.update(ParseView(content="Hello"))
    final = ParseView(content="Hello", tool_calls=(ToolCallView("f", "", False),))
    events += stream.finish(final)
    assert blocks_of(events) == [("text", "Hello", None), ("tool_call", "", "f")]
    assert stream.call_ids == ["toolu_0"]
    assert events[-2] == BlockOpen(1, "tool_call", "toolu_0", "f")


def test_append_only_fallback_raw_is_text() -> None:
    events, final = replay_blocks(list("<tool_call>\nnope\n</tool_call>"), "hermes")
    assert final.fallback_raw
    assert blocks_of(events) == [("text", final.content, None)]


# ---------------------------------------------------------------------------
# random markup soup: whatever the model writes, the invariants hold

FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "<", "é🙂",
             "text", '{"name": "get_weather", "arguments": ', '{"city": "x"}', "{", "}",
             '"', "\\", ": ", ", ", "1", "<function=get_weather>", "<function=write_file>",
             "<parameter=city>", "<parameter=days>", "</parameter>", "</function>", "</thi"]


@pytest.mark.parametrize("framing", [None, "hermes", "qwen3_coder"])
def test_random_markup_keeps_the_invariants(framing: str | None) -> None:
    rng = random.Random(str(framing))
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 25)))
        starts = rng.random() < 0.5
        whole = run([text], framing, starts, TOOLS)[1]
        for pieces in (list(text), splits(text)[2]):
            views, final = run(pieces, framing, starts, TOOLS)
            assert final == whole, text
            assert_append_only_calls([*views, final])
            seen = client_view(replay_chat(pieces, framing, starts, TOOLS)[0])
            assert (seen["content"], seen["reasoning"]) == (final.content, final.reasoning)
            assert [c["arguments"] for _, c in sorted(seen["calls"].items())] == \
                [c.arguments_text for c in final.tool_calls]
            blocks_of(replay_blocks(pieces, framing, starts, TOOLS)[0])
