"""A byte-level BPE trainer: the merges of the model maker's tiny vocabulary.

GPT-2's byte-to-unicode map and Qwen2's pre-tokenizer (with Python `re` classes
standing in for \\p{L} and \\p{N}), then the most frequent pair merged, again and again
(a heap of pair counts, updated for the words each merge touches).
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import lru_cache

# Qwen2's pre-tokenizer, with Python `re` classes standing in for \p{L} and \p{N}.
_PRETOKEN = re.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n\w]|_)?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pretokens(text: str) -> Counter[tuple[str, ...]]:
    b2u = byte_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for piece in _PRETOKEN.findall(text):
        words[tuple(b2u[b] for b in piece.encode("utf-8"))] += 1
    return words


def _pairs(word: Sequence[str]) -> Iterator[tuple[str, str]]:
    return zip(word[:-1], word[1:], strict=False)


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training; ties go to the lexicographically smallest pair."""
    counted = _pretokens(text)
    words = [list(w) for w in counted]
    freqs = list(counted.values())
    counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, word in enumerate(words):
        for pair in _pairs(word):
            counts[pair] += freqs[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < n_merges:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < 2:
            break
        merges.append(pair)
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, ())):
            for old in _pairs(words[i]):
                counts[old] -= freqs[i]
                touched.add(old)
            words[i] = _merge_word(words[i], pair)
            for new in _pairs(words[i]):
                counts[new] += freqs[i]
                where.setdefault(new, set()).add(i)
                touched.add(new)
        counts.pop(pair, None)
        for p in touched:
            if counts.get(p, 0) > 0:
                heapq.heappush(heap, (-counts[p], p))
    return merges


def _merge_word(word: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out
