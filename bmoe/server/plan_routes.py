"""The spec's ``## Plan`` section: ``GET /api/plan``, ``POST /api/plan/apply``, auto-plan.

Theory of operation
-------------------
``PlanService`` is the server's one planner (``state.planner``). A measurement runs the
planner's probes (``bmoe.planner.measure``) in a worker thread, one at a time: a second
one while one runs, or one asked for while a generation runs, is ``409``. Each stage is
a ``plan_progress`` event, then ``{"step": "done"}``.

The service holds two plans: the last measured by hand (``GET /api/plan``) and the one
the loaded model was loaded with (auto-plan). ``?cached=1`` answers the first, else the
second, without measuring. With auto-plan on, ``before_load`` (called by
``Runtime._load``) puts the state in ``planning``, measures with nothing loaded,
applies the plan to the config's plan layer and hands the load its values; a plan that
says ``will_not_fit`` refuses the load with its sentence.

A background task (``run``) follows the event bus: when a model is ready it asks the
streamer to keep its decoded tokens' routing; after each complete turn (``done``, not
cancelled) it appends that routing to the model's record under ``<data>/routing/`` and
records what decode cost at the loaded configuration, which the next plan of that
configuration prices with.
"""

from __future__ import annotations

import argparse
import os
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable

import trio

from ..engine.errors import EngineError
from ..http.errors import HTTPError
from ..http.routes import RouteTable
from ..http.types import Request, Response
from ..planner.measure import PlanError, measure
from ..planner.plan import Plan
from ..planner.probes import ComputeFacts, model_facts
from ..planner.routing import append_record, cost_key, cost_path, record_path, trial_path, write_cost, write_trial
from ..runtime.state import Lifecycle, Runtime

MIN_RECORD_TOKENS = 1


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--auto", dest="auto_plan", action="store_true", default=None,
                   help="every load measures the machine and plans its settings first "
                        "(this run)")
    g.add_argument("--no-auto", dest="auto_plan", action="store_false",
                   help="loads use the settings as they are (this run)")


def attach(state: Runtime, args: argparse.Namespace | None = None) -> None:
    state.planner = PlanService(state)
    if args is not None and getattr(args, "auto_plan", None) is not None:
        state.config.auto_plan_launch = bool(args.auto_plan)


def register(table: RouteTable, state: Runtime) -> None:
    table.add("GET", "/api/plan", partial(get_plan, state))
    table.add("POST", "/api/plan/apply", partial(apply_plan, state))


