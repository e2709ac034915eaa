"""The GGUF probe: what a model file is, from its header alone.

Theory of operation
-------------------
A GGUF file opens with a header: magic ``GGUF``, a version, the tensor and key/value
counts, the key/value pairs, then one info record per tensor (name, shape, type,
offset). The probe parses that header from the first bytes of a file (a local file,
or a range request's answer for a remote one) and never reads a tensor.

``parse_header(buf)`` is pure: bytes in, a ``Header`` out. It is written for hostile
input: every count and length is checked against what is left of the buffer and
against the caps below before anything is allocated, so a truncated file raises
``Truncated(needed)`` (the caller may fetch more, up to ``HEADER_CAP``) and anything
else that is wrong raises ``Unreadable(reason)``. ``probe_source`` drives the fetching
and turns every failure into ``ModelProbe.unreadable(reason)``: no exception escapes.

``ModelProbe.of(headers)`` reads the figures the listing, ``/api/hf/inspect`` and the
planner use: the role from the header (never the file name), the MoE shape, the bytes
of the dense and the expert tensors, one token cycle, the largest dense tensor, and
whether this build streams the experts. A split set's headers are given together:
the first shard's keys, every shard's tensors.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gguf

MIB = 1 << 20
HEADER_CAP = 64 * MIB          # the most of a file read for its header
FIRST_READ = 2 * MIB           # the first read; doubled while the header goes on
MAX_TENSORS = 1 << 16          # more tensors than any published model has
MAX_KV = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4                   # GGML_MAX_DIMS
KEEP_STRING_BYTES = 4096       # longer string values are skipped, not kept
KEEP_ARRAY_ITEMS = 64          # longer arrays are skipped, not kept
DEFAULT_ALIGNMENT = 32

_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_ANY_EXPERT = re.compile(r"^blk\.(\d+)\..*_exps\b")
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)

_U64 = struct.Struct("<Q")

# value type -> (struct format, size) for the fixed-size scalars
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class Truncated(Exception):
    """The buffer ends inside the header; ``needed`` bytes would be a start."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class Unreadable(Exception):
    """The bytes are not a GGUF header this probe reads; ``reason`` is a sentence."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    kv: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    header_bytes: int          # where the tensor data starts (aligned)


class _Cursor:
    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def need(self, n: int) -> None:
        if n < 0:
            raise Unreadable("the header holds a negative length")
        if self.pos + n > len(self.buf):
            raise Truncated(self.pos + n)

    def scalar(self, vtype: int) -> Any:
        fmt, size = _SCALARS[vtype]
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return int(self.scalar(4))

    def u64(self) -> int:
        return int(self.scalar(10))

    def string(self, limit: int | None = None, keep: bool = True) -> str | None:
        n = self.u64()
        if limit is not None and n > limit:
            raise Unreadable(f"a name in the header is {n} bytes long")
        if n > HEADER_CAP:
            raise Unreadable("a string in the header is longer than any header we read")
        self.need(n)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        if not keep or n > KEEP_STRING_BYTES:
            return None
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings without building them (one tight loop)."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise Truncated(pos + 8)
            (n,) = unpack(buf, pos)
            if n > HEADER_CAP:
                raise Unreadable("a string in the header is longer than any header we read")
            pos += 8 + n
        if pos > end:
            raise Truncated(pos)
        self.pos = pos

    def raw_strings(self) -> list[bytes]:
        """An array of strings, every item kept as its bytes (a vocabulary, read whole)."""
        etype, count = self.u32(), self.u64()
        if etype != _STRING:
            raise Unreadable(f"an array the probe reads whole holds values of type {etype}")
        if count > HEADER_CAP // 8:
            raise Unreadable(f"an array in the header claims {count} items")
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        items = []
        for _ in range(count):
            if pos + 8 > end:
                raise Truncated(pos + 8)
            (n,) = unpack(buf, pos)
            if n > HEADER_CAP:
                raise Unreadable("a string in the header is longer than any header we read")
            if pos + 8 + n > end:
                raise Truncated(pos + 8 + n)
            items.append(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        self.pos = pos
        return items

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth > 1:
                raise Unreadable("the header nests arrays too deeply")
            return self.array(depth)
        raise Unreadable(f"the header holds a value of unknown type {vtype}")

    def array(self, depth: int) -> Any:
        etype = self.u32()
        count = self.u64()
        if etype in _SCALARS:
            size = _SCALARS[etype][1]
            if count > HEADER_CAP // size:
                raise Unreadable(f"an array in the header claims {count} items")
            if count > KEEP_ARRAY_ITEMS:
                self.need(count * size)
                self.pos += count * size
                return None
            return [self.scalar(etype) for _ in range(count)]
        if etype not in (_STRING, _ARRAY):
            raise Unreadable(f"an array in the header holds values of unknown type {etype}")
        if count > HEADER_CAP // 8:
            raise Unreadable(f"an array in the header claims {count} items")
        keep = count <= KEEP_ARRAY_ITEMS
        if etype == _STRING and not keep:
            self.skip_strings(count)      # a vocabulary: 150k-262k strings, none kept
            return None
        items = []
        for _ in range(count):
            item = self.string(keep=keep) if etype == _STRING else self.value(etype, depth + 1)
            if keep:
                items.append(item)
        return items if keep else None


def tensor_bytes(dims: Sequence[int], qtype: int) -> int:
    """Bytes of a tensor of shape ``dims`` and ggml type ``qtype`` (Unreadable if none)."""
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise Unreadable(f"a tensor has the unknown type {qtype}") from None
    count = 1
    for d in dims:
        count *= d
        if count > 1 << 56:
            raise Unreadable("a tensor in the header is impossibly large")
    if dims and dims[0] % block:
        raise Unreadable(f"a tensor's rows ({dims[0]}) do not fill its type's blocks ({block})")
    return count // block * size


def parse_header(buf: bytes | bytearray | memoryview,
                 whole: frozenset[str] = frozenset()) -> Header:
    """The header at the start of ``buf``; ``Truncated`` or ``Unreadable`` otherwise.
    The string arrays named in ``whole`` are kept whatever their length, as bytes."""
    c = _Cursor(buf)
    c.need(4)
    if bytes(c.buf[:4]) != b"GGUF":
        raise Unreadable("the file does not start as a GGUF file does")
    c.pos = 4
    version = c.u32()
    if version not in (2, 3):
        if version in (1 << 24, 2 << 24, 3 << 24):
            raise Unreadable("the file is a big-endian GGUF, which this build does not read")
        raise Unreadable(f"the file is GGUF version {version}, not 2 or 3")
    n_tensors, n_kv = c.u64(), c.u64()
    if n_tensors > MAX_TENSORS:
        raise Unreadable(f"the header claims {n_tensors} tensors")
    if n_kv > MAX_KV:
        raise Unreadable(f"the header claims {n_kv} keys")
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string(limit=MAX_KEY_BYTES)
        vtype = c.u32()
        if key in whole and vtype == _ARRAY:
            kv[key] = c.raw_strings()
        else:
            kv[key or ""] = c.value(vtype)
    tensors = [_tensor_info(c) for _ in range(n_tensors)]
    align = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise Unreadable("the header's alignment is not a power of two")
    start = -(-c.pos // align) * align
    return Header(version, kv, tuple(tensors), start)


def _tensor_info(c: _Cursor) -> TensorInfo:
    name = c.string(limit=MAX_KEY_BYTES) or ""
    n_dims = c.u32()
    if not 1 <= n_dims <= MAX_DIMS:
        raise Unreadable(f"the tensor {name[:80]!r} has {n_dims} dimensions")
    dims = tuple(c.u64() for _ in range(n_dims))
    qtype = c.u32()
    offset = c.u64()
    return TensorInfo(name, dims, qtype, offset, tensor_bytes(dims, qtype))


# --- fetching --------------------------------------------------------------------------

Fetch = Callable[[int, int], bytes]   # (offset, length) -> up to length bytes from offset


def read_header(fetch: Fetch, cap: int = HEADER_CAP,
                whole: frozenset[str] = frozenset()) -> Header:
    """Fetch more of the file while the header goes on (Unreadable past ``cap``)."""
    buf = bytearray()
    want = FIRST_READ
    while True:
        ask = want - len(buf)
        more = fetch(len(buf), ask)
        buf += more
        try:
            return parse_header(buf, whole)
        except Truncated as t:
            if len(more) < ask:   # the file itself ended
                raise Unreadable("the file ends inside its header") from None
            if t.needed > cap or len(buf) >= cap:
                raise Unreadable(f"the header is larger than {cap // MIB} MiB") from None
            want = min(cap, max(want * 2, t.needed + MIB))


def file_fetch(path: str | os.PathLike[str]) -> Fetch:
    def fetch(offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return fetch


def read_file_header(path: str | os.PathLike[str],
                     whole: frozenset[str] = frozenset()) -> Header:
    try:
        return read_header(file_fetch(path), whole=whole)
    except OSError as e:
        raise Unreadable(f"the file could not be read ({e.strerror or 'input/output error'})") \
            from None


# --- what a model is --------------------------------------------------------------------

@dataclass
class ModelProbe:
    readable: bool = False
    arch: str = ""
    role: str = ""
    type: str = ""
    block_count: int = 0
    is_moe: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    n_layer: int = 0
    n_moe_layer: int = 0
    n_embd: int = 0
    dense_bytes: int = 0
    expert_bytes: int = 0
    token_cycle_bytes: int = 0
    largest_dense_tensor: int = 0
    has_mtp: bool = False
    streamable: bool = False
    refusal: str = ""
    # not on the wire: what the listing and the planner also want
    reason: str = field(default="", repr=False)       # why it is not readable
    name: str = field(default="", repr=False)         # general.name
    base_names: tuple[str, ...] = field(default=(), repr=False)  # basename, base models'
    split_count: int = field(default=0, repr=False)
    header_bytes: int = field(default=0, repr=False)

    WIRE = ("readable", "arch", "role", "type", "block_count", "is_moe", "n_expert",
            "n_expert_used", "n_layer", "n_moe_layer", "n_embd", "dense_bytes",
            "expert_bytes", "token_cycle_bytes", "largest_dense_tensor", "has_mtp",
            "streamable", "refusal")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in self.WIRE}

    @classmethod
    def unreadable(cls, reason: str) -> ModelProbe:
        return cls(readable=False, reason=reason)

    @classmethod
    def of(cls, headers: Sequence[Header]) -> ModelProbe:
        """The probe of one file, or of a split set's shards in order."""
        kv = headers[0].kv
        arch = _str(kv.get("general.architecture"))
        tensors = [t for h in headers for t in h.tensors]
        p = cls(readable=True, arch=arch, type=_str(kv.get("general.type")),
                name=_str(kv.get("general.name")), header_bytes=headers[0].header_bytes)
        p.block_count = _int(kv.get(f"{arch}.block_count"))
        p.n_embd = _int(kv.get(f"{arch}.embedding_length"))
        p.n_expert = _int(kv.get(f"{arch}.expert_count"))
        p.n_expert_used = _int(kv.get(f"{arch}.expert_used_count"))
        nextn = _int(kv.get(f"{arch}.nextn_predict_layers"))
        p.has_mtp = nextn > 0
        p.n_layer = max(0, p.block_count - nextn) if p.block_count else 0
        p.split_count = max(1, _int(kv.get("split.count")))
        p.role = _role(kv, arch, p.block_count, nextn)
        p.base_names = _base_names(kv)
        _sizes(p, tensors)
        p.streamable, p.refusal = _streaming(p, tensors, len(headers))
        return p


