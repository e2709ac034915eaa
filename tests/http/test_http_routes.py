"""The route table: patterns, parameters, precedence, 404/405, limiters."""

from __future__ import annotations

import pytest
import trio

from bmoe.http.errors import HTTPError
from bmoe.http.routes import Pattern, RouteTable, path_segments
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


def test_loose_pattern_match() -> None:
    p = Pattern.parse("/api/tasks/{id}")
    assert p.match_loosely(["api", "tasks", "1"])
    assert p.match_loosely(["api", "tasks", "1", "run"])
    assert not p.match_loosely(["api", "tasks"])
    q = Pattern.parse("/api/conversations/{id}/file")
    assert q.match_loosely(["api", "conversations", "a", "b", "file"])
    assert not q.match_loosely(["api", "conversations", "a", "files"])
    # Linear, not exponential, on a long path.
    assert not Pattern.parse("/{a}/{b}/{c}/x").match_loosely(["s"] * 30000)


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
