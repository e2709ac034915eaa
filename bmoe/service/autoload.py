"""``--autoload``: the model the settings name is loaded at start, and again whenever a
request finds none loaded; the request waits for that load, as a request that arrives
during a load already does.

``AutoloadState`` is the server's ``Runtime`` with ``wake``: a request that needs
the model and finds none loaded or loading starts the load of the saved model (or is
refused with 503 ``no_model`` and a message that says to choose one). ``with_autoload``
calls it before each route registered ``model=True`` (the routes that run the model say
so where they are registered), ahead of the adapters' own "no model" check, which then
finds a load under way and waits for it (or, on llama-server's routes, answers 503
``loading`` as llama-server does while it loads); ``require_session`` does the same for a
caller that goes there first. Loads stay
serialised by the state's own load lock, and ``begin_load`` marks the state ``loading``
before it returns, so two requests that find nothing loaded start one load and both
wait for it.
"""

from __future__ import annotations

from typing import Any

from ..engine.session import Session
from ..http.errors import HTTPError
from ..http.routes import RouteTable
from ..http.types import Handler, Request
from ..runtime.state import Lifecycle, Runtime

NO_MODEL_SELECTED = ("No model is selected yet: choose one on the Models page (or POST "
                     "/api/session/load with a model) and the server loads it from then on.")


class AutoloadState(Runtime):
    def start_autoload(self) -> None:
        """At start: load the saved model, or say in the log that none is chosen yet."""
        model = self.config.values.get("model")
        if model:
            self.begin_load(str(model), self.config.values)
        else:
            self.bus.log("info", "autoload: no model is selected yet; choose one and it "
                         "loads at every start")

    def wake(self) -> bool:
        """A request needs the model: wake it if it sleeps, else start loading the saved
        one unless one is there; whether a load was started."""
        if super().wake():
            return True
        if self.state.loading or (self.session is not None and self.state == Lifecycle.READY):
            return False
        model: Any = self.config.values.get("model")
        if not model:
            raise HTTPError(503, "no_model", NO_MODEL_SELECTED)
        self.bus.log("info", f"autoload: a request found no model loaded; loading {model}")
        self.begin_load(str(model), self.config.values)
        return True

    async def require_session(self) -> Session:
        self.wake()
        return await super().require_session()


def with_autoload(table: RouteTable, state: Runtime) -> RouteTable:
    """The same routes, each one registered ``model=True`` waking the autoload first; every
    other attribute of every route (its access class above all) kept as registered."""
    return table.wrapped(lambda r: _waking(r.handler, state) if r.model else r.handler)


def _waking(handler: Handler, state: Runtime) -> Handler:
    async def wake_then(request: Request) -> Any:
        state.wake()
        return await handler(request)
    return wake_then
