"""Google Cloud's Vertex AI prediction protocol, as llama-server serves it.

With ``AIP_MODE=PREDICTION`` in the environment (what Vertex AI sets for a custom
container), ``POST /predict`` (or ``AIP_PREDICT_ROUTE``) takes ``{"instances": [...]}``:
each instance names one of the server's POST routes by its camelCase alias in
``@requestFormat`` (``chatCompletions`` for ``/v1/chat/completions``, ``completion`` for
``/completion``, ``applyTemplate`` ...), and is that route's body. The instances are
answered in turn, each through the route's own handler, and the answer is
``{"predictions": [...]}``: each the route's JSON, or ``{"error": ...}`` for one that
failed. ``AIP_HEALTH_ROUTE`` is a second spelling of ``/health``; the port is
``--port`` (give it ``$AIP_HTTP_PORT``). A streamed answer cannot be a prediction and is
refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..http.errors import HTTPError, invalid_request
from ..http.routes import Access, RouteTable
from ..http.types import Request, Response
from .shapes import llama_error_body

INSTANCES_MAX = 128          # llama-server's bound


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("AIP_MODE", "") == "PREDICTION"


def alias(path: str) -> str:
    """A route's camelCase name (``/v1/chat/completions`` → ``chatCompletions``)."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    out, cap = [], False
    for c in s.lstrip("/"):
        if c in "{:":
            break
        if c in "/-_":
            cap = True
            continue
        out.append(c.upper() if cap else c)
        cap = False
    return "".join(out)


def register(table: RouteTable, environ: Mapping[str, str] = os.environ) -> None:
    """Add the predict route (and the health alias) when Vertex AI's mode is on."""
    if not enabled(environ):
        return
    health = environ.get("AIP_HEALTH_ROUTE", "")
    if health and health != "/health":
        found = table.lookup("GET", "/health").route
        if found is not None:
            table.add("GET", health, found.handler, access=Access.PUBLIC, shape=found.shape)

    async def predict(request: Request) -> Response:
        return await _predict(table, request)
    table.add("POST", environ.get("AIP_PREDICT_ROUTE") or "/predict", predict,
              shape="llama", model=True)


async def _predict(table: RouteTable, request: Request) -> Response:
    body = request.json_object()
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise invalid_request("The body must hold an array named `instances`.")
    if len(instances) > INSTANCES_MAX:
        raise invalid_request(f"`instances` holds more than {INSTANCES_MAX} instances.")
    routes = {alias(r.pattern.text): r for r in table
              if r.method == "POST" and r.access in (Access.KEY, Access.PUBLIC)
              and "{" not in r.pattern.text}
    predictions = []
    for i, instance in enumerate(instances):
        predictions.append(await _one(routes, request, instance, f"instances[{i}]"))
    return Response.json({"predictions": predictions})


async def _one(routes: dict[str, Any], request: Request, instance: Any, where: str) -> Any:
    try:
        if not isinstance(instance, dict):
            raise invalid_request(f"`{where}` must be an object.")
        fmt = instance.get("@requestFormat")
        route = routes.get(fmt) if isinstance(fmt, str) else None
        if route is None or alias(route.pattern.text) == alias(request.path):
            raise invalid_request(f"`{where}.@requestFormat` must name one of the server's "
                                  f"routes ({', '.join(sorted(routes)[:12])}, ...).")
        inner = {k: v for k, v in instance.items() if k != "@requestFormat"}
        sub = replace(request, target=route.pattern.text, path=route.pattern.text, query={},
                      body=json.dumps(inner).encode(), path_params={})
        answer = await route.handler(sub)
        if not isinstance(answer, Response):
            raise invalid_request(f"`{where}` asks for a stream: a prediction is one answer.")
        return json.loads(answer.body) if answer.body else None
    except HTTPError as err:
        return llama_error_body(err)
