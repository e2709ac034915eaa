"""Where a lazy tool-call grammar takes hold: a family's marker, as a token or as a word.

Theory of operation
-------------------
With ``tool_choice: auto`` the model writes free text until it opens a call; from the
family's marker on, the call is held to the grammar (as llama.cpp's server does). llama.cpp's
lazy grammar sampler (``llama_sampler_init_grammar_lazy_patterns``) waits for either

* a **token**: the marker is one token of the vocabulary (``<tool_call>`` in Qwen's,
  ``<|python_tag|>`` in Llama 3's), which the grammar then accepts as its first piece; or
* a **pattern**: an ECMAScript regex searched in the text written so far, after each token;
  from the pattern's first capture group on, that text is fed to the grammar. This is
  how a marker spelled in several tokens (DeepSeek V3.2's ``<｜DSML｜function_calls>``,
  Llama 3's ``{"name"``, ``[TOOL_CALLS]`` in a vocabulary without it) takes hold:
  llama.cpp's ``common_grammar_trigger`` WORD type is the escaped word.

What the grammar is fed at that moment must be a beginning it holds: llama.cpp throws
across its C API when the grammar refuses it, and the process ends. The token that
completes a word may run past it (``"name":`` after ``{"name"``), so a pattern here is
not the bare word: it matches only when the text from the word to the end is still a
prefix of one of the calls' *heads* (`families.grammar_calls.tool_call_heads`: the literal text each
call starts with, up to its arguments). A word written otherwise is simply no call: the
text stays free. A word no head starts with (a marker of another form the grammar does
not write) is no trigger at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# the characters ECMAScript gives a meaning outside a class (llama.cpp's regex_escape)
_SPECIAL = frozenset(".^$|()*+?[]{}\\")
# What follows the word within the token that completes it is one token's piece at most:
# the heads are checked that far (a longer piece is no trigger, the text stays free).
# A pattern's size is bounded too: many tools with long names make a wide trie.
REST_CHARS = 48
MAX_PATTERN_CHARS = 64 * 1024


@dataclass
class Triggers:
    tokens: list[int] = field(default_factory=list)
    patterns: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.patterns)


def escape(text: str) -> str:
    """`text` as an ECMAScript regex that matches it literally."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def _prefixes(rests: Iterable[str]) -> str:
    """A regex matching, up to the end of the text, any prefix of any of `rests`
    (the empty one too)."""
    trie: dict[str, dict] = {}
    for rest in rests:
        node = trie
        for c in rest:
            node = node.setdefault(c, {})

    def emit(node: dict[str, dict]) -> str:
        if not node:
            return "$"
        return "(?:$|" + "|".join(escape(c) + emit(child) for c, child in sorted(node.items())) + ")"

    return emit(trie)


def word_pattern(word: str, heads: Iterable[str]) -> str | None:
    """The pattern that takes hold at `word` when what follows it, to the end of the text,
    still begins one of `heads`; None when no head starts with `word`."""
    rests = sorted({h[len(word):len(word) + REST_CHARS] for h in heads
                    if word and h.startswith(word)})
    if not rests:
        return None
    pattern = f"({escape(word)}){_prefixes(rests)}"
    return pattern if len(pattern) <= MAX_PATTERN_CHARS else None


def resolve(words: Iterable[str], heads: list[str], tokenize: Callable[[str], list[int]],
            piece: Callable[[int], str]) -> Triggers:
    """Each of the family's marker `words` as this vocabulary holds it: the token when it
    is one (and its piece is the word), and always the word's pattern as well, so the
    marker spelled in ordinary tokens takes hold too (as llama.cpp's WORD triggers do)."""
    out = Triggers()
    for word in words:
        pattern = word_pattern(word, heads)
        if pattern is None:
            continue
        toks = tokenize(word)
        if len(toks) == 1 and piece(toks[0]) == word and toks[0] not in out.tokens:
            out.tokens.append(toks[0])
        if pattern not in out.patterns:
            out.patterns.append(pattern)
    return out
