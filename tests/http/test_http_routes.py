"""The route table: patterns, parameters, precedence, 404/405, limiters."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from bmoe.http.errors import HTTPError
from bmoe.http.routes import Access, Pattern, RouteTable, path_segments
from bmoe.http.types import Request, Response


def handler(name: str):
    async def handle(request: Request) -> Response:
        return Response.json(name)
    handle.__name__ = name
    return handle


def table() -> RouteTable:
    t = RouteTable()
    t.add("GET", "/api/models", handler("list"))
    t.add("GET", "/api/models/{name}", handler("one"))
    t.add("GET", "/api/models/download", handler("downloads"))
    t.add("DELETE", "/api/models/local/{name}", handler("delete"))
    t.add("POST", "/api/conversations/{id}/approval", handler("approve"))
    t.add("GET", "/files/{rest:path}", handler("files"))
    t.add("post", "/api/cancel", handler("cancel"))
    return t


def name_of(dispatch) -> str:
    return dispatch.handler.__name__


def test_literal_and_param_routes() -> None:
    t = table()
    assert name_of(t.match("GET", "/api/models")) == "list"
    found = t.match("GET", "/api/models/qwen.gguf")
    assert name_of(found) == "one" and found.params == {"name": "qwen.gguf"}
    assert name_of(t.match("GET", "/api/models/download")) == "downloads"
    assert t.match("POST", "/api/conversations/c%201/approval").params == {"id": "c 1"}
    assert name_of(t.match("POST", "/api/cancel")) == "cancel"


def test_encoded_slash_stays_in_one_param() -> None:
    found = table().match("DELETE", "/api/models/local/folder%2Fm.gguf")
    assert found.params == {"name": "folder/m.gguf"}


def test_rest_param_takes_the_rest() -> None:
    assert table().match("GET", "/files/a/b/c.txt").params == {"rest": "a/b/c.txt"}
    with pytest.raises(HTTPError):
        table().match("GET", "/files/")


@pytest.mark.parametrize("path", ["/api/nope", "/api/models/", "/api/models/a/b", "/api//models",
                                  "/API/models", "/", "/api/conversations//approval"])
def test_unknown_paths_are_404(path: str) -> None:
    with pytest.raises(HTTPError) as info:
        table().match("GET", path)
    assert (info.value.status, info.value.code) == (404, "not_found")


def test_wrong_method_is_405_with_allow() -> None:
    with pytest.raises(HTTPError) as info:
        table().match("PUT", "/api/models")
    assert (info.value.status, info.value.code) == (405, "method_not_allowed")
    assert ("Allow", "GET, HEAD") in info.value.headers
    with pytest.raises(HTTPError) as info:
        table().match("GET", "/api/cancel")
    assert ("Allow", "POST") in info.value.headers


def test_head_falls_back_to_get() -> None:
    assert name_of(table().match("HEAD", "/api/models")) == "list"


def test_bad_utf8_in_path_is_400() -> None:
    with pytest.raises(HTTPError) as info:
        path_segments("/api/%ff")
    assert info.value.status == 400


def test_duplicate_route_is_refused() -> None:
    t = table()
    with pytest.raises(ValueError):
        t.add("GET", "/api/models", handler("again"))
    with pytest.raises(ValueError):
        t.add("GET", "no-slash", handler("x"))
    with pytest.raises(ValueError):
        t.add("GET", "/a/{p:path}/b", handler("x"))


def test_depth_above() -> None:
    p = Pattern.parse("/api/tasks/{id}")
    assert p.depth_above(["api", "tasks", "1"]) == 3
    assert p.depth_above(["api", "tasks", "1", "run"]) == 3
    assert p.depth_above(["api", "tasks", ""]) == 3       # a trailing slash is below it
    assert p.depth_above(["api", "tasks"]) == 0
    assert p.depth_above(["api", "task", "1"]) == 0
    assert Pattern.parse("/files/{rest:path}").depth_above(["files", "a", "b"]) == 3


def test_limiter_is_held_for_the_request_and_refuses_when_full() -> None:
    limiter = trio.CapacityLimiter(1)
    full = HTTPError(503, "streams_full", "Too many streams.")
    t = RouteTable()
    t.add("GET", "/api/events", handler("events"), limiter=limiter, limiter_error=full)

    async def main() -> None:
        first = t.match("GET", "/api/events")
        with first.hold():
            assert limiter.borrowed_tokens == 1
            with pytest.raises(HTTPError) as info, t.match("GET", "/api/events").hold():
                pass
            assert info.value is full
        assert limiter.borrowed_tokens == 0
        with t.match("GET", "/api/events").hold():
            assert limiter.borrowed_tokens == 1
    trio.run(main)


def test_limiter_default_error_is_503_busy_with_retry_after() -> None:
    limiter = trio.CapacityLimiter(1)
    t = RouteTable()
    t.add("POST", "/v1/chat/completions", handler("chat"), limiter=limiter)

    async def main() -> None:
        with t.match("POST", "/v1/chat/completions").hold(), pytest.raises(HTTPError) as info, \
                t.match("POST", "/v1/chat/completions").hold():
            pass
        assert (info.value.status, info.value.code) == (503, "busy")
        assert ("Retry-After", "1") in info.value.headers
    trio.run(main)


# --- what a route is, kept and read ------------------------------------------------------

def classed() -> RouteTable:
    t = RouteTable()
    t.add("GET", "/health", handler("health"), access=Access.PUBLIC, shape="plain")
    t.add("POST", "/api/files/{name:path}", handler("files"), access=Access.LOCAL_ONLY)
    t.add("POST", "/v1/talk", handler("talk"), shape="talk", model=True, body_limit=5,
          limiter=trio.CapacityLimiter(1), limiter_error=HTTPError(503, "full", "Full."))
    t.add("GET", "/v1/talk/{id}", handler("one"), shape="talk")
    return t


def test_wrapped_replaces_the_handlers_only() -> None:
    t = classed()
    w = t.wrapped(lambda r: handler("wrapped-" + r.handler.__name__))
    for old, new in zip(t, w, strict=True):
        assert new.handler.__name__ == "wrapped-" + old.handler.__name__
        assert dataclasses.replace(new, handler=old.handler) == old


def test_lookup_of_a_route_carries_its_attributes() -> None:
    found = classed().lookup("HEAD", "/health")
    assert found.route is not None and (found.access, found.shape) == (Access.PUBLIC, "plain")
    found = classed().lookup("POST", "/api/files/a%2Fb")
    assert found.access is Access.LOCAL_ONLY and found.params == {"name": "a/b"}


@pytest.mark.parametrize("method,path,access,shape,status", [
    ("GET", "/api/nope", Access.KEY, None, 404),       # under a route's first segment
    ("GET", "/v1/talk/1/x", Access.KEY, "talk", 404),  # below /v1/talk/{id}: its shape
    ("GET", "/v1/talk/", Access.KEY, "talk", 404),
    ("GET", "/v1/other", Access.KEY, None, 404),       # below no route
    ("POST", "/health", Access.PUBLIC, "plain", 405),  # a public path stays public
    ("GET", "/api/files/x", Access.KEY, None, 405),    # local-only is the POST's alone
    ("GET", "/health/x", Access.KEY, "plain", 404),    # public is the route's, not below it
    ("GET", "/index.html", None, None, 404),           # outside the API
    ("GET", "/apix", None, None, 404),
])
def test_lookup_of_no_route(method: str, path: str, access: Access | None, shape: str | None,
                            status: int) -> None:
    found = classed().lookup(method, path)
    assert found.route is None and found.refusal is not None
    assert (found.access, found.shape, found.refusal.status) == (access, shape, status)
