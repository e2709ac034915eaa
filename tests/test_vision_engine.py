"""The projector on the engine: cancel reaching the encoder, the KV after it, image ids,
the expert streamer's callback during an image prefill."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from bmoe.engine.images import ImageSet
from bmoe.engine.session import Session
from bmoe.engine.turn import TurnRequest, prepare, run_turn
from bmoe.engine.vision import CANCEL_STRIDE, image_ids
from bmoe.modelmaker.projector import make_vision_pair


def png(color: tuple[int, int, int]) -> str:
    b = io.BytesIO()
    Image.new("RGB", (30, 20), color).save(b, "PNG")
    return "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    model, _ = make_vision_pair(tmp_path_factory.mktemp("vpair"))
    s = Session(model, {"ctx-size": 1024, "threads": 1})
    yield s
    s.close()


def turn(session: Session, urls: list[str], cancel: threading.Event | None = None) -> Any:
    images = ImageSet()
    marks = "".join(images.add(u, f"content[{i}]", "messages[0]") for i, u in enumerate(urls))
    req = TurnRequest(messages=[{"role": "user", "content": "see " + marks + " now"}],
                      max_tokens=2, images=images)
    prepared = prepare(session, req)
    return run_turn(session, prepared, req, cancel or threading.Event(), lambda e, r: None)


class CancelInEncoder(threading.Event):
    """Set from the projector's first look at the flag on: a stop during an encode."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def is_set(self) -> bool:
        vision = self.session.vision
        if vision is not None and vision._cancel is self and vision._nodes >= CANCEL_STRIDE:
            self.set()
        return super().is_set()


def test_cancel_reaches_the_encoder_and_the_next_turn_is_whole(session: Session) -> None:
    assert session.vision is not None
    full = turn(session, [png((1, 2, 3))])
    nodes_whole = session.vision._nodes
    session.clear_kv()
    encodes = session.vision.encodes
    cut = turn(session, [png((9, 9, 9))], CancelInEncoder(session))
    assert cut.generation.finish == "cancelled" and cut.generation.tokens == []
    assert session.vision.encodes == encodes                # the stopped encode is not kept
    assert session.vision._nodes < nodes_whole               # the graph stopped early
    kv = len(session.kv_tokens)
    assert kv == 0 or min(session.kv_tokens) >= 0           # no half image in the KV
    again = turn(session, [png((9, 9, 9))])
    assert again.generation.finish == "length"
    assert again.generation.n_prompt == full.generation.n_prompt
    assert again.summary["images_encoded"] == 1


def test_image_ids_are_negative_and_differ_by_hash() -> None:
    a, b = image_ids(b"\x01" * 32, 4), image_ids(b"\x02" * 32, 4)
    assert all(x < 0 for x in a + b) and a != b and a[0] != b[0]
    assert image_ids(b"\x01" * 32, 4) == a


def test_a_prompt_that_ends_inside_the_kv_image_is_prefilled_from_the_image_start(
        session: Session) -> None:
    session.clear_kv()
    first = turn(session, [png((5, 5, 5))])
    prompt = first.prepared.tokens
    images = [i for i, t in enumerate(prompt) if t < 0]
    # pretend the KV ends in the middle of the image: the next prefill backs up to its start
    session.truncate_kv(images[len(images) // 2])
    again = turn(session, [png((5, 5, 5))])
    assert again.generation.n_cached == images[0]
    assert again.summary["images_encoded"] == 1


def test_the_expert_streamer_sees_the_image_prefill(tmp_path: Path) -> None:
    from bmoe.engine.experts import streamer_factory

    model, _ = make_vision_pair(tmp_path)
    s = Session(model, {"ctx-size": 512, "threads": 1, "moe-stream": True},
                streamer_factory)
    try:
        assert s.streamer is not None and s.vision is not None
        before = s.streamer.summary()
        r = turn(s, [png((7, 7, 7))])
        assert r.generation.finish == "length"
        assert r.summary["image_tokens"] == 16
        # the image's decode ran through the streamer's graph callback: experts were read
        assert r.summary["prefill_read_mib"] > before.get("prefill_read_mib", 0.0)
    finally:
        s.close()
