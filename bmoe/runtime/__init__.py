"""The runtime: the one engine client every caller uses.

`state.Runtime` owns the engine thread and the one loaded session, and its lifecycle
(`state.Lifecycle`). Generation runs as a `turnservice.Turn` (a place in the fair turn
line of `turns.py`, the prompt prepared on the engine thread, the tokens read back
through `bridge.TokenPipe` and parsed into protocol-neutral events by `turnevents.py`);
other engine work goes through `Runtime.exclusive` (holds the turn) or `Runtime.job`
(needs the model, not the turn). Beside them: the layered settings (`config.py`), the
live event bus (`events.py`) and the Prometheus metrics (`metrics.py`).

Nothing here knows a protocol: the HTTP side of a turn is `bmoe/server/serving.py`, each
protocol's decoder and encoder sits in `bmoe/server/`, and the agent drives turns here
directly.
"""
