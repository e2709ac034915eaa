"""An adversarial corpus over real sockets: every request is answered with a 4xx (or a
2xx when it is in fact valid) or dropped, never a 5xx, and the server answers a good
request after each one."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from _http_support import Probe, ResponseReader, make_app

from bmoe.http import limits
from bmoe.http.access import AccessPolicy
from bmoe.http.server import serve_http

EOF = "eof"              # half-close (the server takes it as the client leaving), then read
CLOSE = "close"          # vanish without reading
READ_SOME = "read-some"  # wait for the first bytes of an answer
Step = bytes | float | str

H = b"Host: {host}\r\n"
JSON = b"Content-Type: application/json\r\n"
POST_HEAD = b"POST /api/echo HTTP/1.1\r\n" + H + JSON


@dataclass
class Case:
    category: str
    name: str
    steps: list[Step]
    head: bool = False


def post(body: bytes, *, target: bytes = b"/api/echo", extra: bytes = b"") -> bytes:
    return (b"POST " + target + b" HTTP/1.1\r\n" + H + JSON + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def get(target: bytes = b"/api/ping", extra: bytes = b"") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\n" + H + extra + b"\r\n"


# --- the corpus -------------------------------------------------------------------------

def request_line_cases() -> list[Case]:
    lines = [
        b"GET\r\n\r\n", b"GET /\r\n\r\n", b"GET / HTTP/1.1 extra\r\n" + H + b"\r\n",
        b"GET  /api/ping HTTP/1.1\r\n" + H + b"\r\n", b"GET /api/ping\tHTTP/1.1\r\n" + H + b"\r\n",
        b" GET /api/ping HTTP/1.1\r\n" + H + b"\r\n", b"GET /api/ping HTTP/9.9\r\n" + H + b"\r\n",
        b"GET /api/ping HTTP/2.0\r\n" + H + b"\r\n", b"GET /api/ping HTTP/1\r\n" + H + b"\r\n",
        b"GET /api/ping http/1.1\r\n" + H + b"\r\n", b"GET /api/ping HTTP/1.1x\r\n" + H + b"\r\n",
        b"GET /api/ping HTTP/01.1\r\n" + H + b"\r\n", b"G\x00ET /api/ping HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /\x00 HTTP/1.1\r\n" + H + b"\r\n", b"GET /\x7f HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /\xc3\xa9 HTTP/1.1\r\n" + H + b"\r\n", b"GET * HTTP/1.1\r\n" + H + b"\r\n",
        b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n", b"CONNECT 127.0.0.1:443 HTTP/1.1\r\n" + H + b"\r\n",
        b"GET http://{host}/api/ping HTTP/1.1\r\n" + H + b"\r\n",
        b"GET //api/ping HTTP/1.1\r\n" + H + b"\r\n", b"GET /api/%zz HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/%ff HTTP/1.1\r\n" + H + b"\r\n", b"GET /api/ping?%ff=1 HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/ping?a=%ff HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/ping?" + b"a=1&" * 2000 + b" HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n" + H + b"\r\n",
        b"get /api/ping HTTP/1.1\r\n" + H + b"\r\n", b"FOO /api/ping HTTP/1.1\r\n" + H + b"\r\n",
        b"G ET /api/ping HTTP/1.1\r\n" + H + b"\r\n", b"\r\n\r\nGET /api/ping HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/ping HTTP/1.1\n" + H.replace(b"\r\n", b"\n") + b"\n",
        b"GET /api/ping HTTP/1.1\r" + H + b"\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x00" * 100, b"A" * 1000 + b" / HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/ping HTTP/1.1", b"GET /../../../etc/passwd HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /%2e%2e/%2e%2e/etc/passwd HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /..%5c..%5cwindows HTTP/1.1\r\n" + H + b"\r\n",
        b"GET /api/ping#frag HTTP/1.1\r\n" + H + b"\r\n",
        b"TRACE / HTTP/1.1\r\n" + H + b"\r\n", b"DELETE / HTTP/1.1\r\n" + H + JSON + b"\r\n",
    ]
    rng = random.Random(20240601)
    lines += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) + b"\r\n\r\n"
              for _ in range(12)]
    return [Case("request line", f"line {i}", [line]) for i, line in enumerate(lines)]


def header_cases() -> list[Case]:
    start = b"GET /api/ping HTTP/1.1\r\n"
    headers = [
        H + b"Bad Name: x\r\n", H + b"NoColon\r\n", H + b"X-A: a\r\n  folded\r\n", H + b"X-A: a\x00b\r\n",
        H + b"X-A: a\rb\r\n", H + b"X\x7f: a\r\n", H + b"X-A: \x80\xff\xfe\r\n", H + b": empty\r\n",
        H + b"X-\xc3\xa9: a\r\n", H + b"X-A : a\r\n", H + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 30)
                                                                  for i in range(2500)),
        H + b"X-Big: " + b"a" * 70_000 + b"\r\n", b"", H + H, b"Host: \r\n", b"Host: evil.example\r\n",
        b"Host: {host}, evil.example\r\n", b"Host: user@{host}\r\n", b"Host: [::1\r\n",
        b"Host: localhost:99999999999\r\n", b"Host: \xff\xfe\r\n",
        H + b"".join(b"X-%d: v\r\n" % i for i in range(500)),
        H + b"Connection: close, keep-alive, upgrade\r\n",
        H + b"Connection: Upgrade\r\nUpgrade: websocket\r\n",
        H + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n",
        H + b"Expect: 100-continue\r\n", H + b"Expect: something-else\r\n",
        H + b"Authorization: Bearer " + b"k" * 60_000 + b"\r\n", H + b"Origin: https://evil.example\r\n",
        H + b"Origin: null\r\n", H + b"Sec-Fetch-Site: cross-site\r\n", H + b"Sec-Fetch-Site: same-site\r\n",
        H + b"Origin: http://{host}\r\nOrigin: http://evil.example\r\n",
        H + b"Transfer-Encoding: chunked\r\n", H + b"Content-Length: 0\r\n",
        H + b"X-Forwarded-For: 127.0.0.1\r\nX-Real-IP: 127.0.0.1\r\n",
    ]
    cases = [Case("headers", f"headers {i}", [start + h + b"\r\n"]) for i, h in enumerate(headers)]
    cases.append(Case("headers", "HTTP/1.0 without Host", [b"GET /api/ping HTTP/1.0\r\n\r\n"]))
    cases.append(Case("headers", "head cut short", [start + H + b"X-A: b"]))
    return cases


def content_length_cases() -> list[Case]:
    def with_length(value: bytes, body: bytes = b"{}") -> bytes:
        return b"POST /api/echo HTTP/1.1\r\n" + H + JSON + b"Content-Length: " + value + b"\r\n\r\n" + body

    values = [b"-1", b"abc", b"+2", b"0x2", b" 2", b"2 ", b"9" * 20, b"9" * 5000, b"2, 2", b"2,3", b"0002",
              b"", b"1.5", b"2\x00"]
    cases = [Case("content-length", f"value {v[:12]!r}", [with_length(v)]) for v in values]
    cases += [
        Case("content-length", "duplicate equal",
             [POST_HEAD + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}"]),
        Case("content-length", "duplicate differing",
             [POST_HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"]),
        Case("content-length", "over 8 MiB declared", [with_length(str(9 * 1024 * 1024).encode(), b"{")]),
        Case("content-length", "longer than the body", [with_length(b"100")]),
        Case("content-length", "shorter than the body", [with_length(b"1", b'{"name": "x"}')]),
        Case("content-length", "on a GET",
             [b"GET /api/ping HTTP/1.1\r\n" + H + b"Content-Length: 5\r\n\r\nhello"]),
        Case("content-length", "zero on a POST", [with_length(b"0", b"")]),
        Case("content-length", "with transfer-encoding",
             [POST_HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"2\r\n{}\r\n0\r\n\r\n"]),
        Case("content-length", "a real 9 MiB body", [with_length(str(9 * 1024 * 1024).encode(),
                                                                 b" " * (9 * 1024 * 1024))]),
    ]
    return cases


def chunked_cases() -> list[Case]:
    def chunked(te: bytes, body: bytes, version: bytes = b"HTTP/1.1") -> bytes:
        head = b"POST /api/echo " + version + b"\r\n" + H + JSON
        return head + b"Transfer-Encoding: " + te + b"\r\n\r\n" + body

    good = b"2\r\n{}\r\n0\r\n\r\n"
    bodies = [
        good, b"zz\r\n{}\r\n0\r\n\r\n", b"f" * 30 + b"\r\n{}\r\n0\r\n\r\n", b"-2\r\n{}\r\n0\r\n\r\n",
        b"2\r\n{}0\r\n\r\n", b"1\r\n{}\r\n0\r\n\r\n", b"2;ext=\x01\x02\r\n{}\r\n0\r\n\r\n",
        b"2;" + b"e" * 70_000 + b"\r\n{}\r\n0\r\n\r\n", b"2\r\n{}\r\n0\r\nX-Bad Header: 1\r\n\r\n",
        b"2\r\n{}\r\n0\r\nX-Big: " + b"t" * 70_000 + b"\r\n\r\n",
        b"".join(b"1\r\n \r\n" for _ in range(3000)) + b"2\r\n{}\r\n0\r\n\r\n",
        b"  2\r\n{}\r\n0\r\n\r\n", b"0x2\r\n{}\r\n0\r\n\r\n", b"2\r\n{}\r\n",
        b"900000\r\n" + b" " * 1000, b"2\n{}\n0\n\n", b"2\r\n{}\r\n0\r\n\r\nGARBAGE\r\n\r\n",
    ]
    cases = [Case("chunked", f"body {i}", [chunked(b"chunked", b)]) for i, b in enumerate(bodies)]
    for te in (b"chunked, gzip", b"gzip, chunked", b"gzip", b"identity", b"Chunked", b"chunked ",
               b"chunked\x00", b"x-custom", b""):
        cases.append(Case("chunked", f"te {te!r}", [chunked(te, good)]))
    twice = b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
    cases.append(Case("chunked", "te twice", [POST_HEAD + twice + good]))
    cases.append(Case("chunked", "on HTTP/1.0", [chunked(b"chunked", good, b"HTTP/1.0")]))
    return cases


BAD_VALUES: list[Any] = [1, 1.5, "s", True, None, [], {}, [1], [None], -1, 10 ** 30, "\u0000", "\ud800",
                         {"$ref": "#"}, [[[]]], 1e300]


def json_cases() -> list[Case]:
    raw = [
        b"\xff", b'{"name": "\xc3("}', b'{"name": "\xc0\xaf"}', b'{"name": "\xed\xa0\x80"}',
        '{"name": "x"}'.encode("utf-16"), b"\xef\xbb\xbf{}", b"[" * 100_000, b'{"a":' * 50_000,
        b'{"name": "x"', b"{} trailing", b'{"count": NaN}', b'{"count": Infinity}', b'{"count": -Infinity}',
        b'{"count": ' + b"9" * 5000 + b"}", b'{"count": 1e999}', b'{"name": "a", "name": 1}', b"", b"   \n",
        b"null", b"[]", b'"s"', b"1", b"true", b'{"items": [' + b'"a",' * 100_000 + b'"a"]}',
        b'{"name": "' + b"\\u" * 10 + b'"}', b'{"name": "\\ud800\\udc00"}', b"{'name': 'x'}", b"{,}",
        b'{"a": [}', b"\x00", b'{"options": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}",
    ]
    cases = [Case("json", f"raw {i}", [post(b)]) for i, b in enumerate(raw)]
    for target in (b"/api/echo", b"/v1/messages"):
        for field in ("name", "count", "items", "options"):
            for value in BAD_VALUES:
                body = json.dumps({field: value}, allow_nan=True).encode()
                name = f"{target.decode()} {field}={value!r:.20}"
                cases.append(Case("json", name, [post(body, target=target)]))
    return cases


def vanishing_cases() -> list[Case]:
    body = json.dumps({"name": "x" * 1000}).encode()
    whole = post(body)
    chunked = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n400\r\n" + b" " * 100
    points = [0, 5, 20, len(whole) - len(body) - 3, len(whole) - len(body), len(whole) - 500, len(whole) - 1]
    cases = [Case("vanishing", f"close at {p}", [whole[:p], CLOSE]) for p in points]
    cases += [Case("vanishing", f"eof at {p}", [whole[:p], EOF]) for p in points[1:]]
    cases += [
        Case("vanishing", "mid chunk", [chunked, CLOSE]),
        Case("vanishing", "mid stream", [get(b"/api/stream?forever=1"), READ_SOME, CLOSE]),
        Case("vanishing", "while the handler waits", [get(b"/api/wait"), 0.05, CLOSE]),
        Case("vanishing", "after a full request", [get(), CLOSE]),
    ]
    return cases


def slow_cases() -> list[Case]:
    request = get()
    trickle_head: list[Step] = []
    for i in range(0, len(request) - 2, 4):
        trickle_head += [request[i:i + 4], 0.1]
    loris: list[Step] = [b"GET /api/ping HTTP/1.1\r\n" + H]
    for i in range(8):
        loris += [b"X-%d: v\r\n" % i, 0.1]
    body_trickle: list[Step] = [post(b'{"name": "abcdefghij"}')[:-15]]
    for _ in range(6):
        body_trickle += [b" ", 0.15]
    return [
        Case("slow", "idle after connect", [1.0]),
        Case("slow", "head trickled", trickle_head),
        Case("slow", "slowloris headers", loris),
        Case("slow", "body trickled", body_trickle),
        Case("slow", "head then nothing", [request[:-2], 1.0]),
        Case("slow", "expects 100-continue, sends nothing",
             [post(b"{}", extra=b"Expect: 100-continue\r\n")[:-2], 1.0]),
    ]


def access_and_method_cases() -> list[Case]:
    requests = [
        get(extra=b"Origin: https://evil.example\r\n"), get(extra=b"Sec-Fetch-Site: cross-site\r\n"),
        post(b"{}").replace(JSON, b"Content-Type: text/plain\r\n"), post(b"{}").replace(JSON, b""),
        post(b"{}").replace(JSON, b"Content-Type: multipart/form-data; boundary=x\r\n"),
        b"PUT /api/ping HTTP/1.1\r\n" + H + JSON + b"Content-Length: 0\r\n\r\n",
        b"DELETE /api/nope HTTP/1.1\r\n" + H + JSON + b"\r\n",
        b"OPTIONS /api/echo HTTP/1.1\r\n" + H + b"Origin: https://evil.example\r\n"
        b"Access-Control-Request-Method: POST\r\n\r\n",
        b"PATCH /api/echo HTTP/1.1\r\n" + H + JSON + b"\r\n",
        get(b"/api/ping", b"").replace(b"Host: {host}", b"Host: evil.example:80"),
        get(b"/index.html"), get(b"/../secret"), get(b"/.git/config"), get(b"/%2e%2e/%2e%2e/etc/passwd"),
        get(b"/api/items/%ff"), get(b"/api/stream?n=abc"),
    ]
    cases = [Case("access/method", f"request {i}", [r]) for i, r in enumerate(requests)]
    cases.append(Case("access/method", "HEAD on a POST route",
                      [b"HEAD /api/echo HTTP/1.1\r\n" + H + b"\r\n"], head=True))
    cases.append(Case("access/method", "HEAD ping",
                      [b"HEAD /api/ping HTTP/1.1\r\n" + H + b"\r\n"], head=True))
    return cases


def pipelining_cases() -> list[Case]:
    return [
        Case("pipelining", "good then garbage", [get() + b"GARBAGE\r\n\r\n"]),
        Case("pipelining", "100 pings", [get() * 100]),
        Case("pipelining", "post then smuggled",
             [post(b"{}") + b"GET /api/items/x HTTP/1.1\r\n" + H + b"\r\n"]),
        Case("pipelining", "bad json then good", [post(b"{") + get()]),
        Case("pipelining", "over the pipeline buffer",
             [get(b"/api/wait?n=1") + get() * 2000, 0.05, CLOSE]),
    ]


def corpus() -> list[Case]:
    return (request_line_cases() + header_cases() + content_length_cases() + chunked_cases()
            + json_cases() + vanishing_cases() + slow_cases() + access_and_method_cases()
            + pipelining_cases())


# --- running it ---------------------------------------------------------------------------

CASE_TIMEOUT_S = 5.0


async def play(port: int, case: Case) -> str:
    """Run one case; its outcome: a status, "dropped", "vanished", "hung" or "cut"."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        with trio.fail_after(CASE_TIMEOUT_S):
            for step in case.steps:
                done = await _step(stream, step, port)
                if done == "vanished":
                    return done
                if done == "refused":
                    break
            response = await ResponseReader(stream).read(head_only=case.head)
    except trio.TooSlowError:
        return "hung"
    except EOFError:
        return "cut"
    finally:
        await stream.aclose()
    return "dropped" if response is None else str(response.status)


