"""The runtime: the server's one session, its lifecycle, and the one way to the engine.

`Runtime` is the trio-side owner of the engine thread and the loaded `Session`. Every
caller reaches the engine through it: a turn (`bmoe/runtime/turnservice.py`'s `Turn`,
which takes a place in the turn line), `exclusive` for other work that holds the turn
(a decision), `job` for work that needs the model but is not a turn (tokenize, apply a
template). Loads and unloads are serialised; a request that needs the model while one
loads waits for it; every state change is published as a `state` event.

The lifecycle (`Lifecycle`, its moves in `MOVES`): empty → [planning →] loading → ready
| error, and back to empty on an unload or a sleep; a load may start from any state.

With ``--sleep-idle-seconds`` (bmoe/server/sleep.py) a ready model that has been idle
that long is unloaded and kept as an `Asleep`: the state is ``empty`` with ``sleeping``
in `/api/info`, and the next caller that needs the model (`wake`, `require_session`)
loads it again with the values it had.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, TypeVar

import trio

from .. import __version__
from ..backends.service import BackendsService
from ..engine import params
from ..engine.errors import EngineError
from ..engine.session import Session
from ..engine.telemetry import mem_available_mib
from ..engine.thread import EngineThread
from ..http.errors import HTTPError
from ..models.service import ModelsService
from .bridge import let_go, wait_future
from .events import EventBus
from .metrics import Metrics
from .options import LlamaOptions
from .turns import TurnLine

log = logging.getLogger(__name__)

CTX_FOR_CLIENTS = 16384  # tokens a coding agent needs: its first request plus an answer

T = TypeVar("T")


class Planner(Protocol):
    """The auto-plan the composition root attaches (bmoe/server/plan_routes.py): a load
    measures and plans first when it is on."""

    async def before_load(self, path: str, values: dict[str, Any]) -> dict[str, Any]: ...
    def held_now(self) -> int: ...


class Lifecycle(StrEnum):
    """Where the one session is (the `state` of `/api/info`)."""

    EMPTY = "empty"          # nothing loaded (or asleep: `sleeping` in /api/info)
    PLANNING = "planning"    # an auto-plan load measures the machine first
    LOADING = "loading"
    READY = "ready"
    ERROR = "error"          # the last load failed; `error` says why

    @property
    def loading(self) -> bool:
        """A load is under way: a caller that needs the model waits for it."""
        return self in (Lifecycle.PLANNING, Lifecycle.LOADING)


# The moves the lifecycle makes; a load (to LOADING) may start from any state.
MOVES: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.EMPTY: frozenset({Lifecycle.LOADING, Lifecycle.EMPTY}),
    Lifecycle.LOADING: frozenset({Lifecycle.PLANNING, Lifecycle.LOADING, Lifecycle.READY,
                                  Lifecycle.ERROR, Lifecycle.EMPTY}),
    Lifecycle.PLANNING: frozenset({Lifecycle.LOADING, Lifecycle.ERROR, Lifecycle.EMPTY}),
    Lifecycle.READY: frozenset({Lifecycle.LOADING, Lifecycle.EMPTY}),
    Lifecycle.ERROR: frozenset({Lifecycle.LOADING, Lifecycle.EMPTY}),
}


class FrozenStats:
    """The expert streamer's totals as they were when the model slept (`/metrics`)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = dict(stats)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)


@dataclass
class Asleep:
    """A model put to sleep: what loads it again, and what the read-only routes say of
    it meanwhile (the metrics collector reads `n_ctx`, `kv_tokens`, `streamer` as it
    reads a session's; `views` are route bodies their owners kept, by name)."""

    path: str
    values: dict[str, Any]
    n_ctx: int
    kv_tokens: tuple[int, ...]
    streamer: FrozenStats | None
    views: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8765
    data_dir: Path = Path(".")
    models_dir: Path = Path("models")
    scan_dirs: list[Path] = field(default_factory=list)
    models_only: bool = False
    launch_model: str | None = None


def _ram_total_mib() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (ValueError, OSError):
        return 0.0


