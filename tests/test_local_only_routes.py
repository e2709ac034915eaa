"""The local-only routes of the real server: which ones, and that the network is refused
each of them (403 local_only, whatever the key) while this machine is answered.

The HTTP layer keeps no list of application routes: each route says
`access=Access.LOCAL_ONLY` where it is registered. These tests build the table `bmoe-server` serves and check the
set against the spec's, then send every route through the access checks."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from _app_routes import LOCAL_ONLY, app_routes, concrete, flagged

from bmoe.http import access
from bmoe.http.access import AccessPolicy, check_access
from bmoe.http.errors import HTTPError
from bmoe.http.types import Request

PORT = 8765
NETWORK = AccessPolicy("0.0.0.0", port=PORT, api_key="s3cret")
NETWORK_PEER, LOOPBACK_PEER = ("192.168.7.9", 50000), ("127.0.0.1", 50000)


def req(method: str, target: str, peer: tuple[str, int]) -> Request:
    headers = [("host", f"192.168.7.2:{PORT}"), ("authorization", "Bearer s3cret"),
               ("content-type", "application/json")]
    return Request(method, target, unquote(target), {}, headers, b"", peer, ("0.0.0.0", PORT))


def refusal(request: Request) -> tuple[int, str] | None:
    try:
        check_access(request, NETWORK, app_routes())
    except HTTPError as err:
        return err.status, err.code
    return None


def test_the_local_only_routes_are_exactly_the_specs() -> None:
    assert flagged() == LOCAL_ONLY


def test_the_http_layer_keeps_no_list_of_them() -> None:
    assert not hasattr(access, "local_only_routes")
    with open(access.__file__, encoding="utf-8") as f:
        text = f.read()
    for path in ("/api/models/", "/api/workspaces", "/api/backends", "/api/connect"):
        assert path not in text, path


@pytest.mark.parametrize("method,pattern", sorted(LOCAL_ONLY))
def test_each_refuses_the_network_whatever_the_key(method: str, pattern: str) -> None:
    target = concrete(pattern)
    assert refusal(req(method, target, NETWORK_PEER)) == (403, "local_only")
    assert refusal(req(method, target, LOOPBACK_PEER)) is None
    app_routes().match(method, target)          # the route exists: no 404 or 405


@pytest.mark.parametrize("method,target", [
    ("DELETE", "/api/models/local/folder/model.gguf"),      # a name with a folder
    ("DELETE", "/api/models/local/folder%2Fmodel.gguf"),    # the same, encoded
    ("DELETE", "/api/models/local/%2E%2E"),
    ("HEAD", "/api/workspaces"),                             # HEAD is a GET
    ("POST", "/api/%74asks/t1/run"),                         # an encoded literal
    ("GET", "/api/conversations/a%2Fb/file"),
    ("POST", "/%73hutdown"),
])
def test_local_only_cannot_be_spelled_around(method: str, target: str) -> None:
    assert refusal(req(method, target, NETWORK_PEER)) == (403, "local_only")


@pytest.mark.parametrize("method,target", [
    ("GET", "/api/info"), ("POST", "/v1/chat/completions"), ("GET", "/api/models"),
    ("POST", "/api/models/download"), ("POST", "/api/hf/inspect"),
    ("DELETE", "/api/models/partial/x"), ("GET", "/api/conversations/x1"),
    ("POST", "/api/conversations/x1/messages"), ("GET", "/health"), ("POST", "/completion"),
])
def test_other_routes_answer_the_network_with_the_key(method: str, target: str) -> None:
    assert refusal(req(method, target, NETWORK_PEER)) is None