async def _step(stream: trio.SocketStream, step: Step, port: int) -> str | None:
    """Perform one step: "vanished" when the client left, "refused" when the server
    stopped taking bytes (read its answer then)."""
    try:
        if isinstance(step, bytes):
            await stream.send_all(step.replace(b"{host}", b"127.0.0.1:%d" % port))
        elif isinstance(step, float):
            await trio.sleep(step)
        elif step == EOF:
            await stream.send_eof()
        elif step == READ_SOME:
            await stream.receive_some(1000)
        elif step == CLOSE:
            return "vanished"
    except trio.BrokenResourceError:
        return "refused"
    return None


async def healthy(port: int) -> bool:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        with trio.fail_after(CASE_TIMEOUT_S):
            await stream.send_all(b"GET /api/ping HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
            response = await ResponseReader(stream).read()
    finally:
        await stream.aclose()
    return response is not None and response.status == 200


def test_corpus_is_large_enough() -> None:
    assert len(corpus()) >= 300


def test_adversarial_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(limits, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(limits, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(limits, "KEEPALIVE_IDLE_S", 0.3)
    monkeypatch.setattr(limits, "LINGER_S", 0.3)
    (tmp_path / "index.html").write_text("<!doctype html>")
    (tmp_path.parent / "secret").write_text("outside")
    probe = Probe()
    limiter = trio.CapacityLimiter(limits.EVENT_STREAMS)
    app = make_app(probe, policy=AccessPolicy("127.0.0.1"), static_dir=tmp_path, stream_limiter=limiter)
    cases = corpus()
    outcomes: list[tuple[Case, str, bool]] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            for case in cases:
                outcome = await play(port, case)
                outcomes.append((case, outcome, await healthy(port)))
            with trio.fail_after(2):
                while limiter.borrowed_tokens or probe.cancels < 2:  # noqa: ASYNC110 (observing)
                    await trio.sleep(0.01)         # every stream given back, every waiter cancelled
            nursery.cancel_scope.cancel()

    trio.run(main)
    _report(outcomes, capsys)
    bad = [(c.category, c.name, o) for c, o, _ in outcomes
           if o in ("hung", "cut") or (o.isdigit() and int(o) >= 500)]
    assert not bad, bad
    assert all(ok for _, _, ok in outcomes), [c.name for c, _, ok in outcomes if not ok]


def _report(outcomes: list[tuple[Case, str, bool]], capsys: pytest.CaptureFixture[str]) -> None:
    total = Counter(o for _, o, _ in outcomes)
    by_category: dict[str, Counter[str]] = {}
    for case, outcome, _ in outcomes:
        by_category.setdefault(case.category, Counter())[outcome] += 1
    with capsys.disabled():
        print(f"\nadversarial corpus: {len(outcomes)} requests; outcomes {dict(sorted(total.items()))}")
        for category, counts in by_category.items():
            print(f"  {category:15} {dict(sorted(counts.items()))}")
