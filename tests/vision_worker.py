"""A child process that reads images the way the server does, through the real libmtmd.

Run as ``python tests/vision_worker.py MODEL.gguf``: it loads the model with the
projector its folder pairs with it, then reads one JSON object per line on stdin,
``{"url": "<data URL>"}``, and for each does what a request does: the data URL checked
(`read_data_url`), then a one-token turn on the engine's code path (Pillow's decode,
libmtmd's tokenizer and encoder, the image prefill). It writes one JSON line back:
``{"ok": bool, "refused": "<the sentence a client would get>"}``. Bytes that crash
the decoder or libmtmd kill this process, not the test runner.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bmoe.engine.errors import EngineError  # noqa: E402
from bmoe.engine.images import ImageRefused, ImageSet  # noqa: E402
from bmoe.engine.session import Session  # noqa: E402
from bmoe.engine.turn import TurnRequest, prepare, run_turn  # noqa: E402


def one(session: Session, url: str) -> dict[str, object]:
    images = ImageSet()
    try:
        mark = images.add(url, "image_url.url", "messages[0]")
        req = TurnRequest(messages=[{"role": "user", "content": "see " + mark}], max_tokens=1,
                          images=images)
        run_turn(session, prepare(session, req), req, threading.Event(), lambda e, r: None)
    except ImageRefused as e:
        return {"ok": False, "refused": str(e)}
    except EngineError as e:
        return {"ok": False, "refused": e.message}
    return {"ok": True, "refused": ""}


def main() -> None:
    session = Session(sys.argv[1], {"ctx-size": 512, "threads": 1})
    assert session.vision is not None, "no projector paired"
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(one(session, json.loads(line)["url"])), flush=True)


if __name__ == "__main__":
    main()
