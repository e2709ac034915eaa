"""A model's projector (libmtmd) on the engine thread: images into the KV cache.

Theory of operation
-------------------
`Vision` owns one `mtmd_context`, made beside the session's llama context from the
projector GGUF the model was paired with (`bmoe.models.pairing`) or the `mmproj`
parameter named. Everything here runs on the engine thread.

*The prompt.* The protocol decoders leave a marker with a per-request nonce where each
image was (`images.ImageSet`). `build_prompt` renders nothing itself: it splits the
rendered chat text at the markers, tokenizes the text between them as the session
always does, and turns each image into the tokens libmtmd gives it (`mtmd_tokenize_
from_parts` with the image alone: its own begin/end text, if the projector has any,
then the image chunk). An image chunk stands in the prompt as `n_pos` *image ids*:
negative numbers drawn from the sha256 of the image's bytes. So the session's KV
prefix match, which compares ids, runs through an image sent again (same bytes, same
ids) and stops at a different image at the same place; and the KV positions stay
those libmtmd gives (`n_pos`, which an M-RoPE projector makes smaller than the
image's token count).

*Prefill.* `prefill` walks the prompt from where the reuse ended: text runs through the
session's own `decode` (the abort callback and the expert streamer's graph callback
are the context's, so both work as for text), image runs through `mtmd_encode_chunk`
then `mtmd_helper_decode_image_chunk`, whose `llama_decode` calls run on the same
context. Cancelling reaches the encoder: the projector's graph runs with an eval
callback that asks to see every `CANCEL_STRIDE`-th node and stops the graph when the
turn's cancel flag is set; an encode that stopped is thrown away.

*Counting.* `encodes` counts the images encoded since load (a test reads it to see
that a resent image was not encoded again).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import llama_cpp as lc
from llama_cpp import mtmd_cpp as mtmd

from ..models.pairing import projector_for
from ..models.probe import probe_file
from . import backend
from .errors import Aborted, EngineError, LoadError
from .images import Bitmap, ImageInput, ImageRefused, ImageSet, decode_rgb

log = logging.getLogger("bmoe.vision")

CANCEL_STRIDE = 16   # projector graph nodes between two looks at the cancel flag
SHAPES_KEPT = 1024   # images whose prompt shape is remembered (a few hundred bytes each)
_ID_SPAN = 2**31 - 2
_NO_POST_DECODE = ctypes.cast(None, mtmd.mtmd_helper_post_decode_callback)  # type: ignore[arg-type]


class Session(Protocol):
    """What the projector reads and calls on the session it sits beside
    (`session.Session` is the one): typed here, as the session imports this module."""

    @property
    def path(self) -> Path: ...
    @property
    def values(self) -> dict[str, Any]: ...
    @property
    def model(self) -> Any: ...
    @property
    def ctx(self) -> Any: ...
    @property
    def memory(self) -> Any: ...
    @property
    def n_batch(self) -> int: ...
    @property
    def compute_threads(self) -> int: ...
    @property
    def streamer(self) -> Any: ...

    def tokenize(self, text: str, *, special: bool = True,
                 add_special: bool | None = None) -> list[int]: ...
    def decode(self, tokens: list[int], pos0: int, want_logits: bool) -> None: ...
    def check_streamer(self, pos0: int) -> None: ...


def _quiet_mtmd_logs() -> None:
    """libmtmd's logs go where llama.cpp's go: errors to stderr, the rest dropped."""
    callback = backend.log_callback()
    if callback is not None:
        mtmd.mtmd_log_set(callback, None)
        mtmd.mtmd_helper_log_set(callback, None)


def image_ids(digest: bytes, n: int) -> list[int]:
    """The `n` negative ids an image with this hash stands as in a prompt."""
    h = int.from_bytes(digest[:8], "little")
    return [-(1 + (h + j) % _ID_SPAN) for j in range(n)]


@dataclass(frozen=True)
class ImageShape:
    """What an image becomes in a prompt, remembered by its hash: the projector's own
    text before and after it, and its positions and tokens."""

    before: tuple[int, ...]
    n_pos: int
    n_tokens: int
    after: tuple[int, ...]


@dataclass
class PromptImage:
    """One image of a prepared prompt: where its ids sit, and (once made, until the
    prefill is over) the chunk libmtmd encodes."""

    start: int
    shape: ImageShape
    source: ImageInput
    label: str
    chunks: Any = None   # the mtmd_input_chunks that own `chunk`
    chunk: Any = None    # the image chunk

    @property
    def n_pos(self) -> int:
        return self.shape.n_pos

    @property
    def n_tokens(self) -> int:
        return self.shape.n_tokens


@dataclass
class VisionPrompt:
    tokens: list[int]
    images: list[PromptImage] = field(default_factory=list)
    n_cells: int = 0     # KV cells the prompt takes (image tokens, not positions)

    @property
    def image_tokens(self) -> int:
        return sum(im.n_tokens for im in self.images)


class Vision:
    def __init__(self, session: Session, projector: Path, image_max_tokens: int = 0) -> None:
        self.projector = projector
        self.encodes = 0
        self._cancel: threading.Event | None = None
        self._nodes = 0
        self._pending: list[PromptImage] = []
        self._shapes: dict[bytes, ImageShape] = {}
        self._eval_ref = lc.ggml_backend_sched_eval_callback(self._eval)
        _quiet_mtmd_logs()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = max(1, int(session.compute_threads))
        params.warmup = True
        params.image_max_tokens = max(0, int(image_max_tokens))
        params.cb_eval = self._eval_ref
        params.cb_eval_user_data = None
        self.ctx = mtmd.mtmd_init_from_file(str(projector).encode(), session.model, params)
        if not self.ctx:
            raise LoadError(f"The projector {projector.name} could not be loaded with this "
                            "model (libmtmd refused it: another model's projector, or a type "
                            "this build does not know).")
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise LoadError(f"The projector {projector.name} reads no images (an audio "
                            "projector?).")
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self.fixed_tokens, self.max_tokens = self._measure(session)

    def _measure(self, session: Session) -> tuple[int, int]:
        """Tokens of a small and of a large image: equal for a fixed-size projector."""
        counts = []
        for side in (64, 2048):
            grey = Bitmap(side, side, bytes([128]) * (side * side * 3))
            chunks = self._tokenize(grey, side.to_bytes(4, "little"))
            try:
                counts.append(sum(
                    int(mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, j)))
                    for j in range(mtmd.mtmd_input_chunks_size(chunks))
                    if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, j))
                    == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE))
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
        return (counts[0] if counts[0] == counts[1] else 0), max(counts)

    def close(self) -> None:
        self.release()
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def release(self) -> None:
        """Forget the prompt prepared last, and free its chunks."""
        self.free_chunks()
        self._pending = []

    def free_chunks(self) -> None:
        """Free the chunks (the preprocessed images) of the prompt prepared last."""
        for im in self._pending:
            if im.chunks is not None:
                mtmd.mtmd_input_chunks_free(im.chunks)
                im.chunks = im.chunk = None

    # -- the projector's graph callback ---------------------------------------

    def _eval(self, _tensor: Any, ask: bool, _user: Any) -> bool:
        if ask:
            self._nodes += 1
            return self._nodes % CANCEL_STRIDE == 0
        flag = self._cancel
        return not (flag is not None and flag.is_set())

    # -- prompts ---------------------------------------------------------------

    def build_prompt(self, session: Session, text: str, images: ImageSet) -> VisionPrompt:
        """The prompt's ids: text tokenized, each image as its ids (engine thread).

        An image seen before (its hash in `_shapes`) is not decoded again here: its ids
        are known, and it is decoded only if the prefill must encode it."""
        self.release()
        try:
            images.resolve()        # done already in the server, in a worker thread
        except ImageRefused as e:
            raise EngineError("invalid_request", str(e)) from None
        pattern = images.pattern()
        out = VisionPrompt([])
        pos = 0
        first = True
        try:
            for m in pattern.finditer(text):
                out.tokens += _tokens(session, text[pos:m.start()], first)
                first = False
                i = int(m.group(1))
                if i >= len(images.items):
                    raise EngineError("invalid_request", "An image marker names no image.")
                self._add_image(out, images.items[i], f"Image {i + 1}")
                pos = m.end()
            out.tokens += _tokens(session, text[pos:], first)
            if len(out.images) != len(images.items):
                raise EngineError("template_rejected", "The chat template did not keep every "
                                  "image's place in the conversation, so the images cannot "
                                  "be read.")
        except BaseException:
            self.release()
            raise
        out.n_cells = len(out.tokens) + sum(im.n_tokens - im.n_pos for im in out.images)
        return out

    def _add_image(self, out: VisionPrompt, img: ImageInput, label: str) -> None:
        shape = self._shapes.get(img.digest)
        pim = PromptImage(0, shape or ImageShape((), 0, 0, ()), img, label)
        self._pending.append(pim)
        if shape is None:
            self._make_chunk(pim)
            shape = pim.shape
        out.tokens += shape.before
        pim.start = len(out.tokens)
        out.images.append(pim)
        out.tokens += image_ids(img.digest, shape.n_pos)
        out.tokens += shape.after

    def _make_chunk(self, pim: PromptImage) -> None:
        """Decode the image and let libmtmd make its chunk; learn (or check) its shape."""
        try:
            bitmap = decode_rgb(pim.source, pim.label)
        except ImageRefused as e:
            raise EngineError("invalid_request", str(e)) from None
        pim.chunks = chunks = self._tokenize(bitmap, pim.source.digest)
        before: list[int] = []
        after: list[int] = []
        for j in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, j)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                toks = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                (after if pim.chunk is not None else before).extend(
                    int(toks[k]) for k in range(n.value))
            elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE and pim.chunk is None:
                pim.chunk = chunk
                shape = ImageShape((), int(mtmd.mtmd_input_chunk_get_n_pos(chunk)),
                                   int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)), ())
        if pim.chunk is None:
            raise EngineError("failed", f"{pim.label}: the projector made no image tokens of it.")
        shape = ImageShape(tuple(before), shape.n_pos, shape.n_tokens, tuple(after))
        if pim.shape.n_pos and pim.shape != shape:
            raise EngineError("failed", f"{pim.label}: the projector read the image differently "
                              "the second time.")
        pim.shape = shape
        if len(self._shapes) >= SHAPES_KEPT:
            self._shapes.pop(next(iter(self._shapes)))
        self._shapes[pim.source.digest] = shape

    def _tokenize(self, bitmap: Bitmap, digest: bytes) -> Any:
        buf = (ctypes.c_uint8 * len(bitmap.rgb)).from_buffer_copy(bitmap.rgb)
        bmp = mtmd.mtmd_bitmap_init(bitmap.width, bitmap.height, buf)
        if not bmp:
            raise EngineError("failed", "The image could not be handed to the projector.")
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            mtmd.mtmd_bitmap_set_id(bmp, hashlib.sha256(digest).hexdigest()[:32].encode())
            part = mtmd.mtmd_input_part()      # zeroed: no text, only the bitmap
            part.bitmap = bmp
            parts = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
            rc = mtmd.mtmd_tokenize_from_parts(self.ctx, chunks, parts, 1, False)
        finally:
            mtmd.mtmd_bitmap_free(bmp)
        if rc != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            raise EngineError("invalid_request", "The projector could not prepare this image "
                              "(its size is one the projector does not take).")
        return chunks

    # -- prefill ---------------------------------------------------------------

    def image_at(self, pos: int) -> PromptImage | None:
        """The prepared image whose ids cover prompt position `pos`."""
        for im in self._pending:
            if im.start <= pos < im.start + im.n_pos:
                return im
        return None

    def prefill(self, session: Session, prompt: list[int], start: int,
                cancel: threading.Event) -> None:
        """Decode `prompt[start:]` (text and images) at positions start.. ."""
        try:
            self._prefill(session, prompt, start, cancel)
        finally:
            self.free_chunks()

    def _prefill(self, session: Session, prompt: list[int], start: int,
                 cancel: threading.Event) -> None:
        pos = start
        n = len(prompt)
        while pos < n:
            im = self.image_at(pos) if prompt[pos] < 0 else None
            if im is None:
                end = pos
                while end < n and prompt[end] >= 0:
                    end += 1
                if end == pos:
                    raise EngineError("failed", "The prompt holds an image that was not "
                                      "prepared with it.")
                session.decode(prompt[pos:end], pos, want_logits=end == n)
                pos = end
                continue
            self._encode_and_decode(session, im, pos, cancel)
            pos = im.start + im.n_pos
        if prompt and prompt[-1] < 0:
            raise EngineError("failed", "A prompt must end in text after its last image.")

    def _encode_and_decode(self, session: Session, im: PromptImage, pos: int,
                           cancel: threading.Event) -> None:
        if im.chunk is None:          # an image seen before, not decoded at prepare
            self._make_chunk(im)
        self._cancel = cancel
        self._nodes = 0
        try:
            rc = mtmd.mtmd_encode_chunk(self.ctx, im.chunk)
        finally:
            self._cancel = None
        if cancel.is_set():
            raise Aborted(pos)
        if rc != 0:
            raise EngineError("failed", "The projector could not encode an image.")
        self.encodes += 1
        embd = mtmd.mtmd_get_output_embd(self.ctx)
        new_pos = lc.llama_pos(0)
        rc = mtmd.mtmd_helper_decode_image_chunk(self.ctx, session.ctx, im.chunk, embd, pos, 0,
                                                 session.n_batch, ctypes.byref(new_pos),
                                                 _NO_POST_DECODE, None)
        if session.streamer is not None:
            session.check_streamer(pos)
        if rc == 2 or cancel.is_set():
            raise Aborted(pos)
        if rc != 0:
            lc.llama_memory_seq_rm(session.memory, 0, pos, -1)
            raise EngineError("failed", f"llama_decode failed on an image with code {rc}.")


def _tokens(session: Session, text: str, first: bool) -> list[int]:
    if not text:
        return []
    return session.tokenize(text) if first else session.tokenize(text, add_special=False)


def reuse_start(vision: Vision | None, prompt: list[int], reused: int) -> int:
    """Where the prefill must start: `reused`, or the start of an image it falls inside
    (an image is decoded whole or not at all)."""
    if vision is None or reused <= 0 or reused >= len(prompt) or prompt[reused] >= 0:
        return reused
    im = vision.image_at(reused)
    return im.start if im is not None and im.start < reused else reused


def open_vision(session: Session) -> Vision | None:
    """The session's projector: the `mmproj` parameter's file, else (unless `mmproj-auto`
    is off) the one its folder pairs with the model by their headers; None when there is
    none.

    A projector named with `mmproj` that cannot be used fails the load, with the
    reason; one the folder paired is left out with a warning, and the model loads
    without images. Either way its header is read in Python first, so libmtmd is only
    given a file that is a projector by its header."""
    named = str(session.values.get("mmproj") or "").strip()
    pair = session.values.get("mmproj-auto", True) is not False
    path = Path(named).expanduser() if named else projector_for(session.path) if pair else None
    if path is None:
        return None
    try:
        if named and not path.is_file():
            raise LoadError(f"The projector {named} ({{mmproj}}) does not exist.")
        probe = probe_file(path)
        if probe.role != "projector":
            why = probe.reason or f"its header says it is a {probe.role or 'file'} of another kind"
            raise LoadError(f"{path.name} is not an image projector: {why}.")
        vision = Vision(session, path, int(session.values.get("image-max-tokens") or 0))
    except LoadError as e:
        if named:
            raise
        log.warning("images are off: %s", e.message)
        return None
    log.info("images: %s paired with %s", path.name, session.path.name)
    return vision
