"""check_access: the security model's rules, one by one, as pure checks."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from _http_support import LOOPBACK_PEER, NETWORK_PEER, PORT

from bmoe.http.access import (
    AccessPolicy,
    check_access,
    is_loopback_address,
    split_host,
)
from bmoe.http.errors import HTTPError
from bmoe.http.routes import Access, RouteTable
from bmoe.http.types import Request, Response

LOCAL = ("127.0.0.1", PORT)
LAN_ADDRESS = "192.168.7.2"


def req(method: str = "GET", target: str = "/api/info", *, host: str | None = f"127.0.0.1:{PORT}",
        headers: list[tuple[str, str]] | None = None, peer: tuple[str, int] = LOOPBACK_PEER,
        local: tuple[str, int] = LOCAL, json: bool = True) -> Request:
    all_headers = [("host", host)] if host is not None else []
    if json and method not in ("GET", "HEAD"):
        all_headers.append(("content-type", "application/json"))
    all_headers += [(k.lower(), v) for k, v in headers or []]
    raw_path = target.split("?", 1)[0]
    return Request(method, target, unquote(raw_path), {}, all_headers, b"", peer, local)


async def _ok(request: Request) -> Response:
    return Response.json({})


ROUTES = RouteTable()      # routes as an application registers them, one of each class
ROUTES.add("POST", "/api/models/url", _ok, access=Access.LOCAL_ONLY)
ROUTES.add("GET", "/api/info", _ok)
ROUTES.add("POST", "/v1/chat/completions", _ok)
ROUTES.add("GET", "/health", _ok, access=Access.PUBLIC)


def refusal(request: Request, policy: AccessPolicy) -> tuple[int, str] | None:
    try:
        check_access(request, policy, ROUTES)
    except HTTPError as err:
        return err.status, err.code
    return None


LOOPBACK = AccessPolicy("127.0.0.1", port=PORT)
KEYED = AccessPolicy("127.0.0.1", port=PORT, api_key="s3cret")
NETWORK = AccessPolicy("0.0.0.0", port=PORT, api_key="s3cret")


# --- helpers --------------------------------------------------------------------------

@pytest.mark.parametrize("ip", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_loopback_addresses(ip: str) -> None:
    assert is_loopback_address(ip)


@pytest.mark.parametrize("ip", ["192.168.1.2", "10.0.0.1", "::ffff:10.0.0.1", "fe80::1%eth0",
                                "0.0.0.0", "localhost", "garbage", ""])
def test_not_loopback_addresses(ip: str) -> None:
    assert not is_loopback_address(ip)


def test_split_host() -> None:
    assert split_host("LocalHost:8765") == ("localhost", 8765)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("[::1]") == ("::1", None)
    assert split_host("a") == ("a", None)
    for bad in ("", ":80", "a:b", "[::1", "[::1]x", "a:８０"):
        assert split_host(bad) is None, bad


# --- host -----------------------------------------------------------------------------

@pytest.mark.parametrize("host", [f"localhost:{PORT}", f"127.0.0.1:{PORT}", f"127.1.2.3:{PORT}",
                                  f"[::1]:{PORT}", f"LOCALHOST:{PORT}"])
def test_loopback_host_names_are_answered(host: str) -> None:
    assert refusal(req(host=host), LOOPBACK) is None
    assert refusal(req(target="/", host=host), LOOPBACK) is None


@pytest.mark.parametrize("host", ["evil.example:8765", "localhost", f"localhost:{PORT + 1}",
                                  f"127.0.0.1.evil.example:{PORT}", f"{LAN_ADDRESS}:{PORT}",
                                  f"localhost.:{PORT}", f"user@localhost:{PORT}", "", None])
def test_other_host_names_are_refused_on_loopback(host: str | None) -> None:
    assert refusal(req(host=host), LOOPBACK) == (421, "bad_host")
    assert refusal(req(target="/index.html", host=host), LOOPBACK) == (421, "bad_host")


def test_binding_beyond_loopback_lifts_the_host_check() -> None:
    open_server = AccessPolicy("0.0.0.0", port=PORT)
    assert refusal(req(host="mybox.lan:8765", peer=NETWORK_PEER), open_server) is None


# --- key ------------------------------------------------------------------------------

def test_key_required_with_www_authenticate() -> None:
    with pytest.raises(HTTPError) as info:
        check_access(req(), KEYED, ROUTES)
    assert (info.value.status, info.value.code) == (401, "unauthorized")
    assert ("WWW-Authenticate", "Bearer") in info.value.headers


@pytest.mark.parametrize("headers", [[("Authorization", "Bearer s3cret")],
                                     [("Authorization", "bearer  s3cret ")],
                                     [("X-Api-Key", "s3cret")],
                                     [("Authorization", "Bearer wrong"), ("X-Api-Key", "s3cret")]])
def test_key_accepted(headers: list[tuple[str, str]]) -> None:
    assert refusal(req(headers=headers), KEYED) is None
    assert refusal(req("POST", "/v1/chat/completions", headers=headers), KEYED) is None


@pytest.mark.parametrize("headers", [[], [("Authorization", "Bearer wrong")],
                                     [("Authorization", "Basic s3cret")], [("Authorization", "s3cret")],
                                     [("X-Api-Key", "s3cret2")], [("X-Api-Key", "")],
                                     [("Authorization", "Bearer S3CRET")]])
def test_key_refused(headers: list[tuple[str, str]]) -> None:
    assert refusal(req(headers=headers), KEYED) == (401, "unauthorized")


def test_ui_files_need_no_key() -> None:
    for target in ("/", "/index.html", "/app.js", "/apix", "/v1x"):
        assert refusal(req(target=target), KEYED) is None


# --- origin and Sec-Fetch-Site ---------------------------------------------------------

@pytest.mark.parametrize("headers,expected", [
    ([], None),                                                              # a program
    ([("Origin", f"http://127.0.0.1:{PORT}")], None),                         # the UI itself
    ([("Origin", f"HTTP://127.0.0.1:{PORT}/")], None),
    ([("Origin", f"http://localhost:{PORT}")], (403, "forbidden_origin")),    # not the Host it came with
    ([("Origin", f"http://127.0.0.1:{PORT + 1}")], (403, "forbidden_origin")),  # another port: same site
    ([("Origin", "https://evil.example")], (403, "forbidden_origin")),
    ([("Origin", "null")], (403, "forbidden_origin")),
    ([("Origin", f"http://127.0.0.1:{PORT}"), ("Origin", "http://evil.example")], (403, "forbidden_origin")),
    ([("Origin", f"http://127.0.0.1:{PORT}"), ("Sec-Fetch-Site", "same-origin")], None),
    ([("Sec-Fetch-Site", "same-origin")], None),
    ([("Sec-Fetch-Site", "none")], None),
    ([("Sec-Fetch-Site", "same-site")], (403, "forbidden_origin")),
    ([("Sec-Fetch-Site", "cross-site")], (403, "forbidden_origin")),
    ([("Sec-Fetch-Site", "")], (403, "forbidden_origin")),
])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_origin_matrix(headers: list[tuple[str, str]], expected: tuple[int, str] | None, method: str) -> None:
    assert refusal(req(method, "/api/info", headers=headers), LOOPBACK) == expected


def test_allow_origin_admits_one_more() -> None:
    policy = AccessPolicy("127.0.0.1", port=PORT, allow_origins=["http://localhost:5173/"])
    assert refusal(req(headers=[("Origin", "http://localhost:5173")]), policy) is None
    assert refusal(req(headers=[("Origin", "http://localhost:5174")]), policy) == (403, "forbidden_origin")


def test_own_origin_beyond_loopback_is_the_address_it_arrived_on() -> None:
    policy = AccessPolicy("0.0.0.0", port=PORT)
    at_lan = (LAN_ADDRESS, PORT)
    ok = req(host=f"{LAN_ADDRESS}:{PORT}", local=at_lan, peer=NETWORK_PEER,
             headers=[("Origin", f"http://{LAN_ADDRESS}:{PORT}")])
    assert refusal(ok, policy) is None
    rebound = req(host=f"evil.example:{PORT}", local=at_lan, peer=NETWORK_PEER,
                  headers=[("Origin", f"http://evil.example:{PORT}")])
    assert refusal(rebound, policy) == (403, "forbidden_origin")
    named = AccessPolicy("mybox.lan", port=PORT)
    ok = req(host=f"mybox.lan:{PORT}", local=at_lan, peer=NETWORK_PEER,
             headers=[("Origin", f"http://mybox.lan:{PORT}")])
    assert refusal(ok, named) is None


def test_origin_is_not_checked_on_ui_files() -> None:
    assert refusal(req(target="/", headers=[("Sec-Fetch-Site", "cross-site")]), LOOPBACK) is None


# --- content type ----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "multipart/form-data; boundary=x",
                                          "application/x-www-form-urlencoded", "application/json5"])
def test_415_without_json_content_type(method: str, content_type: str | None) -> None:
    headers = [("Content-Type", content_type)] if content_type else []
    request = req(method, "/api/cancel", headers=headers, json=False)
    assert refusal(request, LOOPBACK) == (415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON",
                                          "application/json; charset=utf-8",
                                          "application/json;charset=UTF-8"])
def test_json_content_type_accepted(content_type: str) -> None:
    request = req("POST", "/api/cancel", headers=[("Content-Type", content_type)], json=False)
    assert refusal(request, LOOPBACK) is None


def test_get_and_head_need_no_content_type() -> None:
    assert refusal(req("GET", json=False), LOOPBACK) is None
    assert refusal(req("HEAD", json=False), LOOPBACK) is None


def test_ui_paths_need_no_content_type() -> None:
    assert refusal(req("POST", "/form", json=False), LOOPBACK) is None


# --- local-only ------------------------------------------------------------------------
# Which routes are local-only is the application's, where it registers them: the real
# server's table is checked route by route in tests/test_local_only_routes.py, and the
# flag's matching (any spelling of a path) in test_http_local_only.py.

# --- order -----------------------------------------------------------------------------

def test_checks_apply_in_order() -> None:
    policy = AccessPolicy("127.0.0.1", port=PORT, api_key="s3cret")
    everything_wrong = dict(host="evil.example:1", headers=[("Origin", "http://evil.example")],
                            peer=NETWORK_PEER, json=False)
    assert refusal(req("POST", "/api/models/url", **everything_wrong), policy)[0] == 421
    everything_wrong["host"] = f"localhost:{PORT}"
    assert refusal(req("POST", "/api/models/url", **everything_wrong), policy)[0] == 401
    key = [("X-Api-Key", "s3cret")]
    everything_wrong["headers"] = key + [("Origin", "http://evil.example")]
    assert refusal(req("POST", "/api/models/url", **everything_wrong), policy)[1] == "forbidden_origin"
    everything_wrong["headers"] = key
    assert refusal(req("POST", "/api/models/url", **everything_wrong), policy)[0] == 415
    everything_wrong["json"] = True
    assert refusal(req("POST", "/api/models/url", **everything_wrong), policy)[1] == "local_only"
