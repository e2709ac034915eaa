"""Where llama.cpp's grammar code stops holding: the measurements behind the guard.

For each grammar shape that a request can produce (a JSON schema's ``maxLength`` as the
converter writes it, groups nested in groups, a chain of rules each starting with the
next), this compiles growing sizes with the real llama.cpp in a child process, on a
thread with the default 8 MiB stack and on one with the engine thread's stack, and
prints for each size: built or refused or crashed, and the milliseconds to build and
take the first sampling step and 64 more. The guard's limits and the converter's
``MAX_EXACT_COUNT`` are printed beside them, with the ratio of the smallest crashing
size to the limit (the margin).

    python bench/grammar_limits.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llama_cpp.llama_grammar import SchemaConverter  # noqa: E402

from _grammar_child import GrammarChild  # noqa: E402
from bmoe.engine import grammar as gbnf  # noqa: E402
from bmoe.engine import grammar_guard  # noqa: E402
from bmoe.engine.thread import ENGINE_STACK_BYTES  # noqa: E402

from bmoe.modelmaker import make_model  # noqa: E402

DEFAULT_STACK = 8 * 1024 * 1024


def max_length(n: int) -> str:
    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    conv.visit({"type": "string", "maxLength": n}, "")
    return conv.format_grammar()


def nested_groups(n: int) -> str:
    return "root ::= " + "(" * n + '"a"' + ")" * n + "\n"


def rule_chain(n: int) -> str:
    lines = [f"r{i} ::= r{i + 1}" for i in range(n)] + [f'r{n} ::= "a"', "root ::= r0"]
    return "\n".join(lines) + "\n"


SHAPES = {
    "maxLength (port's nesting)": (max_length, [250, 500, 1000, 2000, 5000, 20000, 60000],
                                   gbnf.MAX_EXACT_COUNT),
    "nested groups": (nested_groups, [500, 1000, 2500, 5000, 10000, 40000, 100000],
                      grammar_guard.MAX_NESTING),
    "rule chain": (rule_chain, [1000, 10000, 40000, 100000, 400000],
                   grammar_guard.MAX_RULES),
}


def _cell(child: GrammarChild, text: str, steps: int) -> tuple[str, float, bool]:
    r = child.compile(text, steps=steps)
    if r.crashed:
        return f"CRASH({r.returncode})", 0.0, True
    if r.timed_out:
        return "timeout", 0.0, False
    return ("built" if r.built else "refused"), r.ms, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "vocab.gguf", arch="qwen3")
        for name, (make, sizes, limit) in SHAPES.items():
            if args.quick:
                sizes = sizes[::2]
            print(f"\n== {name}: guard limit {limit:,}")
            print(f"{'size':>8} | {'8 MiB stack':>14} {'ms 1 step':>10} {'ms 65 steps':>11} "
                  f"| {'engine stack':>14} {'ms 1 step':>10}")
            first_crash: dict[str, int] = {}
            for n in sizes:
                text = make(n)
                cells = []
                for label, stack in (("8MiB", DEFAULT_STACK), ("engine", ENGINE_STACK_BYTES)):
                    with GrammarChild(model, stack_bytes=stack, timeout_s=120) as child:
                        state, ms1, crashed = _cell(child, text, 1)
                        ms65 = _cell(child, text, 65)[1] if label == "8MiB" and not crashed \
                            and state == "built" else 0.0
                    if crashed:
                        first_crash.setdefault(label, n)
                    cells.append((state, ms1, ms65))
                (s8, a8, b8), (se, ae, _) = cells
                print(f"{n:>8,} | {s8:>14} {a8:>10.1f} {b8:>11.1f} | {se:>14} {ae:>10.1f}")
            for label, n in first_crash.items():
                print(f"  first crash on the {label} stack at {n:,}: {n / limit:.1f}x the limit")
            if not first_crash:
                print("  no crash at any size measured")


if __name__ == "__main__":
    main()
