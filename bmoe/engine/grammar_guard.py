"""The guard in front of llama.cpp's grammar parser: no grammar it cannot hold gets in.

Theory of operation
-------------------
llama.cpp parses GBNF with a recursive-descent parser (one C++ call frame pair per
nested group), expands every repetition ``S{m,n}`` into ``m`` copies plus ``n - m``
generated rules, and walks rule chains recursively when it checks for left recursion
and advances its parse stacks. A grammar nested tens of thousands deep overflows the
calling thread's stack: a segmentation fault that takes the whole server down, not an
error (measured: ``bench/grammar_limits.py``). So every grammar, ours or a client's, is
read here first by a parser that follows llama.cpp's syntax exactly but walks with an
explicit stack, and refused with a sentence when it is over a limit:

- its size in bytes (``MAX_GRAMMAR_BYTES``) and that it is text llama.cpp can take
  (no NUL, valid UTF-8);
- the nesting depth of groups (``MAX_NESTING``);
- the rules llama.cpp will hold after expanding groups and repetitions
  (``MAX_RULES``) and their total length in elements (``MAX_ELEMENTS``);
- a repetition count above llama.cpp's own threshold (2000, refused there too);
- token references ``<[id]>`` outside the vocabulary;
- a long run of items that may each match nothing (``("a"?){0,500}``, or 200 optional
  items in a row): llama.cpp's parser follows every way of skipping them, which grows
  steeply (measured: a run of 32 takes 64 ms to build, 64 takes 0.5 s, 200 takes 8.5 s,
  500 did not finish in 20 s) and would hold the engine thread, which no cancel reaches
  inside llama.cpp (``MAX_NULLABLE_RUN``).

A grammar that passes may still be one llama.cpp refuses (an undefined rule, left
recursion): that is a clean refusal from llama.cpp, which this module also predicts
where it cheaply can (undefined rules, a missing ``root``) so the message says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

# A symbol, for the nullable analysis: ("t",) a terminal, ("e",) the empty literal,
# ("r", name) a rule, ("g", "#k") a group, ("rep", atom, low, high) a repetition.
Atom = tuple[Union[str, int, None, "Atom"], ...]

# Limits, each with a wide margin under what crashed or stalled llama.cpp when measured
# (bench/grammar_limits.py prints the measurements; docs/grammar-limits.md has them).
MAX_GRAMMAR_BYTES = 4 * 1024 * 1024     # bytes of GBNF text
MAX_NESTING = 2_500                     # groups inside groups
MAX_RULES = 40_000                      # rules after llama.cpp's expansion
MAX_ELEMENTS = 4_000_000                # grammar elements after expansion
MAX_NULLABLE_RUN = 32                   # consecutive items that may match nothing
LLAMA_REPETITION_THRESHOLD = 2_000      # llama.cpp's MAX_REPETITION_THRESHOLD


class GrammarRefused(ValueError):
    """A grammar the guard will not hand to llama.cpp; ``str()`` is the reason."""


@dataclass
class GrammarStats:
    nbytes: int
    rules: int          # after expansion, as llama.cpp will hold them
    elements: int
    max_nesting: int
    defined: frozenset[str]


def check_grammar(text: object, *, n_vocab: int | None = None) -> GrammarStats:
    """Read ``text`` as llama.cpp would and raise GrammarRefused if it is over a limit."""
    if not isinstance(text, str):
        raise GrammarRefused("A grammar must be a string of GBNF text.")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarRefused("The grammar is not valid Unicode text (it holds an unpaired "
                             "surrogate).") from None
    if len(data) > MAX_GRAMMAR_BYTES:
        raise GrammarRefused(f"The grammar is {len(data):,} bytes; the limit is "
                             f"{MAX_GRAMMAR_BYTES:,}.")
    if "\x00" in text:
        raise GrammarRefused("The grammar holds a NUL character; write it as \\x00.")
    stats = _Reader(text, n_vocab).read()
    stats.nbytes = len(data)
    return stats


# ---------------------------------------------------------------------------
# The reader: llama.cpp's grammar syntax, walked without recursion.

_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_DIGITS = frozenset("0123456789")
_ESCAPES = {"t", "r", "n", "\\", '"', "[", "]", "-"}
_HEX = {"x": 2, "u": 4, "U": 8}
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")


@dataclass
class _Seq:
    """One sequence being read: its element count and what its last symbol was."""
    elements: int = 0
    last: int = 0            # elements of the last symbol (0: none yet)
    last_rules: int = 1      # rules that symbol stands for (llama.cpp's n_prev_rules)
    rules_before: int = 0    # rule count when the enclosing group opened
    alternates: int = 0      # elements of the finished alternates of this group
    atoms: list[Atom] = field(default_factory=list)        # this alternative's symbols
    alts: list[list[Atom]] = field(default_factory=list)   # the finished alternatives


class _Reader:
    def __init__(self, text: str, n_vocab: int | None) -> None:
        self.s, self.i, self.n = text, 0, len(text)
        self.n_vocab = n_vocab
        self.rules = 0
        self.elements = 0
        self.max_nesting = 0
        self.defined: set[str] = set()
        self.referenced: dict[str, int] = {}
        self.defs: dict[str, list[list[Atom]]] = {}   # rules and groups: alternatives

    # -- errors and small readers ------------------------------------------------

    def fail(self, what: str) -> GrammarRefused:
        line = self.s.count("\n", 0, self.i) + 1
        return GrammarRefused(f"The grammar cannot be read at line {line}: {what}.")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < self.n else ""

    def space(self, newline_ok: bool) -> None:
        s, n = self.s, self.n
        while self.i < n:
            c = s[self.i]
            if c == "#":
                while self.i < n and s[self.i] not in "\r\n":
                    self.i += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                self.i += 1
            else:
                return

    def name(self) -> str:
        start = self.i
        while self.i < self.n and self.s[self.i] in _WORD:
            self.i += 1
        if self.i == start:
            raise self.fail("expected a rule name")
        return self.s[start:self.i]

    def integer(self) -> int:
        start = self.i
        while self.i < self.n and self.s[self.i] in _DIGITS:
            self.i += 1
        if self.i == start:
            raise self.fail("expected a number")
        digits = self.s[start:self.i]
        if len(digits) > 12:
            raise self.fail("a repetition count is too large")
        return int(digits)

    def char(self) -> None:
        """One character of a literal or class, escapes included."""
        if self.i >= self.n:
            raise self.fail("unexpected end of the grammar")
        if self.s[self.i] != "\\":
            self.i += 1
            return
        code = self.peek(1)
        if code in _HEX:
            digits = self.s[self.i + 2:self.i + 2 + _HEX[code]]
            if len(digits) != _HEX[code] or not set(digits) <= _HEXDIGITS:
                raise self.fail(f"\\{code} needs {_HEX[code]} hex digits")
            self.i += 2 + _HEX[code]
        elif code in _ESCAPES:
            self.i += 2
        else:
            raise self.fail(f"unknown escape \\{code}")

    # -- the grammar ---------------------------------------------------------------

    def read(self) -> GrammarStats:
        self.space(True)
        while self.i < self.n:
            self.rule()
        if "root" not in self.defined:
            raise GrammarRefused("The grammar has no 'root' rule.")
        missing = sorted(set(self.referenced) - self.defined)
        if missing:
            raise GrammarRefused(f"The grammar uses the rule {missing[0]!r} but never "
                                 "defines it.")
        _check_nullable_runs(self.defs)
        _check_left_recursion(self.defs)
        return GrammarStats(0, self.rules, self.elements, self.max_nesting,
                            frozenset(self.defined))

    def rule(self) -> None:
        name = self.name()
        self.space(False)
        if self.s[self.i:self.i + 3] != "::=":
            raise self.fail(f"expected ::= after the rule name {name!r}")
        self.i += 3
        self.space(True)
        self.defined.add(name)
        self.add_rule()
        self.defs[name] = self.alternates()
        if self.peek() == "\r":
            self.i += 2 if self.peek(1) == "\n" else 1
        elif self.peek() == "\n":
            self.i += 1
        elif self.i < self.n:
            raise self.fail("expected the end of the line after a rule")
        self.space(True)

    def add_rule(self, count: int = 1) -> None:
        self.rules += count
        if self.rules > MAX_RULES:
            raise GrammarRefused(f"The grammar expands to more than {MAX_RULES:,} rules "
                                 "(groups and repetitions each add rules).")

    def add_elements(self, count: int) -> None:
        self.elements += count
        if self.elements > MAX_ELEMENTS:
            raise GrammarRefused(f"The grammar expands to more than {MAX_ELEMENTS:,} "
                                 "elements; lower its repetition counts.")

    def alternates(self) -> list[list[Atom]]:
        """A rule's body: sequences separated by '|', groups read with an explicit stack."""
        stack: list[_Seq] = [_Seq(rules_before=self.rules)]
        while True:
            seq = stack[-1]
            nested = len(stack) > 1
            opened = self.sequence(seq, nested)
            if opened:
                if len(stack) > MAX_NESTING:
                    raise GrammarRefused(f"The grammar nests groups more than {MAX_NESTING:,} "
                                         "deep.")
                self.max_nesting = max(self.max_nesting, len(stack))
                self.space(True)
                self.add_rule()
                stack.append(_Seq(rules_before=self.rules - 1))
                continue
            if self.peek() == "|":
                self.i += 1
                seq.alternates += seq.elements + 1
                self.add_elements(seq.elements + 1)
                seq.elements, seq.last, seq.last_rules = 0, 0, 1
                seq.alts.append(seq.atoms)
                seq.atoms = []
                self.space(True)
                continue
            self.add_elements(seq.elements + 1)
            seq.alts.append(seq.atoms)
            if not nested:
                return seq.alts
            if self.peek() != ")":
                raise self.fail("expected ')'")
            self.i += 1
            stack.pop()
            parent = stack[-1]
            parent.elements += 1
            parent.last = 1
            parent.last_rules = max(1, self.rules - seq.rules_before)
            group = f"#{len(self.defs)}"
            self.defs[group] = seq.alts
            parent.atoms.append(("g", group))
            self.space(len(stack) > 1)
            self.repetitions(parent, len(stack) > 1)

    def sequence(self, seq: _Seq, nested: bool) -> bool:
        """Symbols until the sequence ends; True when a '(' opened a group."""
        while self.i < self.n:
            c = self.s[self.i]
            if c == '"':
                self.i += 1
                count = 0
                while self.peek() != '"':
                    self.char()
                    count += 1
                self.i += 1
                self.symbol(seq, count, ("t",) if count else ("e",))
            elif c == "[":
                self.i += 1
                if self.peek() == "^":
                    self.i += 1
                count = 0
                while self.peek() != "]":
                    self.char()
                    count += 1
                    if self.peek() == "-" and self.peek(1) != "]":
                        if self.i + 1 >= self.n:
                            raise self.fail("unexpected end of the grammar")
                        self.i += 1
                        self.char()
                        count += 1
                self.i += 1
                self.symbol(seq, max(count, 1), ("t",))
            elif c in "<!":
                self.token()
                self.symbol(seq, 1, ("t",))
            elif c in _WORD:
                ref = self.name()
                self.referenced.setdefault(ref, self.i)
                self.symbol(seq, 1, ("r", ref))
            elif c == "(":
                self.i += 1
                return True
            elif c == ".":
                self.i += 1
                self.symbol(seq, 1, ("t",))
            elif c in "*+?{":
                self.repetitions(seq, nested)
                continue
            else:
                return False
            self.space(nested)
            self.repetitions(seq, nested)
        return False

    def symbol(self, seq: _Seq, elements: int, atom: Atom) -> None:
        seq.atoms.append(atom)
        seq.elements += elements
        seq.last = elements
        seq.last_rules = 1

    def token(self) -> None:
        if self.peek() == "!":
            self.i += 1
        if self.peek() != "<":
            raise self.fail("expected '<' to open a token")
        self.i += 1
        if self.peek() == "[":
            self.i += 1
            token_id = self.integer()
            if self.peek(0) != "]" or self.peek(1) != ">":
                raise self.fail("expected ']>' to close a token id")
            self.i += 2
            if self.n_vocab is not None and token_id >= self.n_vocab:
                raise GrammarRefused(f"The grammar names token {token_id}; this model's "
                                     f"vocabulary has {self.n_vocab} tokens.")
            return
        end = self.s.find(">", self.i)
        if end < 0:
            raise self.fail("expected '>' to close a token")
        self.i = end + 1

    def repetitions(self, seq: _Seq, nested: bool) -> None:
        """Any '*', '+', '?' or '{m,n}' after the last symbol, as llama.cpp expands them."""
        while self.i < self.n and self.s[self.i] in "*+?{":
            c = self.s[self.i]
            self.i += 1
            self.space(nested)
            if c == "*":
                low, high = 0, None
            elif c == "+":
                low, high = 1, None
            elif c == "?":
                low, high = 0, 1
            else:
                low, high = self.braces(nested)
            self.expand(seq, low, high)

    def braces(self, nested: bool) -> tuple[int, int | None]:
        low = self.integer()
        self.space(nested)
        high: int | None = None
        if self.peek() == "}":
            high = low
        elif self.peek() == ",":
            self.i += 1
            self.space(nested)
            if self.peek() in _DIGITS and self.peek():
                high = self.integer()
                self.space(nested)
            if self.peek() != "}":
                raise self.fail("expected '}'")
        else:
            raise self.fail("expected ',' or '}' in a repetition")
        self.i += 1
        self.space(nested)
        if high is not None and high < low:
            # llama.cpp computes high - low unsigned: {2000,500} loops (almost) forever.
            raise GrammarRefused(f"The grammar has a repetition {{{low},{high}}} whose "
                                 "maximum is below its minimum.")
        if low > LLAMA_REPETITION_THRESHOLD:
            raise GrammarRefused(f"The grammar repeats something at least {low:,} times; "
                                 f"llama.cpp allows {LLAMA_REPETITION_THRESHOLD:,}.")
        if high is not None and high > LLAMA_REPETITION_THRESHOLD:
            high = None  # llama.cpp reads a larger maximum as unbounded
        return low, high

    def expand(self, seq: _Seq, low: int, high: int | None) -> None:
        prev = seq.last
        if prev == 0:
            raise self.fail("a repetition needs something before it")
        total = high if high else (low if low > 0 else 1)
        if seq.last_rules * total > LLAMA_REPETITION_THRESHOLD:
            raise GrammarRefused("The grammar repeats a group that holds many rules too many "
                                 "times; lower the repetition count.")
        optional = 1 if high is None else high - low
        # S{m,n} becomes m copies of S and a reference to the first of n - m new rules,
        # each `S' ::= S S'' |` (llama.cpp's handle_repetitions).
        grown = (low * prev if low > 0 else 0) + (1 if optional else 0)
        if self.elements + seq.elements + grown > MAX_ELEMENTS:
            self.add_elements(seq.elements + grown)
        self.add_elements(optional * (prev + 3))
        self.add_rule(optional)
        seq.elements += grown - prev
        seq.last = grown
        seq.last_rules *= total
        if grown == 0:
            seq.atoms.pop()
        else:
            seq.atoms[-1] = ("rep", seq.atoms[-1], low, high)


