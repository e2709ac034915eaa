"""The pure side of a connection: h11 heads to Requests, response headers."""

from __future__ import annotations

import h11
import pytest

from bmoe.http.errors import HTTPError
from bmoe.http.messages import build_request, malformed, response_headers

PEER, LOCAL = ("127.0.0.1", 5000), ("127.0.0.1", 8765)


def head(target: bytes, headers: list[tuple[bytes, bytes]] | None = None,
         version: bytes = b"1.1", method: bytes = b"GET") -> h11.Request:
    return h11.Request(method=method, target=target, http_version=version,
                       headers=[(b"Host", b"localhost:8765"), *(headers or [])])


def test_build_request() -> None:
    request = build_request(head(b"/api/models/a%20b?x=1&y=&x=2", [(b"X-Thing", b"\xe9")]), PEER, LOCAL)
    assert request.method == "GET" and request.path == "/api/models/a b"
    assert request.raw_path == "/api/models/a%20b"
    assert request.query == {"x": "2", "y": ""}
    assert request.header("x-thing") == "\xe9" and request.header("HOST") == "localhost:8765"
    assert request.peer == PEER and request.local == LOCAL and request.body == b""


@pytest.mark.parametrize("event", [
    head(b"/", version=b"2.0"), head(b"http://x/"), head(b"*"), head(b"/%ff"), head(b"/?a=%ff"),
    head(b"/?" + b"a&" * 2000),
    head(b"/", [(b"Content-Length", b"1"), (b"Transfer-Encoding", b"chunked")], method=b"POST"),
])
def test_build_request_refuses(event: h11.Request) -> None:
    with pytest.raises(HTTPError) as info:
        build_request(event, PEER, LOCAL)
    assert info.value.status == 400


def test_whole_head_over_the_limit_is_431() -> None:
    with pytest.raises(HTTPError) as info:
        build_request(head(b"/", [(b"X-Big", b"a" * 70_000)]), PEER, LOCAL)
    assert info.value.status == 431


def test_response_headers_order_and_overrides() -> None:
    headers = dict(response_headers(200, "text/html", [("X-Frame-Options", "SAMEORIGIN"),
                                                         ("Content-Length", "999"), ("Connection", "x"),
                                                         ("Transfer-Encoding", "chunked")],
                                    length=5, close=True))
    assert headers[b"X-Frame-Options"] == b"SAMEORIGIN"        # a preview may set its own
    assert headers[b"Content-Length"] == b"5" and headers[b"Connection"] == b"close"
    assert b"Transfer-Encoding" not in headers
    assert headers[b"X-Content-Type-Options"] == b"nosniff"


def test_no_content_headers_on_204() -> None:
    names = [k for k, _ in response_headers(204, "application/json", [], length=0, close=False)]
    assert b"Content-Type" not in names and b"Content-Length" not in names


def test_malformed_maps_5xx_hints_to_400() -> None:
    assert malformed(h11.RemoteProtocolError("x", error_status_hint=501)).status == 400
    assert malformed(h11.RemoteProtocolError("x", error_status_hint=431)).code == "headers_too_large"
