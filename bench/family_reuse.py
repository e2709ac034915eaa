"""Does a family's template keep turn 1 as the model wrote it? The KV prefix reuse per template.

For each real chat template of the pinned llama-cpp-python sdist (``models/templates/``),
its family as the engine detects it, and a two-turn conversation: turn 1 is the user's
question with one tool offered and the model's answer in the family's own syntax
(reasoning, then a call); turn 2 is that conversation replayed (the answer as the client
sends it back: ``reasoning_content`` and ``tool_calls``) with the tool's result. The KV after
turn 1 holds turn 1's prompt and answer; turn 2 reuses the common prefix of its prompt
with those tokens and recomputes the rest. This prints, for each template, the tokens of
turn 1 (the baseline, measured in the same run), the common prefix, their ratio, and
where turn 2 first differs. A ratio below 100 % means the template re-renders turn 1
differently (it drops or moves the old reasoning, writes the call another way): the
tokens after the divergence are prefilled again on every turn.

Tokens are those of the project's model maker's vocabulary (Qwen's special tokens, every
other family's markup in byte-level tokens), so counts are larger than a real model's
for non-Qwen families; the common prefix is the common text, counted in those tokens.
The divergence point and whether the ratio is 100 % are the result.

Two answers are measured: (a) the template's own rendering of the answer as the
conversation's last message (what its model was trained to write); and, where that
answer holds no reasoning, (b) a reasoning model's answer in the family's syntax
(reasoning, then the call): a template that never writes reasoning back loses the KV from
the reasoning on, every turn.

    python bench/family_reuse.py [--markdown]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import llama_cpp as lc  # noqa: E402

from _llama_templates import templates_dir  # noqa: E402
from bmoe.engine import families  # noqa: E402
from bmoe.engine.chatparse import detect_framing  # noqa: E402
from bmoe.engine.families.grammar_calls import _json_family  # noqa: E402
from bmoe.engine.templating import ChatTemplate, TemplateError  # noqa: E402
from bmoe.modelmaker import make_model  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Rome?"}]
REASONING = "The user wants the weather in Rome. I should call get_weather."
ARGS = {"city": "Rome"}
CALL_IDS = {"kimi_k2": "functions.get_weather:0", "mistral": "a1b2c3d4e"}
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


def call_text(framing: str) -> str:
    if framing in XML_CALLS:
        return XML_CALLS[framing]
    if framing == "mistral":
        return '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}'
    before, after = _json_family(framing, "get_weather")
    return before + '{"city": "Rome"}' + after


def answer_text(framing: str, prompt: str) -> str:
    """Turn 1's answer as the family's model writes it: reasoning, then the call."""
    if framing == "gpt_oss":
        return (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
                f"{call_text(framing)}<|call|>")
    opener, closer = families.reasoning_markers(framing)
    if families.ends_inside_reasoning(framing, prompt):
        head = "" if prompt.endswith("\n") else "\n"
    else:
        head = opener + "\n"
    return f"{head}{REASONING}\n{closer}\n\n" + call_text(framing)


class Vocab:
    """The maker's vocabulary, loaded alone, to count tokens."""

    def __init__(self, model: Path) -> None:
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(model).encode(), params)
        self.vocab = lc.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, False, True)
        return list(buf[:n])


def _silence() -> None:
    @lc.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        pass
    _silence.keep = _log  # type: ignore[attr-defined]
    lc.llama_log_set(_log, ctypes.c_void_p(0))


def framing_of(template: ChatTemplate, text: str) -> str:
    named = families.detect(text)
    if named is not None:
        return named
    try:
        return detect_framing(lambda m, t: template.render(m, tools=t, add_generation_prompt=False)) \
            or families.GENERIC
    except TemplateError:
        return families.GENERIC


def reuse(vocab: Vocab, first: str, answer: str, second: str) -> dict[str, Any]:
    """Turn 2's common prefix with turn 1's prompt and answer (the KV), in tokens."""
    kv = vocab.tokenize(first) + vocab.tokenize(answer)
    full = first + answer
    at = next((i for i, (x, y) in enumerate(zip(full, second, strict=False)) if x != y),
              min(len(full), len(second)))
    # the common text in tokens: the maker's vocabulary spells other families' special
    # tokens in bytes, which merge across the prompt / answer boundary where a real
    # vocabulary's special token would not; counting the common text keeps that out
    n = min(len(kv), len(vocab.tokenize(full[:at])))
    where = "" if n >= len(kv) else \
        f"…{full[max(0, at - 16):at]}⟨{full[at:at + 14]} → {second[at:at + 14]}⟩"
    # past the call's last argument only its closing markup and the end of the turn
    # follow (the KV holds no end-of-turn token: the model stops there)
    after_call = at >= full.rfind(ARGS["city"]) + len(ARGS["city"])
    return {"turn1": len(kv), "common": n, "ratio": n / len(kv) if kv else 0.0,
            "where": where, "after_call": after_call}