# ---------------------------------------------------------------------------
# Runs of items that may match nothing


def _check_nullable_runs(defs: dict[str, list[list[Atom]]]) -> None:
    nullable = _nullable(defs)
    widths: dict[str, int] = {}
    for name in defs:
        if _run_width(name, defs, nullable, widths) > MAX_NULLABLE_RUN:
            raise GrammarRefused(
                "The grammar has a run of more than "
                f"{MAX_NULLABLE_RUN} items in a row that may each match nothing (such as "
                '("a"?){0,500}); llama.cpp would spend minutes trying every way to skip '
                "them. Make the repeated item non-empty or the count smaller.")


def _target(atom: Atom) -> Atom | None:
    """What decides whether ``atom`` can be empty: ("t",) never, ("e",) always, or a def."""
    while atom[0] == "rep":
        if atom[2] == 0:
            return ("e",)
        atom = atom[1]  # type: ignore[assignment]
    return atom


def _nullable(defs: dict[str, list[list[Atom]]]) -> set[str]:
    """Defs that can match the empty text: a worklist over the alternatives (linear)."""
    waiting: dict[str, list[tuple[str, int]]] = {}
    pending: dict[tuple[str, int], int] = {}
    done: set[str] = set()
    work: list[str] = []
    for name, alts in defs.items():
        for k, alt in enumerate(alts):
            needs = []
            for atom in alt:
                t = _target(atom)
                if t is None or t[0] == "t":
                    break
                if t[0] != "e":
                    needs.append(str(t[1]))
            else:
                pending[(name, k)] = len(needs)
                for dep in needs:
                    waiting.setdefault(dep, []).append((name, k))
                if not needs and name not in done:
                    done.add(name)
                    work.append(name)
    while work:
        for owner, k in waiting.get(work.pop(), ()):
            pending[(owner, k)] -= 1
            if pending[(owner, k)] == 0 and owner not in done:
                done.add(owner)
                work.append(owner)
    return done


