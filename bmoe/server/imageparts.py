"""Image parts of the three protocols: checked, and marked at their place in the text."""

from __future__ import annotations

import trio

from ..engine.images import ImageRefused, ImageSet, data_url_head
from ..http.errors import invalid_request
from ..runtime.state import Runtime


def image_part(images: ImageSet | None, url: object, where: str, message: str) -> str:
    """The text that stands for the image at `where`: its marker in a user message.

    `images` is None outside a user message: the image is checked and left out (only a
    user message carries images). A refusal is a 400 with the reason.
    """
    try:
        if images is None:
            data_url_head(url, where)
            return ""
        return images.add(url, where, message)
    except ImageRefused as e:
        raise invalid_request(str(e)) from None


def image_tokens(state: Runtime, images: ImageSet) -> int:
    """count_tokens' figure for the images: what the loaded projector takes for one
    (exact for a fixed-size projector, its cap for one that follows the image's size),
    less the marker text the estimate counted in their place."""
    session = state.session
    vision = getattr(session, "vision", None) if session is not None else None
    if not images.items or vision is None:
        return 0
    per = vision.fixed_tokens or vision.max_tokens
    marker = -(-len(images.marker(0).encode()) // 3)
    return max(0, per - marker) * len(images.items)


async def read_images(images: ImageSet | None) -> None:
    """Decode the request's images' base64 and read their headers, in a worker thread
    (a 64 MiB body would hold the event loop); a refusal is a 400 with the reason."""
    if not images:
        return
    try:
        await trio.to_thread.run_sync(images.resolve)
    except ImageRefused as e:
        raise invalid_request(str(e)) from None
