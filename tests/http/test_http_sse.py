"""Server-sent event encoding, byte for byte."""

from __future__ import annotations

import pytest

from bmoe.http.sse import sse_comment, sse_done, sse_error, sse_event, sse_response


def test_named_event() -> None:
    assert sse_event("state", {"a": 1, "b": "é"}) == 'event: state\ndata: {"a":1,"b":"é"}\n\n'.encode()


def test_unnamed_event() -> None:
    assert sse_event(None, [1, 2]) == b"data: [1,2]\n\n"


def test_line_breaks_in_data_stay_escaped() -> None:
    assert sse_event(None, {"t": "a\nb\r\nc"}) == b'data: {"t":"a\\nb\\r\\nc"}\n\n'


def test_lone_surrogate_is_escaped_not_fatal() -> None:
    assert sse_event(None, "\ud800") == b'data: "\\ud800"\n\n'


def test_event_name_with_line_break_is_refused() -> None:
    with pytest.raises(ValueError):
        sse_event("a\nb", 1)


def test_comment() -> None:
    assert sse_comment("ping") == b": ping\n\n"
    assert sse_comment("a\nb") == b": a\n: b\n\n"


def test_done_and_error() -> None:
    assert sse_done() == b"data: [DONE]\n\n"
    assert sse_error("Gone.", "busy") == b'data: {"error":{"message":"Gone.","code":"busy"}}\n\n'


def test_sse_response_headers() -> None:
    async def produce(send) -> None:
        pass
    response = sse_response(produce, headers=[("X-A", "1")])
    assert response.content_type == "text/event-stream"
    assert ("Cache-Control", "no-cache") in response.headers and ("X-A", "1") in response.headers