_CAP = 1 << 30


def _run_width(root: str, defs: dict[str, list[list[Atom]]], nullable: set[str],
               widths: dict[str, int]) -> int:
    """The longest run of consecutive possibly-empty items inside ``root`` (a possibly-
    empty reference counts with the run inside it), without recursion: an explicit
    post-order walk; a def met again while it is being measured counts as 1."""
    if root in widths:
        return widths[root]
    on_path: set[str] = {root}
    stack: list[str] = [root]
    while stack:
        name = stack[-1]
        missing = [d for d in _deps(defs[name], nullable)
                   if d not in widths and d not in on_path and d in defs]
        if missing:
            on_path.add(missing[0])
            stack.append(missing[0])
            continue
        widths[name] = max((_alt_run(alt, nullable, widths) for alt in defs[name]), default=0)
        on_path.discard(name)
        stack.pop()
    return widths[root]


def _deps(alts: list[list[Atom]], nullable: set[str]) -> list[str]:
    out = []
    for alt in alts:
        for atom in alt:
            while atom[0] == "rep":
                atom = atom[1]  # type: ignore[assignment]
            if atom[0] in ("r", "g") and atom[1] in nullable:
                out.append(str(atom[1]))
    return out


def _alt_run(alt: list[Atom], nullable: set[str], widths: dict[str, int]) -> int:
    best = run = 0
    for atom in alt:
        w = _width(atom, nullable, widths)
        run = run + w if w else 0
        best = max(best, run)
    return min(best, _CAP)