class Runtime:
    def __init__(self, options: ServerOptions, config: Any, bus: EventBus,
                 streamer_factory: Callable[[Session], Any] | None = None) -> None:
        self.options = options
        self.config = config
        self.bus = bus
        self.engine = EngineThread()
        self.turns = TurnLine()
        self.session: Session | None = None
        self.state = Lifecycle.EMPTY
        self.error = ""
        self.load_started: float | None = None
        self.loaded_values: dict[str, Any] | None = None
        self.ctx_refused = False
        self._generating = False
        self._current_cancel: threading.Event | None = None
        self._load_lock = trio.Lock()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.streamer_factory = streamer_factory
        self.metrics = Metrics()                 # GET /metrics (bmoe/runtime/metrics.py)
        self.llama_options = LlamaOptions()      # llama-server's flags (server/llama_options.py)
        self.model_aliases: tuple[str, ...] = ()  # --alias (bmoe/server/llama_compat.py)
        self.model_tags: tuple[str, ...] = ()     # --tags
        # The services the composition root attaches at start (each package's `attach`),
        # None until then and in a test that builds only part of a server:
        self.planner: Planner | None = None      # bmoe/server/plan_routes.py's PlanService
        self.models: ModelsService | None = None          # downloads, the catalog, listing
        self.backends: BackendsService | None = None      # backend packs and updates
        self.agent: Any = None                   # bmoe/agent/service.py's (a layer above)
        self.stopping = False                    # the server is stopping (service/stopping.py)
        self.asleep: Asleep | None = None        # --sleep-idle-seconds (sleep.py)
        self.last_active = time.monotonic()      # a model route or a turn last ended
        self.heap_trims = 0                      # quiet spells whose free heap went back (trim.py)
        self._active = 0                         # model routes under way

    def model_name(self) -> str:
        """The name the API serves the loaded model under: the first --alias, else its
        file's name ("" with nothing loaded)."""
        if self.model_aliases:
            return self.model_aliases[0]
        return self.session.path.name if self.session is not None else ""

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    # -- the generation under way ------------------------------------------------

    @property
    def generating(self) -> bool:
        return self._generating

    @contextmanager
    def generation(self, cancel: threading.Event) -> Iterator[None]:
        """The one way to mark a generation (a chat turn, a decision): `POST /api/cancel`
        and an unload set `cancel` while it runs; `/api/info` says `generating`."""
        self._current_cancel = cancel
        self._generating = True
        self.publish_state()
        try:
            yield
        finally:
            self._generating = False
            self.last_active = time.monotonic()
            if self._current_cancel is cancel:
                self._current_cancel = None
            self.publish_state()

    @property
    def active_requests(self) -> int:
        """Requests to routes that run the model, under way now."""
        return self._active

    @contextmanager
    def active(self) -> Iterator[None]:
        """A request to a route that runs the model: while one is under way the model
        does not sleep, and its end starts the idle time again."""
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            self.last_active = time.monotonic()

    # -- the engine, for work that is not a chat turn ---------------------------

    async def job(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(session, *args)`` on the engine thread, for work that needs the model but
        is not a turn (tokenize, detokenize, apply a template): it waits through a load,
        wakes a sleeping model, and refuses with 503 no_model when none is loaded."""
        session = await self.require_session()
        return await wait_future(self.engine.submit(fn, session, *args))  # type: ignore[no-any-return]

    async def exclusive(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(session, *args, cancel)`` on the engine thread, holding the turn: a place
        in the turn line (503 busy when it is full), marked as a generation (so
        `POST /api/cancel` and an unload set `cancel`). A caller that goes away sets
        `cancel` and waits, shielded, for the engine to let go."""
        await self.require_session()                  # 503 no_model; waits through a load
        place = self.turns.reserve()                  # 503 busy when the line is full
        try:
            await place.wait()
            session = await self.require_session()
            cancel = threading.Event()
            with self.generation(cancel):
                fut = self.engine.submit(fn, session, *args, cancel)
                try:
                    return await wait_future(fut)  # type: ignore[no-any-return]
                except trio.Cancelled:
                    cancel.set()           # our caller left: stop the work, then let go
                    await let_go(fut)
                    raise
        finally:
            place.release()

    def call_from_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine thread, waited for by a worker thread (a planner probe
        that must run on the thread that decodes, with or without a model)."""
        return self.engine.submit(fn).result()  # type: ignore[no-any-return]

    # -- sleep (--sleep-idle-seconds) ------------------------------------------

    def idle(self) -> bool:
        """A ready model that nothing is using or waiting for."""
        return (self.session is not None and self.state == Lifecycle.READY and not self._generating
                and self._active == 0 and self.turns.waiting == 0)

    async def fall_asleep(self, views: Callable[[], dict[str, Any]]) -> bool:
        """Unload the idle model, keeping what loads it again and `views()` (the bodies
        read-only routes answer meanwhile); False when it is not idle after all."""
        async with self._load_lock:
            s = self.session
            if s is None or not self.idle() or self.loaded_values is None:
                return False
            stats = getattr(s.streamer, "stats", None)
            asleep = Asleep(str(s.path), dict(self.loaded_values), s.n_ctx,
                            tuple(s.kv_tokens),
                            FrozenStats(stats()) if callable(stats) else None, views())
            # Asleep from here, before the close: a request that arrives while the engine
            # closes the model wakes it (its load waits for this lock), where it would
            # otherwise find no model and a lifecycle still READY (503 no_model).
            self.asleep = asleep
            self._set_state(Lifecycle.EMPTY)
            await self._close_session()
            if self.asleep is not asleep:        # woken while it closed: the load goes on
                return False
        self.bus.log("info", f"sleeping: {Path(asleep.path).name} is unloaded until a "
                     "request needs it")
        return True

    def wake(self) -> bool:
        """A caller needs the model: if it sleeps, start loading it again (the caller
        waits for the load as for any other); whether it slept."""
        asleep = self.asleep
        if asleep is None:
            return False
        self.bus.log("info", f"waking: loading {Path(asleep.path).name} again")
        self.begin_load(asleep.path, asleep.values)
        return True

    def cancel_current(self) -> bool:
        """Stop the generation under way; whether there was one."""
        was = self._generating
        if self._current_cancel is not None:
            self._current_cancel.set()
        return was

    def note_context_refusal(self, e: EngineError) -> None:
        """A prompt past the context: `/api/info` advises a larger context from now on."""
        self.ctx_refused = True
        self.bus.log("warn", "a request was refused: " + e.message.replace(
            "{ctx-size}", "--ctx-size"))
        self.publish_state()

    # -- info ----------------------------------------------------------------

    def ctx_advice(self) -> dict[str, Any]:
        n_ctx = self.session.n_ctx if self.session else 0
        short = n_ctx < CTX_FOR_CLIENTS
        beyond_loopback = self.options.host not in ("127.0.0.1", "localhost", "::1")
        return {"recommended": CTX_FOR_CLIENTS, "short": short, "param": "ctx-size",
                "refused": self.ctx_refused,
                "warn": bool(short and (beyond_loopback or self.ctx_refused))}

    def model_info(self) -> dict[str, Any] | None:
        s = self.session
        if s is None or self.state != Lifecycle.READY:
            return None
        return {
            "path": str(s.path), "name": s.path.name, "id": self.model_name(),
            "arch": s.arch, "n_ctx": s.n_ctx,
            "n_expert_used": s.n_expert_used, "think_ctl": "template" if s.template else "none",
            "chat_format": s.tool_framing or "none",
            "load_s": round(s.load_s, 3), "streaming": s.streamer is not None,
            # what the expert streamer chose at load, each with its reason (prompt
            # read-ahead on or why off, the graph callback, the load's reads)
            "streaming_notes": dict(getattr(s.streamer, "load_info", None) or {}),
            "overlap": getattr(s.streamer, "queue", None) is not None
            and bool(getattr(s.streamer, "overlap", False)),
            "vision": s.vision is not None,
            "projector": s.vision.projector.name if s.vision is not None else "",
            "compute_threads": s.compute_threads,
            "busy_threads": s.compute_threads, "ctx_advice": self.ctx_advice(),
            "kernels": s.kernels.to_json(),
            "moe_prompt_matmul": s.moe_prompt_matmul,
            "context": {"n_batch": s.n_batch, "n_ubatch": s.n_ubatch, **s.attention.to_json()},
        }

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": __version__, "overlap_available": True, "planner_available": self.planner is not None,
            "host": {"ram_total_mib": round(_ram_total_mib()),
                     "ram_available_mib": round(mem_available_mib()),
                     "cpu_threads": os.cpu_count() or 1},
            "state": self.state, "error": self.error, "model": self.model_info(),
            "sleeping": self.asleep is not None,
            "generating": self.generating, "waiting": self.turns.waiting,
            "calibrating": False,
            "devices": self.devices(),
        }
        if self.state.loading and self.load_started is not None:
            out["load_elapsed_s"] = round(time.monotonic() - self.load_started, 3)
        return out

    def devices(self) -> list[dict[str, Any]]:
        """The host's CPU, then each RPC helper device of the loaded model."""
        host: dict[str, Any] = {"name": "CPU", "kind": "cpu", "status": "ok"}
        if self.session is not None:
            choice = self.session.kernels
            host.update(extra_buffer_types=list(choice.registered),
                        repack=choice.extra_bufts, repack_reason=choice.reason)
        helpers = getattr(self.session, "rpc", None)
        return [host, *(helpers.describe() if helpers is not None else [])]

    def _set_state(self, state: Lifecycle, error: str = "") -> None:
        """Move the lifecycle. A move `MOVES` does not hold is a bug of the caller's: it is
        logged as one (the tests fail on it) and made, never raised into a load."""
        if state not in MOVES[self.state]:
            log.error("the server went from %s to %s, a move its lifecycle does not make",
                      self.state, state)
        self.state = state
        self.error = error
        self.bus.publish("state", self.info())
        self._changed.set()
        self._changed = trio.Event()

    def planning(self, on: bool) -> None:
        """An auto-plan load measures first (`planning`), then loads (`loading`)."""
        self._set_state(Lifecycle.PLANNING if on else Lifecycle.LOADING)

    def publish_state(self) -> None:
        self.bus.publish("state", self.info())

    # -- load / unload -------------------------------------------------------

    def begin_load(self, path: str | None, values: dict[str, Any]) -> None:
        """Start a load in the background (the 202 of POST /api/session/load)."""
        if self._nursery is None:
            raise RuntimeError("Runtime.attach() was not called")
        self.asleep = None                 # a load (the wake's or another) ends a sleep
        self.load_started = time.monotonic()
        self._set_state(Lifecycle.LOADING)
        self._nursery.start_soon(self._load, path, dict(values))

    async def _load(self, path: str | None, values: dict[str, Any]) -> None:
        async with self._load_lock:
            await self._close_session()
            self.load_started = time.monotonic()
            self._set_state(Lifecycle.LOADING)
            if not path:
                self._set_state(Lifecycle.ERROR, "No model is set: choose a model file to load.")
                return
            try:
                if self.planner is not None:       # auto-plan: measure, apply, then load
                    values = await self.planner.before_load(path, values)
                session = await self._open_on_engine(path, values)
            except EngineError as e:              # its settings named by their labels
                self._set_state(Lifecycle.ERROR, params.render(e.message))
                self.bus.log("error", f"load failed: {params.render(e.message)}")
                return
            except Exception as e:  # noqa: BLE001 - a load failure is reported, not raised
                self._set_state(Lifecycle.ERROR, f"The model could not be loaded: {e}")
                self.bus.log("error", f"load failed: {e!r}")
                return
            self.session = session
            self.loaded_values = values
            self.ctx_refused = False
            self.last_active = time.monotonic()   # the idle time (sleep) starts when it is ready
            self._set_state(Lifecycle.READY)
            self.bus.log("info", f"loaded {session.path.name} ({session.arch}, n_ctx "
                         f"{session.n_ctx}, streaming {'on' if session.streamer else 'off'}, "
                         f"{session.kernels.line()}, chat format "
                         f"{session.tool_framing or 'none'}) in {session.load_s:.2f} s")
            if session.n_ctx < CTX_FOR_CLIENTS:
                self.bus.log("warn", f"the context is {session.n_ctx} tokens, below the "
                             f"{CTX_FOR_CLIENTS} a coding agent needs; raise it with --ctx-size")

    def _open_session(self, path: str, values: dict[str, Any]) -> Session:
        return Session(path, values, self.streamer_factory)

    async def _open_on_engine(self, path: str, values: dict[str, Any]) -> Session:
        """Open a session on the engine thread. A load cancelled midway (the server
        stops) waits, shielded, for the engine to finish it, then closes what it built:
        never a llama.cpp model left open with nobody holding it."""
        fut = self.engine.submit(self._open_session, path, values)
        try:
            return await wait_future(fut)  # type: ignore[no-any-return]
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                try:
                    built = await wait_future(fut)
                except Exception:  # noqa: BLE001 - the load failed: nothing to close
                    built = None
                if built is not None:
                    await wait_future(self.engine.submit(built.close))
            raise

    async def unload(self) -> None:
        async with self._load_lock:
            await self._close_session()
            self.asleep = None             # unloaded on purpose: nothing to wake
            self._set_state(Lifecycle.EMPTY)

    async def _close_session(self) -> None:
        self.cancel_current()
        session, self.session = self.session, None
        self.loaded_values = None
        if session is not None:
            with trio.CancelScope(shield=True):
                await wait_future(self.engine.submit(session.close))

    async def require_session(self) -> Session:
        """The loaded session (waking a sleeping one); waits through a load; 503 no_model
        when nothing is loaded."""
        self.wake()
        while self.state.loading:          # an auto load measures first
            await self._changed.wait()
        if self.session is None or self.state != Lifecycle.READY:
            raise HTTPError(503, "no_model", "No model is loaded. Load one with "
                            "POST /api/session/load or start the server with -m.")
        return self.session

    async def aclose(self) -> None:
        await self._close_session()
        with trio.CancelScope(shield=True):
            await wait_future(self.engine.close())   # the thread ends; the loop never blocks
