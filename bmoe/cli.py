"""`bmoe-cli`: one-shot generation, the model maker, and the parameter table.

    bmoe-cli make-model --out tiny.gguf            write a test/benchmark GGUF
    bmoe-cli --describe-params                     the parameter table as JSON
    bmoe-cli -m MODEL -p PROMPT [flags]            stream one answer
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from .engine import params


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bmoe-cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--prompt", help="the user message to answer")
    p.add_argument("--describe-params", action="store_true",
                   help="print the parameter table as JSON and exit")
    params.add_cli_flags(p, server=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        from .engine.modelmaker import main_make_model
        return main_make_model(argv[1:])
    args = build_parser().parse_args(argv)
    if args.describe_params:
        json.dump(params.describe(server=False), sys.stdout, indent=1)
        print()
        return 0
    values = params.defaults(server=False)
    values.update(params.values_from_namespace(args))
    if not values.get("model") or args.prompt is None:
        print("bmoe-cli: give a model (-m PATH) and a prompt (-p TEXT); see --help.",
              file=sys.stderr)
        return 2
    error = params.validate(values)
    if error:
        print("bmoe-cli: " + params.render(error, "flag"), file=sys.stderr)
        return 2
    return generate_once(values, args.prompt)


def generate_once(values: dict[str, Any], prompt: str) -> int:
    from .engine.errors import EngineError
    from .engine.session import Session
    from .engine.turn import TurnRequest, prepare, run_turn

    try:
        session = Session(values["model"], values)
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return 1
    try:
        req = TurnRequest(messages=[{"role": "user", "content": prompt}],
                          max_tokens=int(values.get("n-predict") or 0),
                          think=bool(values.get("think", True)))
        prepared = prepare(session, req)

        def emit(ev: Any, _rec: dict[str, Any]) -> None:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

        result = run_turn(session, prepared, req, threading.Event(), emit)
        s = result.summary
        print()
        print(f"generation: {s['tokens']} tokens, {1 / s['tok_s'] if s['tok_s'] else 0:.4f} "
              f"s/token ({s['tok_s']:.2f} tok/s)", file=sys.stderr)
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return 1
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