def _width(atom: Atom, nullable: set[str], widths: dict[str, int]) -> int:
    """0 for an item that cannot be empty; else how many empty-able steps it stands for."""
    kind = atom[0]
    if kind == "t":
        return 0
    if kind == "e":
        return 1
    if kind in ("r", "g"):
        name = str(atom[1])
        return max(1, widths.get(name, 1)) if name in nullable else 0
    inner, low, high = atom[1], int(atom[2]), atom[3]  # type: ignore[arg-type]
    w = _width(inner, nullable, widths)  # type: ignore[arg-type]
    if w == 0:
        return 1 if low == 0 else 0
    count = low + (int(high) - low if high is not None else 1)  # type: ignore[arg-type]
    return min(w * max(count, 1), _CAP)


# ---------------------------------------------------------------------------
# Left recursion


def _check_left_recursion(defs: dict[str, list[list[Atom]]]) -> None:
    """Refuse a rule that can reach itself before matching anything (``root ::= x "a"``,
    ``x ::= y? root``): llama.cpp expands such a rule without end — measured, a fuzzed
    grammar of 840 bytes grew the process until the kernel killed it."""
    nullable = _nullable(defs)
    leads = {name: _leading(alts, nullable) for name, alts in defs.items()}
    state: dict[str, int] = {}          # 1: on the walk's path, 2: done
    for start in defs:
        if start in state:
            continue
        state[start] = 1
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            name, k = stack[-1]
            nexts = leads[name]
            if k == len(nexts):
                state[name] = 2
                stack.pop()
                continue
            stack[-1] = (name, k + 1)
            target = nexts[k]
            if target not in defs:
                continue
            if state.get(target) == 1:
                rule = next((n for n, _ in stack if not n.startswith("#")), target)
                raise GrammarRefused(
                    f"The grammar is left-recursive through the rule {rule!r} (it can reach "
                    "itself before matching any text), which llama.cpp cannot hold.")
            if target not in state:
                state[target] = 1
                stack.append((target, 0))


def _leading(alts: list[list[Atom]], nullable: set[str]) -> list[str]:
    """The defs each alternative can start with: its atoms up to the first that cannot
    match the empty text."""
    out: list[str] = []
    for alt in alts:
        for atom in alt:
            inner = atom
            while inner[0] == "rep":
                inner = inner[1]  # type: ignore[assignment]
            if inner[0] in ("r", "g"):
                out.append(str(inner[1]))
            t = _target(atom)
            if t is None or t[0] == "t" or (t[0] in ("r", "g") and t[1] not in nullable):
                break
    return out
