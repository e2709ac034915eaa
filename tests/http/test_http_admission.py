"""Admission without sockets: the workers' queue, the readers' seats and places, and the
deadlines of a request's head and body (trio memory streams and a mock clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from _http_support import GET_PING_BYTES, ResponseReader, make_app, request_bytes, run

from bmoe.http import limits
from bmoe.http.admission import Admission, Readers, Workers, peer_key
from bmoe.http.connection import body_deadline, serve_connection

# --- peers -----------------------------------------------------------------------------


def test_a_peer_is_its_address_or_its_ipv6_64() -> None:
    assert peer_key("127.0.0.1") == "127.0.0.1"
    assert peer_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert peer_key("::1") == "::/64"
    assert peer_key("2001:db8:1:2:aaaa::1") == peer_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::1") != peer_key("2001:db8:1:2::1")
    assert peer_key("fe80::1%eth0") == "fe80::/64"


# --- workers ---------------------------------------------------------------------------

def test_workers_serve_the_queue_by_ticket_not_by_arrival_at_the_queue() -> None:
    async def main() -> None:
        workers = Workers(1, 3)
        order: list[int] = []
        release = trio.Event()

        async def request(ticket: int) -> None:
            async with workers.hold(ticket):
                order.append(ticket)
                if ticket == 0:
                    await release.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, 0)
            await trio.testing.wait_all_tasks_blocked()
            for ticket in (3, 1, 2):                 # heads completed out of order
                nursery.start_soon(request, ticket)
                await trio.testing.wait_all_tasks_blocked()
            assert workers.queued == 3 and workers.full()
            release.set()
        assert order == [0, 1, 2, 3]
        assert not workers.full() and workers.queued == 0
    run(main)


def test_a_cancelled_waiter_leaves_the_queue_and_a_granted_one_passes_its_worker_on() -> None:
    async def main() -> None:
        workers = Workers(1, 4)
        release = trio.Event()
        served: list[int] = []

        async def request(ticket: int) -> None:
            async with workers.hold(ticket):
                served.append(ticket)
                await release.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, 0)
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as scope:
                scope.cancel()
                await request(1)                     # gives up before being served
            assert workers.queued == 0
            nursery.start_soon(request, 2)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert served == [0, 2]
    run(main)


# --- readers ---------------------------------------------------------------------------

def test_places_per_peer() -> None:
    readers = Readers(10, 2)
    a1, a2, a3, b1 = (readers.seat(ip) for ip in ("10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.2"))
    assert a1 and a2 and a3 and b1
    assert a1.take_place() and a1.take_place() and a2.take_place()
    assert not a3.take_place()                       # the peer's two places are taken
    assert b1.take_place()                           # another peer has its own
    a1.leave()
    assert a3.take_place()
    assert readers.seated == 3 and readers.arriving["10.0.0.1"] == 2


def test_a_new_connection_takes_back_the_oldest_idle_seat_of_its_own_peer_first() -> None:
    async def main() -> None:
        readers = Readers(3, 8)
        seats = [readers.seat(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.2")]
        scopes = [trio.CancelScope() for _ in seats]
        with seats[0].idle(scopes[0]), seats[1].idle(scopes[1]), seats[2].idle(scopes[2]):
            assert readers.seat("10.0.0.2") is not None
            assert [s.cancel_called for s in scopes] == [False, True, False]
            assert readers.seat("10.0.0.9") is not None            # no idle seat of its own
            assert [s.cancel_called for s in scopes] == [True, True, False]
        assert readers.seated == 3
    run(main)


def test_no_seat_when_none_is_idle() -> None:
    readers = Readers(2, 8)
    first, second = readers.seat("10.0.0.1"), readers.seat("10.0.0.1")
    assert first and second and first.take_place()
    assert readers.seat("10.0.0.1") is None
    first.leave()
    first.leave()                                    # leaving twice frees one seat
    assert readers.seated == 1 and readers.seat("10.0.0.3") is not None


# --- deadlines on one connection --------------------------------------------------------

def test_a_new_connection_that_sends_nothing_is_closed_when_idle_too_long() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            start = trio.current_time()
            assert await ResponseReader(client).read() is None
            assert trio.current_time() - start == pytest.approx(limits.KEEPALIVE_IDLE_S)
    run(main, autojump=True)


def test_the_head_deadline_runs_from_the_first_byte() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            await trio.sleep(limits.KEEPALIVE_IDLE_S - 1)          # connected, idle
            start = trio.current_time()
            nursery.start_soon(trickle, client, GET_PING_BYTES[:-2], 1.0)
            response = await ResponseReader(client).read()
            assert response is not None and response.status == 408
            assert trio.current_time() - start == pytest.approx(limits.HEAD_TIMEOUT_S)
            nursery.cancel_scope.cancel()
    run(main, autojump=True)


async def trickle(stream: trio.abc.SendStream, data: bytes, interval: float) -> None:
    try:
        for byte in data:
            await stream.send_all(bytes([byte]))
            await trio.sleep(interval)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def test_a_trickled_head_is_408_at_the_head_deadline_however_it_trickles() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            start = trio.current_time()
            nursery.start_soon(trickle, client, GET_PING_BYTES[:-2], 0.5)   # never finishes
            response = await ResponseReader(client).read()
            assert response is not None and response.status == 408
            assert response.header("connection") == "close"
            assert trio.current_time() - start == pytest.approx(limits.HEAD_TIMEOUT_S)
            nursery.cancel_scope.cancel()
    run(main, autojump=True)


def test_the_next_head_on_a_kept_alive_connection_has_its_deadline_from_its_first_byte() -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            reader = ResponseReader(client)
            await client.send_all(GET_PING_BYTES)
            assert (await reader.read()).status == 200
            await trio.sleep(limits.KEEPALIVE_IDLE_S - 1)          # idle: no deadline runs
            start = trio.current_time()
            nursery.start_soon(trickle, client, GET_PING_BYTES[:-2], 1.0)
            response = await reader.read()
            assert response is not None and response.status == 408
            assert trio.current_time() - start == pytest.approx(limits.HEAD_TIMEOUT_S)
            nursery.cancel_scope.cancel()
    run(main, autojump=True)


def test_the_body_deadline_grows_with_the_bytes_at_the_floor_rate() -> None:
    assert body_deadline(100.0, 0) == 100.0 + limits.BODY_GRACE_S
    assert body_deadline(100.0, limits.BODY_FLOOR_BYTES_PER_S * 3) == pytest.approx(
        100.0 + limits.BODY_GRACE_S + 3)


def post_echo_head(length: int) -> bytes:
    return request_bytes("POST", "/api/echo", content_type="application/json",
                         headers=[("Content-Length", str(length))])


def test_a_body_below_the_floor_rate_is_408_and_one_above_it_is_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "BODY_FLOOR_BYTES_PER_S", 100)
    body = b'{"name": "' + b"x" * 1988 + b'"}'               # 2000 bytes: 20 s at the floor rate

    async def send(rate: float) -> tuple[int, float]:
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(make_app(), server))
            start = trio.current_time()
            await client.send_all(post_echo_head(len(body)))

            async def body_at_rate() -> None:
                try:
                    for i in range(0, len(body), 10):
                        await client.send_all(body[i:i + 10])
                        await trio.sleep(10 / rate)
                except trio.BrokenResourceError:
                    pass
            nursery.start_soon(body_at_rate)
            response = await ResponseReader(client).read()
            assert response is not None
            nursery.cancel_scope.cancel()
        return response.status, trio.current_time() - start

    async def main() -> None:
        status, took = await send(150)                           # past the grace, but above the floor
        assert status == 200 and took > limits.BODY_GRACE_S
        status, took = await send(50)                            # half the floor rate: falls behind
        assert status == 408
        assert limits.BODY_GRACE_S < took < limits.BODY_GRACE_S + len(body) / 100
    run(main, autojump=True)


# --- the reader phase, with admission -----------------------------------------------------

def test_a_peer_out_of_places_has_its_next_trickler_closed_at_once_but_whole_heads_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "PEER_ARRIVING", 2)
    admission = Admission.from_limits()
    app = make_app()

    async def connect(nursery: trio.Nursery) -> trio.testing.MemorySendStream:
        client, server = trio.testing.memory_stream_pair()
        seat = admission.readers.seat("127.0.0.1")
        assert seat is not None
        nursery.start_soon(lambda: serve_connection(app, server, admission=admission, seat=seat,
                                                    ticket=admission.workers.ticket()))
        return client

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            tricklers = [await connect(nursery) for _ in range(3)]
            for client in tricklers:
                await client.send_all(b"GET /api/pi")
                await trio.testing.wait_all_tasks_blocked()
            assert admission.readers.arriving["127.0.0.1"] == 2
            assert await ResponseReader(tricklers[2]).read() is None     # the third: closed at once
            whole = await connect(nursery)
            await whole.send_all(GET_PING_BYTES)
            response = await ResponseReader(whole).read()
            assert response is not None and response.status == 200
            assert admission.readers.seated == 3       # two tricklers and the kept-alive one
            nursery.cancel_scope.cancel()
    run(main)


def test_a_kept_alive_connection_holds_a_seat_not_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "WORKERS", 1)
    admission = Admission.from_limits()
    app = make_app()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            readers = []
            for _ in range(3):                      # three kept-alive connections, one worker
                client, server = trio.testing.memory_stream_pair()
                seat = admission.readers.seat("127.0.0.1")
                nursery.start_soon(lambda server=server, seat=seat: serve_connection(
                    app, server, admission=admission, seat=seat, ticket=admission.workers.ticket()))
                reader = ResponseReader(client)
                await client.send_all(GET_PING_BYTES)
                assert (await reader.read()).status == 200
                readers.append((client, reader))
            for client, reader in readers:          # each one's next request is served at once
                await client.send_all(GET_PING_BYTES)
                assert (await reader.read()).status == 200
            assert admission.readers.seated == 3 and admission.workers.queued == 0
            nursery.cancel_scope.cancel()
    run(main)


def test_a_refusal_is_answered_without_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "WORKERS", 1)
    admission = Admission.from_limits()
    probe_app = make_app()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async with admission.workers.hold(admission.workers.ticket()):   # the only worker, taken
                client, server = trio.testing.memory_stream_pair()
                seat = admission.readers.seat("127.0.0.1")
                nursery.start_soon(lambda: serve_connection(probe_app, server, admission=admission,
                                                            seat=seat, ticket=admission.workers.ticket()))
                await client.send_all(request_bytes("GET", "/api/nope") + request_bytes(
                    "POST", "/api/echo", body=b"{}", content_type="text/plain"))
                reader = ResponseReader(client)
                assert (await reader.read()).status == 404
                assert (await reader.read()).status == 415
                await client.send_all(GET_PING_BYTES)
                await trio.testing.wait_all_tasks_blocked()
                assert admission.workers.queued == 1                 # a whole request waits
            assert (await reader.read()).status == 200
            nursery.cancel_scope.cancel()
    run(main)


def test_an_idle_connection_is_closed_when_its_seat_is_taken_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "READERS", 1)
    admission = Admission.from_limits()
    app = make_app()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            client, server = trio.testing.memory_stream_pair()
            seat = admission.readers.seat("10.0.0.1")
            nursery.start_soon(lambda: serve_connection(app, server, admission=admission, seat=seat))
            reader = ResponseReader(client)
            await client.send_all(GET_PING_BYTES)
            assert (await reader.read()).status == 200            # kept alive, idle, seated
            await trio.testing.wait_all_tasks_blocked()
            assert admission.readers.seat("10.0.0.2") is not None  # a newcomer takes the seat back
            with trio.fail_after(1):
                assert await reader.read() is None                # the idle one is closed
            assert admission.readers.seated == 1
            nursery.cancel_scope.cancel()
    run(main)
