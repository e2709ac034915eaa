"""One connection over trio memory streams: framing, limits, errors, cancellation."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing
from _http_support import (
    HOST,
    PORT,
    Probe,
    ResponseReader,
    anthropic_shaper,
    assert_security_headers,
    exchange,
    make_app,
    one,
    request_bytes,
    run,
)

from bmoe.http import limits
from bmoe.http.access import AccessPolicy
from bmoe.http.connection import PeerGone, serve_connection
from bmoe.http.routes import RouteTable
from bmoe.http.server import HttpApp
from bmoe.http.sse import sse_done
from bmoe.http.types import Request, Send, StreamResponse

GET_PING = request_bytes("GET", "/api/ping")


def test_keep_alive_two_requests_on_one_connection() -> None:
    app = make_app()

    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(app, server))
            reader = ResponseReader(client)
            for tag in ("one", "two"):
                await client.send_all(request_bytes("GET", f"/api/ping?tag={tag}"))
                response = await reader.read()
                assert response is not None and response.status == 200
                assert response.json() == {"ok": True, "tag": tag}
                assert response.header("connection") != "close"
            await client.aclose()
    run(main)


def test_pipelined_requests_are_answered_in_order() -> None:
    app = make_app()
    data = b"".join(request_bytes("GET", f"/api/ping?tag={i}") for i in range(3))
    got = run(lambda: exchange(app, data, responses=3))
    assert [r.json()["tag"] for r in got] == ["0", "1", "2"]


def test_refusal_keeps_the_connection_for_the_next_request() -> None:
    app = make_app()
    data = request_bytes("GET", "/api/nope") + request_bytes(
        "POST", "/api/echo", body=b"{}", content_type="text/plain") + GET_PING
    got = run(lambda: exchange(app, data, responses=3))
    assert [r.status for r in got] == [404, 415, 200]


def test_body_over_the_cap_is_413_from_content_length() -> None:
    app = make_app(body_limit=100)
    response = one(app, request_bytes("POST", "/api/echo", json_body={"name": "x" * 200}))
    assert response.status == 413 and response.json()["code"] == "too_large"
    assert response.header("connection") == "close"
    assert_security_headers(response)


def test_body_over_the_cap_is_413_when_chunked() -> None:
    app = make_app(body_limit=100)
    head = (f"POST /api/echo HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunks = b"".join(b"20\r\n" + b" " * 32 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    response = one(app, head + chunks)
    assert response.status == 413


def test_body_at_the_cap_is_accepted() -> None:
    app = make_app(body_limit=100)
    body = b'{"name": "' + b"x" * 88 + b'"}'
    assert len(body) == 100
    response = one(app, request_bytes("POST", "/api/echo", body=body, content_type="application/json"))
    assert response.status == 200


def test_default_body_limit_is_eight_mib() -> None:
    app = make_app()
    head = (f"POST /api/echo HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limits.BODY_LIMIT_BYTES + 1}\r\n\r\n").encode()
    assert one(app, head).status == 413


def test_oversized_head_is_431() -> None:
    app = make_app()
    # Arriving in pieces: h11's bound on an incomplete head.
    head = f"GET /api/ping HTTP/1.1\r\nHost: {HOST}\r\nX-Big: ".encode() + b"a" * (100 * 1024)
    assert one(app, head).status == 431
    # Arriving whole: measured once parsed.
    whole = request_bytes("GET", "/api/ping", headers=[("X-Big", "b" * (limits.MAX_HEADER_BYTES + 10))])
    response = one(app, whole)
    assert response.status == 431 and response.json()["code"] == "headers_too_large"
    assert_security_headers(response)


def test_post_without_json_content_type_is_415() -> None:
    app = make_app()
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"):
        response = one(app, request_bytes("POST", "/api/echo", body=b"{}", content_type=content_type))
        assert response.status == 415, content_type
        assert response.json()["code"] == "unsupported_media_type"
    for content_type in ("application/json", "APPLICATION/JSON", "application/json; charset=utf-8"):
        response = one(app, request_bytes("POST", "/api/echo", body=b"{}", content_type=content_type))
        assert response.status == 200, content_type


def test_unknown_route_is_json_404() -> None:
    response = one(make_app(), request_bytes("GET", "/api/nope"))
    assert response.status == 404
    assert response.header("content-type") == "application/json"
    assert response.json() == {"error": "No such route.", "code": "not_found"}
    assert_security_headers(response)


def test_wrong_method_is_405_with_allow() -> None:
    response = one(make_app(), request_bytes("DELETE", "/api/echo", content_type="application/json"))
    assert response.status == 405
    assert response.json()["code"] == "method_not_allowed"
    assert response.header("allow") == "POST, PUT"


def test_handler_exception_is_500_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="bmoe.http"):
        response = one(make_app(), request_bytes("GET", "/api/boom"))
    assert response.status == 500
    assert response.json()["code"] == "internal"
    assert b"secret" not in response.body and b"Traceback" not in response.body
    assert b"RuntimeError" not in response.body
    assert "secret detail" in caplog.text and "Traceback" in caplog.text
    assert_security_headers(response)


def test_http_error_becomes_its_json() -> None:
    response = one(make_app(), request_bytes("GET", "/api/teapot"))
    assert response.status == 418
    assert response.json() == {"error": "Short and stout.", "code": "teapot"}
    assert response.header("x-tea") == "earl grey"


def test_bad_bodies_are_400_invalid_request() -> None:
    app = make_app()
    bodies = [b"not json", b"[1, 2]", b'"text"', b"\xff\xfe{}", b"[" * 100_000, b"{" * 50_000,
              b'{"name": 1}', b'{"count": "3"}', b'{"count": true}', b'{"items": [1]}',
              b'{"count": NaN}', b'{"a": 1', b"1" * 5000]
    for body in bodies:
        response = one(app, request_bytes("POST", "/api/echo", body=body, content_type="application/json"))
        assert response.status == 400, body[:20]
        assert response.json()["code"] == "invalid_request"


@pytest.mark.parametrize("body", [
    b'{"name": "\\ud800"}', b'{"name": "a\\uDFFFb"}', b'{"name": "\\udc00\\ud800"}',
    b'{"items": ["x", {"\\ud83d": 1}]}', b'["\\uDBFF"]'])
def test_a_lone_surrogate_is_not_text_so_400(body: bytes) -> None:
    """Valid JSON syntax with no UTF-8 form: refused where every body is decoded, in a
    value, a key or deep inside, before a handler sees it."""
    response = one(make_app(), request_bytes("POST", "/api/echo", body=body,
                                             content_type="application/json"))
    assert response.status == 400, body
    assert response.json()["code"] == "invalid_request"
    assert "lone UTF-16 surrogate" in response.json()["error"]


@pytest.mark.parametrize("body", [b'{"name": "\\ud83d\\ude00"}', b'{"name": "\\\\ud800"}'])
def test_a_surrogate_pair_or_an_escaped_backslash_is_text(body: bytes) -> None:
    response = one(make_app(), request_bytes("POST", "/api/echo", body=body,
                                             content_type="application/json"))
    assert response.status == 200, response.body
    assert response.json()["name"] == json.loads(body)["name"]


def test_malformed_requests_are_400_and_close() -> None:
    app = make_app()
    for data in (b"GARBAGE\r\n\r\n", b"GET /api/ping HTTP/1.1\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                 b"GET /api/ping HTTP/2.0\r\nHost: " + HOST.encode() + b"\r\n\r\n",
                 b"GET http://evil/api/ping HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\n\r\n",
                 b"GET /api/%ff HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\n\r\n"):
        response = one(app, data)
        assert response.status == 400, data
        assert response.header("connection") == "close"
        assert_security_headers(response)


def test_unsupported_transfer_encoding_is_400_not_501() -> None:
    data = request_bytes("POST", "/api/echo", content_type="application/json",
                         headers=[("Transfer-Encoding", "gzip")])
    assert one(make_app(), data).status == 400


def test_content_length_with_transfer_encoding_is_refused() -> None:
    data = (f"POST /api/echo HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode()
    assert one(make_app(), data).status == 400


def test_expect_100_continue() -> None:
    data = request_bytes("POST", "/api/echo", json_body={"name": "n"}, headers=[("Expect", "100-continue")])

    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            head, _, body = data.partition(b"\r\n\r\n")
            await client.send_all(head + b"\r\n\r\n")
            reader = ResponseReader(client)
            interim = await reader._take_until(b"\r\n\r\n")
            assert interim is not None and interim.startswith(b"HTTP/1.1 100")
            await client.send_all(body)
            response = await reader.read()
            assert response is not None and response.status == 200
            await client.aclose()
    run(main)


def test_head_gets_headers_and_no_body() -> None:
    response = one(make_app(), request_bytes("HEAD", "/api/ping"), head_only=True)
    assert response.status == 200 and response.body == b""
    assert response.header("content-length") == str(len(b'{"ok":true,"tag":""}'))


def test_path_params() -> None:
    response = one(make_app(), request_bytes("GET", "/api/items/a%2Fb%20c"))
    assert response.json() == {"id": "a/b c"}


def test_stream_is_chunked_sse_with_headers() -> None:
    response = one(make_app(), request_bytes("GET", "/api/stream?n=2"))
    assert response.status == 200
    assert response.header("content-type") == "text/event-stream"
    assert response.header("cache-control") == "no-cache"
    assert response.header("transfer-encoding") == "chunked"
    assert_security_headers(response)
    assert response.body == (b'event: tick\ndata: {"i":0}\n\nevent: tick\ndata: {"i":1}\n\n'
                             b"data: [DONE]\n\n")


def test_stream_error_after_200_is_one_error_chunk(caplog: pytest.LogCaptureFixture) -> None:
    response = one(make_app(), request_bytes("GET", "/api/stream?n=1&fail=http"))
    assert response.body.endswith(b'data: {"error":{"message":"Gone busy.","code":"busy"}}\n\n')
    with caplog.at_level(logging.ERROR, logger="bmoe.http"):
        response = one(make_app(), request_bytes("GET", "/api/stream?n=1&fail=bug"))
    assert response.body.endswith(b'"code":"internal"}}\n\n')
    assert b"secret" not in response.body and "secret stream detail" in caplog.text


def test_failed_plain_stream_is_cut_short(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="bmoe.http"), pytest.raises(ExceptionGroup) as info:
        run(lambda: exchange(make_app(), request_bytes("GET", "/api/plain-stream")))
    assert info.group_contains(EOFError, match="cut short")


def test_security_headers_on_every_kind_of_response(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()
    with caplog.at_level(logging.CRITICAL, logger="bmoe.http"):
        for data in (GET_PING, request_bytes("GET", "/api/nope"), request_bytes("GET", "/api/boom"),
                     request_bytes("GET", "/api/teapot"), request_bytes("GET", "/"),
                     request_bytes("GET", "/api/ping", host="evil.example:8765"),
                     request_bytes("PATCH", "/api/echo", content_type="application/json"),
                     b"BAD\r\n\r\n"):
            assert_security_headers(one(app, data))


def test_error_shaper_shapes_its_family_including_access_refusals() -> None:
    app = make_app(error_shaper=anthropic_shaper)
    response = one(app, request_bytes("POST", "/v1/messages", body=b"{}", content_type="text/plain"))
    assert response.status == 415
    assert response.json() == {"type": "error", "error": {
        "type": "unsupported_media_type", "message": response.json()["error"]["message"]}}
    response = one(app, request_bytes("POST", "/v1/messages", json_body={"name": 3}))
    assert response.status == 400 and response.json()["error"]["type"] == "invalid_request"
    assert one(app, request_bytes("GET", "/api/nope")).json()["code"] == "not_found"


def test_error_shaper_keeps_the_errors_headers() -> None:
    app = make_app(error_shaper=anthropic_shaper, policy=AccessPolicy("127.0.0.1", PORT, api_key="k"))
    response = one(app, request_bytes("POST", "/v1/messages", json_body={}))
    assert response.status == 401 and response.header("www-authenticate") == "Bearer"
    assert response.json()["type"] == "error"


def test_client_that_disconnects_cancels_its_handler() -> None:
    probe = Probe()
    app = make_app(probe)

    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(app, server))
            await client.send_all(request_bytes("GET", "/api/wait"))
            await probe.started.wait()
            start = trio.current_time()
            await client.aclose()
            with trio.fail_after(1):
                await probe.cancelled.wait()
            assert trio.current_time() - start < 1
    run(main)


def test_disconnect_cancels_a_stream_and_frees_its_limiter() -> None:
    probe = Probe()
    limiter = trio.CapacityLimiter(1)
    app = make_app(probe, stream_limiter=limiter)

    async def main() -> None:
        first, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(app, server))
            await first.send_all(request_bytes("GET", "/api/stream?forever=1"))
            reader = ResponseReader(first)
            await reader.read_chunks_until(b"filler")
            assert limiter.borrowed_tokens == 1
            (full,) = await exchange(app, request_bytes("GET", "/api/stream"))
            assert full is not None and full.status == 503
            assert full.json()["code"] == "streams_full"
            await first.aclose()
        assert isinstance(probe.stream_error, trio.Cancelled)
        assert limiter.borrowed_tokens == 0
        (again,) = await exchange(app, request_bytes("GET", "/api/stream?n=1"))
        assert again is not None and again.status == 200
    run(main)


def test_slow_reader_is_dropped_after_the_write_timeout() -> None:
    probe = Probe()
    app = make_app(probe)

    async def main() -> None:
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(app, server))
            await client.send_all(request_bytes("GET", "/api/stream?forever=1"))
            received = b""
            while b"filler" not in received:          # the stream is flowing ...
                received += await client.receive_some(1000)
            start = trio.current_time()                # ... then this client stops reading
        elapsed = trio.current_time() - start
        assert limits.WRITE_TIMEOUT_S <= elapsed < limits.WRITE_TIMEOUT_S + 1
        assert isinstance(probe.stream_error, (PeerGone, trio.Cancelled))
        await client.aclose()
    run(main, autojump=True)


def test_slow_sender_gets_408_at_the_head_deadline() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            start = trio.current_time()

            async def trickle() -> None:
                for byte in request_bytes("GET", "/api/ping")[:-2]:   # never finishes the head
                    await client.send_all(bytes([byte]))
                    await trio.sleep(1)
            nursery.start_soon(trickle)
            response = await ResponseReader(client).read()
            assert response is not None and response.status == 408
            assert trio.current_time() - start == pytest.approx(limits.HEAD_TIMEOUT_S)
            nursery.cancel_scope.cancel()
    run(main, autojump=True)


def test_idle_connection_is_closed_after_keepalive_idle() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            await client.send_all(GET_PING)
            reader = ResponseReader(client)
            assert (await reader.read()) is not None
            start = trio.current_time()
            assert await reader.read() is None          # the server closed
            assert trio.current_time() - start == pytest.approx(limits.KEEPALIVE_IDLE_S)
    run(main, autojump=True)


def test_client_vanishing_mid_body_is_dropped_quietly() -> None:
    data = request_bytes("POST", "/api/echo", json_body={"name": "x" * 100})[:-20]

    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            await client.send_all(data)
            await client.send_eof()
            response = await ResponseReader(client).read()
            assert response is None or response.status == 400
            await client.aclose()
    run(main)


def test_head_on_a_stream_gets_headers_only() -> None:
    response = one(make_app(), request_bytes("HEAD", "/api/stream"), head_only=True)
    assert response.status == 200 and response.body == b""
    assert response.header("content-type") == "text/event-stream"


def test_a_bare_event_stream_still_gets_no_cache() -> None:
    async def bare(request: Request) -> StreamResponse:
        async def produce(send: Send) -> None:
            await send(sse_done())
        return StreamResponse(produce)

    routes = RouteTable()
    routes.add("GET", "/api/bare", bare)
    response = one(HttpApp(routes, AccessPolicy("127.0.0.1", PORT)), request_bytes("GET", "/api/bare"))
    assert response.header("cache-control") == "no-cache" and response.body == sse_done()
