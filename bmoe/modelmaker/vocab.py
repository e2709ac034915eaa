"""The made model's vocabulary: a byte-level BPE trained on a small corpus of chat,
code and tool-call text, with the chat template's special tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import gguf

from bmoe.modelmaker.bpe import byte_to_unicode, train_merges

from .spec import N_MERGES, SPECIAL_TOKENS, TAG_TOKENS, VOCAB_MULTIPLE

# ---------------------------------------------------------------------------------------
# Vocabulary


_CORPUS = r'''
The quick brown fox jumps over the lazy dog. This is a small model that was made for the
tests of a local server. It has not been trained, so what it writes is not meant to be
read; the tests check shapes, protocols and the number of tokens, never the prose.
Hello world! Hello there, how are you today? I am fine, thank you. What is the weather
like in Paris and in London? It is sunny and warm in the morning, and it will rain in the
evening. Please answer the question with a short sentence. Here is the answer you asked
for, and here are the results of the search. The user wants to read the file and then
write the new content to the output. Let me think about this step by step before I call
the tool. First, we need to find the function; then we can return the value.
You may call one or more functions to assist with the user query. You are provided with
function signatures within <tools></tools> XML tags. For each function call, return a json
object with function name and arguments within XML tags. You have access to the following
tools. If you choose to call a tool ONLY reply in the following format with NO suffix.
Required parameters MUST be specified. You are a helpful assistant.

def main(argv: list[str]) -> int:
    """Read the input file and print the number of lines."""
    parser = argparse.ArgumentParser(description="count lines")
    parser.add_argument("--path", type=str, default=None)
    args = parser.parse_args(argv)
    if args.path is None:
        return 1
    with open(args.path, "r", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line]
    for i, line in enumerate(lines):
        print(f"{i}: {line}")
    return 0

class Server:
    def __init__(self, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.host = host
        self.port = port

    async def handle(self, request: dict) -> dict:
        return {"status": "ok", "result": self.port}

function get(url, options) { const result = await fetch(url, options); return result.json(); }
if (x == null || x.length === 0) { throw new Error("empty"); } else { console.log(x); }
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
{"type": "function", "function": {"name": "read_file", "description": "Read a file",
"parameters": {"type": "object", "properties": {"path": {"type": "string"}},
"required": ["path"]}}}
{"role": "user", "content": "What is the time?"}, {"role": "assistant", "content": null}
[{"id": 1, "value": true}, {"id": 2, "value": false}, {"id": 3, "value": 0.5}]
<function=read_file>
<parameter=path>
/tmp/data.json
</parameter>
</function>
0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 -1 1e-6 0x1F
'''


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]
    ids: dict[str, int]  # special and tag tokens by text
    suppressed: tuple[int, ...]  # ids free generation must not produce

    @property
    def size(self) -> int:
        return len(self.tokens)


@lru_cache(maxsize=2)
def build_vocab(control_tags: bool = False) -> Vocab:
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [int(gguf.TokenType.NORMAL)] * 256
    merges = train_merges(_CORPUS, N_MERGES)
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(int(gguf.TokenType.NORMAL))
    tag_type = gguf.TokenType.CONTROL if control_tags else gguf.TokenType.USER_DEFINED
    ids: dict[str, int] = {}
    for text, kind in [(t, gguf.TokenType.CONTROL) for t in SPECIAL_TOKENS] + [
        (t, tag_type) for t in TAG_TOKENS
    ]:
        ids[text] = len(tokens)
        tokens.append(text)
        types.append(int(kind))
    while len(tokens) % VOCAB_MULTIPLE:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return Vocab(
        tokens=tuple(tokens),
        types=tuple(types),
        merges=tuple(f"{a} {b}" for a, b in merges),
        ids=ids,
        suppressed=tuple(_suppressed_ids(tokens, types)),
    )


def _suppressed_ids(tokens: Sequence[str], types: Sequence[int]) -> Iterator[int]:
    u2b = {u: b for b, u in byte_to_unicode().items()}
    allowed_bytes = set(range(0x20, 0x7F)) | {0x09, 0x0A}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind != gguf.TokenType.NORMAL:
            yield i
        elif any(u2b[c] not in allowed_bytes for c in text):
            yield i


def special_token_ids(control_tags: bool = False) -> dict[str, int]:
    """Ids of the special and tag tokens (the same for every model the maker writes)."""
    return dict(build_vocab(control_tags).ids)
