"""What an image costs on the way in: the data URL checks, Pillow's decode, and a turn
with a screenshot-sized image on the model maker's vision pair, first sent and resent.

    python bench/image_path.py [--huge]     # --huge adds a 64 MP PNG (slow, ~1.4 GB)
"""

from __future__ import annotations

import base64
import io
import resource
import sys
import tempfile
import threading
import time

import numpy as np
from PIL import Image

from bmoe.engine.images import ImageSet, decode_rgb, read_data_url
from bmoe.engine.session import Session
from bmoe.engine.turn import TurnRequest, prepare, run_turn
from bmoe.modelmaker.projector import make_vision_pair


def encoded(fmt: str, w: int, h: int) -> bytes:
    px = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(px).save(b, fmt)
    return b.getvalue()


def checks_and_decode(sizes: list[tuple[str, int, int]]) -> None:
    for fmt, w, h in sizes:
        data = encoded(fmt, w, h)
        url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
        t0 = time.perf_counter()
        img = read_data_url(url, "x")
        t1 = time.perf_counter()
        bmp = decode_rgb(img, "Image 1")
        t2 = time.perf_counter()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{fmt} {w}x{h} ({len(data) / 1e6:.1f} MB): checks {t1 - t0:.3f} s, "
              f"decode {t2 - t1:.3f} s -> {bmp.width}x{bmp.height}; peak RSS {peak:.0f} MiB")


def turns() -> None:
    with tempfile.TemporaryDirectory() as d:
        model, _ = make_vision_pair(d)
        s = Session(model, {"ctx-size": 1024, "threads": 1})
        url = "data:image/png;base64," + base64.b64encode(encoded("PNG", 1920, 1080)).decode()
        try:
            for i in range(3):
                images = ImageSet()
                mark = images.add(url, "x", "messages[0]")
                req = TurnRequest(messages=[{"role": "user", "content": f"see {mark} now"}],
                                  max_tokens=1, images=images)
                t0 = time.perf_counter()
                p = prepare(s, req)
                t1 = time.perf_counter()
                r = run_turn(s, p, req, threading.Event(), lambda e, rec: None)
                g = r.generation
                print(f"turn {i + 1}: prepare {t1 - t0:.3f} s, prefill {g.prefill_s:.3f} s, "
                      f"reused {g.n_cached} of {g.n_prompt} tokens, "
                      f"encoded {r.summary['images_encoded']}")
        finally:
            s.close()


if __name__ == "__main__":
    sizes = [("PNG", 1920, 1080), ("JPEG", 4000, 3000)]
    if "--huge" in sys.argv:
        sizes.append(("PNG", 7900, 7900))
    checks_and_decode(sizes)
    turns()