def measure(path: Path, vocab: Vocab) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    template = ChatTemplate(text)
    framing = framing_of(template, text)
    row: dict[str, Any] = {"template": path.stem, "family": framing}
    extra = families.effort_kwargs("medium") if framing == "gpt_oss" else None

    def render(messages: list[dict[str, Any]], prompt: bool = True) -> str:
        out = template.render(families.template_messages(framing, messages), tools=TOOLS,
                              enable_thinking=True, add_generation_prompt=prompt, extra=extra)
        return families.finish_prompt(framing, out, prompt)

    call = {"id": CALL_IDS.get(framing, "call_0"), "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS}}
    said = {"role": "assistant", "content": "", "reasoning_content": REASONING,
            "tool_calls": [call]}
    try:
        first = render(QUESTION)
        # (a) the answer as the template itself writes it as the conversation's last
        # message (what its model was trained to write), up to its end of turn
        own = render([*QUESTION, said], prompt=False)
        second = render([*QUESTION, said, {"role": "tool", "tool_call_id": call["id"],
                                           "content": "sunny, 24 C"}])
    except (TemplateError, jinja_errors()) as e:
        row["error"] = str(e).splitlines()[0][:80]
        return row
    if own.startswith(first) and len(own) > len(first):
        row["own"] = reuse(vocab, first, own[len(first):], second)
        row["own_reasoning"] = REASONING in own[len(first):]
    # (b) the answer as a reasoning model of the family writes it: its reasoning, then
    # the call in the family's syntax (as the engine's grammar writes it)
    row["thinking"] = reuse(vocab, first, answer_text(framing, first), second)
    row["replayed"] = REASONING in second
    return row


def jinja_errors() -> type[Exception]:
    import jinja2
    return jinja2.TemplateError


def show(s: str) -> str:
    return s.replace("\n", "\\n").replace("|", "\\|")


def verdict(r: dict[str, Any]) -> str:
    own = r.get("own")
    if own is None:
        return "its own answer does not continue its prompt (b: the family's)"
    if own["ratio"] >= 1.0:
        return "kept whole"
    if own["after_call"]:
        return "kept to the end of the call"
    return "re-rendered"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    _silence()
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Vocab(make_model(Path(tmp) / "tiny.gguf"))
        rows = [measure(p, vocab) for p in sorted(templates_dir().glob("*.jinja"))]
    rows.sort(key=lambda r: (r["family"], r["template"]))
    if args.markdown:
        print("| Template | Family | (a) turn 1 / common / reused | Turn 1 in turn 2 | (a) turn 2 differs at "
              "| Writes reasoning | (b) a reasoning answer: reused |")
        print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['template']} | {r['family']} | refused: {show(r['error'])} | | | | |"
                  if args.markdown else
                  f"{r['template']:<46} {r['family']:<13} template refused: {r['error']}")
            continue
        own, thinking = r.get("own"), r["thinking"]
        a = f"{own['turn1']} / {own['common']} / {own['ratio']:.0%}" if own else "—"
        where = own["where"] if own else thinking["where"]
        writes = "yes" if r.get("own_reasoning") else "no"
        # (b) only where the template writes no reasoning of its own (else its numbers
        # would only say how this script's whitespace differs from the template's)
        b = "—" if r.get("own_reasoning") else \
            f"{thinking['common']} of {thinking['turn1']} ({thinking['ratio']:.0%})"
        if args.markdown:
            print(f"| {r['template']} | {r['family']} | {a} | {verdict(r)} | {show(where)} | "
                  f"{writes} | {b} |")
        else:
            print(f"{r['template']:<46} {r['family']:<13} (a) {a:<20} {verdict(r):<28} "
                  f"reasoning {writes:<3} (b) {b:<16} {where!r}")
    ok = [r for r in rows if "error" not in r]
    kept = [r for r in ok if verdict(r) in ("kept whole", "kept to the end of the call")]
    dropping = [r for r in ok if not r.get("own_reasoning")]
    print(f"\n{len(ok)} templates rendered ({len(rows) - len(ok)} refused the conversation): "
          f"{len(kept)} keep turn 1 as they write it; {len(dropping)} write no reasoning "
          f"into an answer, so a model that reasons loses the KV from its reasoning on "
          f"(mean reuse {sum(r['thinking']['ratio'] for r in dropping) / max(1, len(dropping)):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
