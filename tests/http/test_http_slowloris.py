"""Slow clients against the real server loop on loopback sockets (the app is a stand-in):
40 and 200 connections that trickle a request head, reconnecting when closed, while a
normal client asks ``GET /api/info``, a chat streams and the UI's event stream stays open.

The head deadline is shortened here (the real one is proven in test_slowloris_e2e.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from _http_support import (
    ATTACK_HEAD_TIMEOUT_S,
    StreamWatch,
    attack,
    check_attack,
    check_streams,
    streaming_app,
)

from bmoe.http import limits
from bmoe.http.access import AccessPolicy
from bmoe.http.server import serve_http


@pytest.mark.parametrize("tricklers", [40, 200])
def test_tricklers_from_loopback_hold_no_worker(tricklers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "HEAD_TIMEOUT_S", ATTACK_HEAD_TIMEOUT_S)
    app = streaming_app(AccessPolicy("127.0.0.1"))

    async def main() -> tuple[dict[str, Any], StreamWatch, StreamWatch, float]:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            outcome = await attack("127.0.0.1", port, tricklers)
            nursery.cancel_scope.cancel()
        return outcome

    report, chat, events, began = trio.run(main)
    check_attack(report, tricklers=tricklers, head_timeout=ATTACK_HEAD_TIMEOUT_S,
                 peer_arriving=limits.PEER_ARRIVING)
    check_streams(chat, events, began)
