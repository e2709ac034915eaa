"""``--autoload``: the model the settings name is loaded at start, and again whenever a
request finds none loaded; the request waits for that load, as a request that arrives
during a load already does.

``AutoloadState`` is the server's ``ServerState`` with that one difference in
``require_session``. Loads stay serialised by the state's own load lock, and
``begin_load`` marks the state ``loading`` before it returns, so two requests that
find nothing loaded start one load and both wait for it.
"""

from __future__ import annotations

from typing import Any

from ..engine.session import Session
from ..http.errors import HTTPError
from ..server.state import ServerState

NO_MODEL_SELECTED = ("No model is selected yet: choose one on the Models page (or POST "
                     "/api/session/load with a model) and the server loads it from then on.")


class AutoloadState(ServerState):
    def start_autoload(self) -> None:
        """At start: load the saved model, or say in the log that none is chosen yet."""
        model = self.config.values.get("model")
        if model:
            self.begin_load(str(model), self.config.values)
        else:
            self.bus.log("info", "autoload: no model is selected yet; choose one and it "
                         "loads at every start")

    async def require_session(self) -> Session:
        if self.state != "loading" and (self.session is None or self.state != "ready"):
            model: Any = self.config.values.get("model")
            if not model:
                raise HTTPError(503, "no_model", NO_MODEL_SELECTED)
            self.bus.log("info", f"autoload: a request found no model loaded; loading {model}")
            self.begin_load(str(model), self.config.values)
        return await super().require_session()