def stream_floor(p: ModelProbe) -> int:
    """What a streamed MoE keeps resident at the least: its dense weights and one token
    cycle of cache (the inspect verdict's figure and the plan's; a load adds the context
    and runtime)."""
    return int(p.dense_bytes + p.token_cycle_bytes)


def _base_names(kv: dict[str, Any]) -> tuple[str, ...]:
    """`general.basename` and the base models' names: what a projector may be paired by."""
    names = [_str(kv.get("general.basename"))]
    names += [_str(kv.get(f"general.base_model.{i}.name"))
              for i in range(min(_int(kv.get("general.base_model.count")), 8))]
    return tuple(n for n in names if n)


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _role(kv: dict[str, Any], arch: str, block_count: int, nextn: int) -> str:
    gtype = _str(kv.get("general.type"))
    if gtype == "mmproj" or arch == "clip":
        return "projector"
    if any(k.endswith(".target_layers") for k in kv) or (block_count and nextn >= block_count):
        return "draft"
    if gtype not in ("", "model") or f"{arch}.block_count" not in kv:
        return "other"
    return "model"


def _sizes(p: ModelProbe, tensors: Sequence[TensorInfo]) -> None:
    per_layer: dict[int, int] = {}
    for t in tensors:
        m = _ANY_EXPERT.match(t.name)
        if m and len(t.dims) == 3:
            p.expert_bytes += t.nbytes
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.nbytes
        else:
            p.dense_bytes += t.nbytes
            p.largest_dense_tensor = max(p.largest_dense_tensor, t.nbytes)
    p.n_moe_layer = len(per_layer)
    p.is_moe = p.n_expert > 1 and p.n_moe_layer > 0
    if p.is_moe and p.n_expert_used:
        p.token_cycle_bytes = sum(b // p.n_expert for b in per_layer.values()) * p.n_expert_used


def _streaming(p: ModelProbe, tensors: Sequence[TensorInfo], shards: int) -> tuple[bool, str]:
    if not p.is_moe:
        return False, ""
    if not 1 <= p.n_expert_used <= p.n_expert:
        return False, (f"its header names {p.n_expert_used} experts per token of "
                       f"{p.n_expert}, which this engine cannot route")
    if p.split_count > 1 or shards > 1:
        return False, ("this build streams experts from a model in one file; this one is "
                       f"split into {max(p.split_count, shards)} files, so it runs on plain mmap")
    for t in tensors:
        if _ANY_EXPERT.match(t.name) and len(t.dims) == 3:
            if not _EXPERT_NAME.match(t.name):
                return False, (f"its expert tensor {t.name} is not one this engine "
                               "streams (gate, up, down or gate_up weights)")
            if t.dims[2] != p.n_expert:
                return False, f"its expert tensor {t.name} does not hold {p.n_expert} experts"
    return True, ""


def probe_source(fetch: Fetch) -> ModelProbe:
    """The probe of one file through ``fetch``; every failure is ``unreadable``."""
    try:
        return ModelProbe.of([read_header(fetch)])
    except Unreadable as e:
        return ModelProbe.unreadable(e.reason)
    except OSError as e:
        return ModelProbe.unreadable(f"the file could not be read ({e.strerror or e})")
    except Exception:  # noqa: BLE001 - a hostile header must never take the caller down
        return ModelProbe.unreadable("the header could not be read")


def probe_file(path: str | os.PathLike[str]) -> ModelProbe:
    return probe_source(file_fetch(path))


def probe_files(paths: Sequence[str | os.PathLike[str]]) -> ModelProbe:
    """One model from its files (a split set's shards in order)."""
    try:
        return ModelProbe.of([read_file_header(p) for p in paths])
    except Unreadable as e:
        return ModelProbe.unreadable(e.reason)
    except Exception:  # noqa: BLE001 - as in probe_source
        return ModelProbe.unreadable("the header could not be read")


def split_parts(name: str) -> tuple[str, int, int] | None:
    """``("X", 2, 3)`` for ``X-00002-of-00003.gguf``; None for a name of one file."""
    m = SPLIT_NAME.match(name)
    if m is None:
        return None
    no, count = int(m.group("no")), int(m.group("count"))
    if not 1 <= no <= count:
        return None
    return m.group("stem"), no, count


def shard_name(stem: str, no: int, count: int) -> str:
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def model_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes llama.cpp loads for `path`: every shard present of a split model
    (``X-00001-of-00003.gguf`` ...), or the one file."""
    folder, name = os.path.split(os.fspath(path))
    parts = split_parts(name)
    if parts is None:
        return os.stat(path).st_size
    stem, _, count = parts
    shards = (os.path.join(folder, shard_name(stem, i, count)) for i in range(1, count + 1))
    return sum(os.stat(f).st_size for f in shards if os.path.isfile(f))


def is_gguf_name(name: str) -> bool:
    return name.lower().endswith(".gguf")


__all__ = ["HEADER_CAP", "Header", "ModelProbe", "TensorInfo", "Truncated", "Unreadable",
           "parse_header", "probe_file", "probe_files", "probe_source", "read_header",
           "split_parts", "shard_name"]