async def run(state: Runtime, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    planner = state.planner
    task_status.started()
    if isinstance(planner, PlanService):
        await planner.follow()


class PlanService:
    def __init__(self, state: Runtime) -> None:
        self.state = state
        self.routing_dir = Path(state.options.data_dir) / "routing"
        self._lock = trio.Lock()
        self.last: dict[str, Any] | None = None          # the last measured plan's JSON
        self.load_plan: dict[str, Any] | None = None     # what the loaded model was loaded with
        self.load_held = 0
        self.measured_after_load = False
        self.measured: dict[str, Any] | None = None      # the last complete turn's decode

    # -- measuring -------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def held_now(self) -> int:
        """What the loaded model holds, in bytes: what its auto-plan charged, else an
        estimate from the session itself (the dense weights and the expert cache when it
        streams, the whole file when it does not); 0 with nothing loaded."""
        session = self.state.session
        if session is None or self.state.state != Lifecycle.READY:
            return 0
        if self.load_held:
            return self.load_held
        streamer = getattr(session, "streamer", None)
        budget = getattr(streamer, "budget", None)
        try:
            if streamer is not None and budget is not None:
                return int(streamer.layout.dense_bytes) + int(budget.bytes)
            return Path(str(session.path)).stat().st_size
        except (OSError, AttributeError, TypeError, ValueError):
            return 0

    async def measure(self, path: str) -> Plan:
        state = self.state
        if self._lock.locked():
            raise HTTPError(409, "busy", "A measurement is already running; wait for it.")
        async with self._lock:
            session = state.session
            loaded = session is not None and state.state == Lifecycle.READY
            held = self.held_now()
            name = session.path.name if session is not None and loaded else ""
            config = state.config
            token = trio.lowlevel.current_trio_token()

            def progress(step: str, label: str, index: int, count: int) -> None:
                trio.from_thread.run_sync(state.bus.publish, "plan_progress",
                                          {"step": step, "label": label, "index": index,
                                           "count": count}, trio_token=token)

            job = partial(measure, path, {**config.values_without_plan, "model": path},
                          config.user_keys, routing_dir=self.routing_dir,
                          loaded_held=held, loaded_model=name, progress=progress,
                          cancel=threading.Event(), compute_on=self._on_engine_thread)
            try:
                plan = await trio.to_thread.run_sync(job)
            finally:
                state.bus.publish("plan_progress", {"step": "done"})
            if loaded and held and not self.load_held:
                plan.warning = (f"{name} was loaded while this was measured: the plan adds back "
                                f"an estimate of what it holds ({held >> 20} MiB), so its sizes "
                                "are approximate; unload it for an exact plan")
            return plan

    def _on_engine_thread(self, probe: Callable[[], ComputeFacts]) -> ComputeFacts:
        """Run the matmul probe on the thread that decodes (see bmoe/planner/measure.py:
        a second OpenMP team would slow every later decode); called from the worker
        thread the measurement runs in."""
        return self.state.call_from_thread(probe)

    async def measure_by_hand(self, path: str) -> dict[str, Any]:
        plan = await self.measure(path)
        self.last = plan.to_json()
        if self.state.session is not None:
            self.measured_after_load = True
        return self.last

    def current(self) -> dict[str, Any] | None:
        """The plan a person saw last: the loaded model's, unless measured since."""
        if self.load_plan is not None and self.state.session is not None \
                and not self.measured_after_load:
            return self.load_plan
        return self.last

    # -- the load path ----------------------------------------------------------------

    async def before_load(self, path: str, values: dict[str, Any]) -> dict[str, Any]:
        """With auto-plan on: measure, apply, and give the load the planned values.
        Raises EngineError with the plan's sentence when the model will not fit."""
        self.load_plan, self.load_held, self.measured_after_load = None, 0, False
        self.measured = None
        config = self.state.config
        if not config.auto_plan:
            return values
        self.state.planning(True)
        try:
            plan = await self.measure(path)
        except PlanError as e:
            raise EngineError("failed", str(e)) from None
        except HTTPError as e:
            raise EngineError("failed", e.message) from None
        if not plan.fits:
            raise EngineError("will_not_fit", plan.sentence)
        body = plan.to_json()
        await trio.to_thread.run_sync(config.apply_plan, plan.values, body["decisions"])
        self.state.bus.publish("config", config.state(None))
        self.load_plan = body
        self.load_held = sum(pool["held_bytes"] for pool in body["memory"]["pools"])
        self.state.planning(False)
        return {**config.values, "model": path}

    # -- following the turns ------------------------------------------------------------

    async def follow(self) -> None:
        while True:
            sub = self.state.bus.subscribe(local=True)
            try:
                async for name, data in sub.receive:
                    if name == "state" and isinstance(data, dict) and data.get("state") == "ready":
                        self._record_routing_on()
                    elif name == "done" and isinstance(data, dict):
                        await self._after_turn(data)
            finally:
                sub.close()

    def _record_routing_on(self) -> None:
        session = self.state.session
        streamer = getattr(session, "streamer", None) if session is not None else None
        if streamer is not None and hasattr(streamer, "record_routing"):
            streamer.record_routing = True

    async def _after_turn(self, summary: dict[str, Any]) -> None:
        session, values = self.state.session, self.state.loaded_values
        tokens = int(summary.get("tokens") or 0)
        if session is None or values is None or summary.get("cancelled") or not tokens:
            return
        tok_s = float(summary.get("tok_s") or 0.0)
        if tok_s <= 0:
            return
        hit = float(summary.get("cache_hit_pct", -1))
        self.measured = {"s_per_token": round(1.0 / tok_s, 4), "cache_hit_pct": hit,
                         "tokens": tokens}
        streamer = getattr(session, "streamer", None)
        rows: list[Any] = []
        if streamer is not None and isinstance(getattr(streamer, "routing", None), list):
            rows, streamer.routing = streamer.routing, []
        trial = getattr(session, "trial", None)
        verdict = None
        if trial is not None and trial.verdict is not None and not trial.kept:
            verdict, trial.kept = trial.verdict, True
        await trio.to_thread.run_sync(self._write_history, Path(str(session.path)),
                                      dict(values), rows, dict(self.measured),
                                      float(summary.get("compute_s_tok") or 0.0), verdict)

    def _write_history(self, path: Path, values: dict[str, Any], rows: list[Any],
                       measured: dict[str, Any], compute_s: float,
                       verdict: dict[str, Any] | None = None) -> None:
        try:
            size = path.stat().st_size
        except OSError:
            return
        try:
            if rows:
                p = model_facts(path).probe
                if p.is_moe:
                    append_record(record_path(self.routing_dir, path, size), rows,
                                  model=path.name, size=size, n_layer=p.n_moe_layer,
                                  n_expert=p.n_expert, n_expert_used=p.n_expert_used)
            write_cost(cost_path(self.routing_dir, path, size), cost_key(values),
                       {**measured, "compute_s_tok": compute_s})
            if verdict is not None:
                write_trial(trial_path(self.routing_dir, path, size), verdict)
        except OSError as e:
            self.state.bus.log("warn", "the planner could not keep this model's routing "
                               f"record ({e.strerror or 'input/output error'})")


# -- handlers ---------------------------------------------------------------------------

def _service(state: Runtime) -> PlanService:
    planner = state.planner
    if not isinstance(planner, PlanService):
        raise HTTPError(503, "unavailable", "The planner is not running.")
    return planner


def _with_measured(planner: PlanService, body: dict[str, Any]) -> dict[str, Any]:
    if planner.measured is not None and planner.state.session is not None:
        body = {**body, "measured": planner.measured}
    return body


async def get_plan(state: Runtime, request: Request) -> Response:
    planner = _service(state)
    q = request.query
    if q.get("cached") in ("1", "true"):
        plan = planner.current()
        if plan is None:
            return Response.json({"available": True, "none": True})
        return Response.json(_with_measured(planner, {**plan, "cached": True}))
    if state.generating:
        raise HTTPError(409, "generating", "A generation is running, which would skew the "
                        "measurement; ask again when it ends.")
    if state.state.loading:
        raise HTTPError(409, "busy", "A model is loading; ask again when it is ready.")
    if q.get("measure") not in ("1", "true") and planner.load_plan is not None \
            and state.session is not None and not planner.measured_after_load:
        return Response.json(_with_measured(planner, {**planner.load_plan,
                                                      "from_last_load": True}))
    model = state.config.values_without_plan.get("model") or (
        str(state.session.path) if state.session is not None else "")
    if not model:
        return Response.json({"available": True, "error": "No model is selected: choose "
                              "one to plan for."})
    if not os.path.exists(model):
        return Response.json({"available": True, "error": f"The model file {Path(model).name} "
                              "is not there any more."})
    try:
        body = await planner.measure_by_hand(str(model))
    except PlanError as e:
        return Response.json({"available": True, "error": str(e)})
    return Response.json(_with_measured(planner, body))


async def apply_plan(state: Runtime, request: Request) -> Response:
    planner = _service(state)
    request.json_object()            # any object; its fields are not read
    plan = planner.current()
    if plan is None:
        model = state.config.values_without_plan.get("model")
        if not model:
            raise HTTPError(409, "no_plan", "There is no plan to apply: choose a model "
                            "and measure first.")
        if state.generating:
            raise HTTPError(409, "generating", "A generation is running; apply the plan "
                            "when it ends.")
        try:
            plan = await planner.measure_by_hand(str(model))
        except PlanError as e:
            raise HTTPError(409, "no_plan", str(e)) from None
    config = state.config
    await trio.to_thread.run_sync(config.apply_plan, plan.get("values", {}),
                                  plan.get("decisions", []))
    out = config.state(state.loaded_values)
    state.bus.publish("config", out)
    return Response.json(out)
