"""`tool_choice: auto`'s lazy grammar takes hold at each family's marker, token or word.

In the real llama.cpp sampler (tests/trigger_worker.py, a child, so an abort shows as a
failed case): each family's call, written after some free text in the maker's vocabulary
(Qwen's special tokens, every other family's marker spelled in several tokens), holds
the grammar from the token that completes the marker, to the end of the call; Llama 3's
real vocabulary (the sdist's ``ggml-vocab-llama-bpe.gguf``) spells its markers in ordinary
tokens, and ``{"name"`` in a token that may run past it. And through the real engine:
a word the tiny model writes in two tokens triggers a grammar in generation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from _child import WorkerChild
from _llama_templates import vocab_gguf
from bmoe.engine import families
from bmoe.engine.families.grammar_calls import _json_family
from bmoe.engine.grammar import gbnf_literal as literal
from bmoe.engine.session import Session, TokenEvent
from bmoe.engine.triggers import Triggers, resolve, word_pattern

WORKER = Path(__file__).resolve().parent / "trigger_worker.py"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]
ARGS = '{"city": "Rome"}'
# get_weather(city="Rome") as each family's model writes it (the grammar's own spelling)
XML_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                   "</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
             "</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                  "Rome</parameter>\n</invoke>\n</minimax:tool_call>",
    "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜'
                    'parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜'
                    "invoke>\n</｜DSML｜function_calls>",
    "seed_oss": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n"
                "</function>\n</seed:tool_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>',
    "lfm2": '<|tool_call_start|>[get_weather(city="Rome")]<|tool_call_end|>',
    "apertus": '<|tools_prefix|>[{"get_weather": {"city": "Rome"}}]<|tools_suffix|>',
    "command_r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                   '"parameters": {"city": "Rome"}}]<|END_ACTION|>',
}
XML_CALLS["deepseek_v4"] = XML_CALLS["deepseek_v32"].replace("function_calls", "tool_calls")
JSON_FAMILIES = ["gpt_oss", "llama3", "mistral", "deepseek_v31", "deepseek_r1", "kimi_k2",
                 "generic"]
FREE = "Let me look that up. "


def call_text(framing: str) -> str:
    if framing in XML_CALLS:
        return XML_CALLS[framing]
    before, after = _json_family(framing, "get_weather")
    return before + ARGS + after


def test_every_family_is_covered() -> None:
    assert set(XML_CALLS) | set(JSON_FAMILIES) == set(families.FAMILIES)


vocab_file = vocab_gguf      # one of the sdist's vocabulary-only GGUFs (cached once)


@pytest.fixture(scope="module")
def maker_vocab(tiny_moe: Path) -> Iterator[WorkerChild]:
    child = WorkerChild(WORKER, str(tiny_moe), timeout_s=120)
    yield child
    child.close()


@pytest.fixture(scope="module")
def llama3_vocab() -> Iterator[WorkerChild]:
    child = WorkerChild(WORKER, str(vocab_file("llama-bpe")), timeout_s=300)
    yield child
    child.close()


def ask(child: WorkerChild, framing: str, text: str, **kw: object) -> dict:
    out = child.ask({"framing": framing, "tools": TOOLS, "text": text, **kw})
    assert not out.crashed, f"llama.cpp aborted (exit {out.returncode}) on {text!r}"
    assert not out.timed_out
    return out.answer


def completed_at(answer: dict, prefix: str) -> int:
    """The index of the token that completes `prefix` (its UTF-8 bytes: a byte token
    holds part of a character)."""
    n, total = len(prefix.encode()), 0
    for i, size in enumerate(answer["piece_bytes"]):
        total += size
        if total >= n:
            return i
    raise AssertionError(f"the text is shorter than {prefix!r}")


@pytest.mark.parametrize("framing", sorted(families.FAMILIES))
def test_the_grammar_holds_from_the_familys_marker(maker_vocab: WorkerChild,
                                                   framing: str) -> None:
    call = call_text(framing)
    words = [w for w in families.FAMILIES[framing].triggers if call.startswith(w)]
    assert words, f"{framing}: no marker of the family opens its call"
    answer = ask(maker_vocab, framing, FREE + call)
    assert answer["patterns"], answer
    # free text up to the marker; from the token completing it, the grammar holds
    assert answer["held_from"] == completed_at(answer, FREE + words[0]), answer
    assert answer["refused_at"] is None, answer          # the whole call is the grammar's
    assert answer["eog_allowed"], answer                 # ... and may end there


def test_a_single_token_marker_is_a_token_trigger(maker_vocab: WorkerChild) -> None:
    answer = ask(maker_vocab, "hermes", FREE + call_text("hermes"))
    assert len(answer["tokens"]) == 1 and "<tool_call>" in answer["pieces"]
    assert answer["held_from"] == answer["pieces"].index("<tool_call>")


def test_once_the_marker_is_written_the_call_must_follow(maker_vocab: WorkerChild) -> None:
    """As llama.cpp's WORD trigger: the marker, even in prose, opens the call (the model
    could not have written the prose after it)."""
    text = FREE + "<｜DSML｜function_calls> is how I would call it."
    answer = ask(maker_vocab, "deepseek_v32", text)
    assert answer["held_from"] == completed_at(answer, FREE + "<｜DSML｜function_calls>")
    assert answer["refused_at"] == answer["held_from"] + 1


def test_llama3_markers_are_words_in_its_real_vocabulary(llama3_vocab: WorkerChild) -> None:
    """The sdist's Llama 3 vocabulary (3.0: no ``<|python_tag|>`` token) spells both
    markers in ordinary tokens; the call takes hold after either."""
    tagged = ask(llama3_vocab, "llama3", FREE + "<|python_tag|>" + call_text("llama3"))
    assert tagged["tokens"] == [] and len(tagged["patterns"]) == 2
    assert tagged["held_from"] == completed_at(tagged, FREE + "<|python_tag|>")
    assert tagged["refused_at"] is None and tagged["eog_allowed"]
    plain = ask(llama3_vocab, "llama3", FREE + call_text("llama3"))
    assert plain["held_from"] == completed_at(plain, FREE + '{"name"')
    assert plain["refused_at"] is None and plain["eog_allowed"]


def test_a_word_whose_token_runs_where_the_grammar_cannot_go_is_no_trigger(
        llama3_vocab: WorkerChild) -> None:
    """Llama 3's BPE writes ``{"name":"`` with ``":"`` one token: past the word, text the
    grammar (``{"name": "``) refuses. The bare word as the pattern hands that text to
    the grammar and llama.cpp aborts; the engine's pattern leaves the text free."""
    text = FREE + '{"name":"get_weather","parameters":{"city":"Rome"}}'
    answer = ask(llama3_vocab, "llama3", text)
    assert any(p.startswith('":') and len(p) > 2 for p in answer["pieces"]), answer["pieces"]
    assert answer["held_from"] is None and answer["refused_at"] is None
    bare = llama3_vocab.ask({"framing": "llama3", "tools": TOOLS, "text": text,
                             "bare_words": True})
    assert bare.crashed


def test_the_pattern_follows_the_heads() -> None:
    heads = ['{"name": "a", ', '{"name": "b", ']
    assert word_pattern('{"name"', heads) == \
        '(\\{"name")(?:$|:(?:$| (?:$|"(?:$|a(?:$|"(?:$|,(?:$| $)))|b(?:$|"(?:$|,(?:$| $)))))))'
    assert word_pattern("<x>", heads) is None        # no call starts there: no trigger
    found = resolve(["<t>", "{w"], ["<t>\n", "{w}"], lambda w: [7] if w == "<t>" else [1, 2],
                    lambda t: "<t>")
    assert found.tokens == [7] and len(found.patterns) == 2
    assert not Triggers()


def test_a_word_written_in_two_tokens_triggers_in_generation(tiny_moe: Path) -> None:
    """The real engine: the tiny model's own free text, a word spanning its 2nd and 3rd
    tokens as the trigger, and a grammar forcing "xyz" after it."""
    s = Session(tiny_moe, {"ctx-size": 512, "threads": 1})
    try:
        prompt = s.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

        def gen(**kw: object) -> tuple[list[int], str, str]:
            events: list[TokenEvent] = []
            g = s.generate(prompt, max_tokens=20, cancel=threading.Event(),
                           on_token=events.append, **kw)
            return g.tokens, g.text, g.finish

        free, _, _ = gen()
        pieces = [s.token_text(t) for t in free[:3]]
        assert all(pieces), pieces
        word = pieces[1] + pieces[2]
        head = word + "xyz"
        grammar = f"root ::= {literal(head)}"
        pattern = word_pattern(word, [head])
        assert pattern is not None
        toks, text, finish = gen(grammar=grammar, grammar_patterns=[pattern])
        assert toks[:3] == free[:3]                # free text, then the word as before
        assert text == pieces[0] + word + "xyz" and finish == "stop"
        # a word the token completing it runs past, into text the call cannot hold:
        # the grammar is never handed it, the text stays free (and nothing aborts)
        assert len(pieces[2]) >= 2, pieces
        word = pieces[1] + pieces[2][0]
        pattern = word_pattern(word, [word + "~~"])
        assert pattern is not None
        toks, _, _ = gen(grammar=f"root ::= {literal(word + '~~')}", grammar_patterns=[pattern])
        assert toks == free
    finally:
        s.close()
