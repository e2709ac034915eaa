"""A route registered ``Access.LOCAL_ONLY`` is refused (403) to a peer off loopback."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from _http_support import LOOPBACK_PEER, NETWORK_PEER, PORT

from bmoe.http.access import AccessPolicy, check_access
from bmoe.http.errors import HTTPError
from bmoe.http.routes import Access, RouteTable
from bmoe.http.types import Request, Response

NETWORK = AccessPolicy("0.0.0.0", port=PORT, api_key="s3cret")
HOST = f"192.168.7.2:{PORT}"


async def _ok(request: Request) -> Response:
    return Response.json({})


def table() -> RouteTable:
    t = RouteTable()
    t.add("GET", "/api/files/{name:path}", _ok, access=Access.LOCAL_ONLY)
    t.add("GET", "/api/open", _ok)
    return t


def req(method: str, target: str, peer: tuple[str, int]) -> Request:
    headers = [("host", HOST), ("authorization", "Bearer s3cret")]
    return Request(method, target, unquote(target), {}, headers, b"", peer, ("0.0.0.0", PORT))


def refusal(request: Request, routes: RouteTable) -> tuple[int, str] | None:
    try:
        check_access(request, NETWORK, routes)
    except HTTPError as err:
        return err.status, err.code
    return None


@pytest.mark.parametrize("target", ["/api/files/a.txt", "/api/files/dir/a.txt",
                                    "/api/files/dir%2Fa.txt", "/api/%66iles/a.txt"])
def test_a_flagged_route_refuses_the_network_whatever_the_spelling(target: str) -> None:
    assert refusal(req("GET", target, NETWORK_PEER), table()) == (403, "local_only")
    assert refusal(req("HEAD", target, NETWORK_PEER), table()) == (403, "local_only")
    assert refusal(req("GET", target, LOOPBACK_PEER), table()) is None


def test_an_unflagged_route_stays_open_with_the_key() -> None:
    assert refusal(req("GET", "/api/open", NETWORK_PEER), table()) is None
    assert [r.method for r in table() if r.access is Access.LOCAL_ONLY] == ["GET"]
