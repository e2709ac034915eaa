"""``bmoe-cli --plan`` (print the plan and exit) and ``bmoe-cli --auto`` (plan, then run).

``--auto`` prints the decisions, runs the prompt with the planned values, and ends with
the plan's predicted s/token beside the one measured. Flags given on the command line
are the operator's: the plan never changes them. Both read (and ``--auto`` adds to) the
routing record under ``routing/`` in the data folder, as the server does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..engine import params
from .measure import PlanError, measure
from .plan import Plan, label_of
from .probes import model_facts
from .routing import append_record, cost_key, cost_path, record_path, write_cost


def wants_planner(argv: list[str]) -> bool:
    return any(a in ("--plan", "--auto") for a in argv)


def data_dir() -> Path:
    env = os.environ.get("BMOE_DATA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "bmoe"


def add_plan_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """bmoe-cli's parser (given by bmoe/cli.py, the composition root) plus the planner's
    modes."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--plan", action="store_true", help="print the plan for this model on "
                   "this machine and exit")
    g.add_argument("--auto", action="store_true", help="plan the settings, then run with "
                   "them; prints predicted against measured s/token at the end")
    p.add_argument("--json", dest="plan_json", action="store_true",
                   help="with --plan: the plan as GET /api/plan's JSON")
    return p


# One planned prompt, run by bmoe/cli.py: (the turn's summary, the routing rows the
# streamer recorded), or None when it failed (the CLI has said why).
RunPrompt = Callable[[dict[str, Any], str], "tuple[dict[str, Any], list[Any]] | None"]


def main(argv: list[str], parser: argparse.ArgumentParser, run: RunPrompt) -> int:
    """`parser`: bmoe-cli's, with `add_plan_flags`; `run`: how the CLI runs a prompt."""
    args = parser.parse_args(argv)
    given = params.values_from_namespace(args)
    values = {**params.defaults(server=False), **given}
    if not values.get("model"):
        print("bmoe-cli: give a model (-m PATH) to plan for.", file=sys.stderr)
        return 2
    if args.auto and args.prompt is None:
        print("bmoe-cli: --auto runs a prompt: give one with -p TEXT.", file=sys.stderr)
        return 2
    routing = data_dir() / "routing"
    try:
        plan = measure(values["model"], values, list(given), routing_dir=routing,
                       progress=_progress if not args.plan_json else None)
    except PlanError as e:
        print(f"bmoe-cli: {e}", file=sys.stderr)
        return 1
    if args.plan:
        if args.plan_json:
            print(json.dumps(plan.to_json(), indent=1))
        else:
            print(plan_text(plan))
        return 0 if plan.fits else 1
    print(plan_text(plan), file=sys.stderr)
    if not plan.fits:
        return 1
    values = {**values, **plan.values}
    got = run(values, args.prompt)
    if got is None:
        return 1
    summary, rows = got
    _keep(routing, Path(values["model"]), values, summary, rows)
    _compare(plan, summary)
    return 0


def _progress(step: str, label: str, index: int, count: int) -> None:
    print(f"plan: {label} ({index + 1}/{count})", file=sys.stderr, flush=True)


def plan_text(plan: Plan) -> str:
    lines = [plan.sentence, f"machine: {plan.machine}"]
    for d in plan.decisions:
        tag = {"set": "set ", "kept": "kept", "notes": "note"}[d.group]
        lines.append(f"  {tag} {_label(d.knob)}: {d.brief}")
    p = plan.predicted
    if "s_per_token" in p:
        hit = f", {p['cache_hit_pct']:.0f} % cache hits" if "cache_hit_pct" in p else ""
        worst = f" (worst {p['s_per_token_worst']:.3f})" if "s_per_token_worst" in p else ""
        lines.append(f"predicted: {p['s_per_token']:.4f} s/token{worst}{hit}")
    if plan.values:
        lines.append("args: " + " ".join(params.to_args(plan.values, list(plan.values))))
    return "\n".join(lines)


def _label(knob: str) -> str:
    return label_of(knob)


def _compare(plan: Plan, summary: dict[str, Any]) -> None:
    tok_s = float(summary.get("tok_s") or 0)
    measured = 1.0 / tok_s if tok_s > 0 else 0.0
    predicted = plan.predicted.get("s_per_token")
    line = f"plan: measured {measured:.4f} s/token over {summary.get('tokens', 0)} tokens"
    if predicted:
        line += f", predicted {predicted:.4f} ({measured / predicted:.2f}x)"
    print(line, file=sys.stderr, flush=True)


def _keep(routing: Path, model: Path, values: dict[str, Any], summary: dict[str, Any],
          rows: list[Any]) -> None:
    tokens = int(summary.get("tokens") or 0)
    tok_s = float(summary.get("tok_s") or 0)
    if not tokens or tok_s <= 0 or summary.get("cancelled"):
        return
    try:
        facts = model_facts(model)
        p = facts.probe
        if rows and p.is_moe:
            append_record(record_path(routing, model, facts.size), rows, model=model.name,
                          size=facts.size, n_layer=p.n_moe_layer, n_expert=p.n_expert,
                          n_expert_used=p.n_expert_used)
        write_cost(cost_path(routing, model, facts.size), cost_key(values),
                   {"s_per_token": 1.0 / tok_s, "tokens": tokens,
                    "cache_hit_pct": float(summary.get("cache_hit_pct", -1))})
    except OSError as e:
        print(f"bmoe-cli: the routing record was not kept ({e.strerror or 'I/O error'})",
              file=sys.stderr)
