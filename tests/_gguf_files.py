"""Small GGUF files for the models tests: split sets, projectors, drafts, hostile headers.

The model maker writes real models; these helpers cut one into shards (as gguf-split
does: ``split.no``, ``split.count``, ``split.tensors.count`` in every shard, the keys in
the first) and write header-only files of other kinds.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

from bmoe.modelmaker import make_model

__all__ = ["make_model", "split_model", "write_kind", "hostile_headers"]


def split_model(src: Path, folder: Path, stem: str, count: int) -> list[Path]:
    """Cut the GGUF ``src`` into ``count`` shards ``stem-0000i-of-0000N.gguf``."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    tensors = list(reader.tensors)
    per = -(-len(tensors) // count)
    paths = []
    for i in range(count):
        path = folder / f"{stem}-{i + 1:05d}-of-{count:05d}.gguf"
        w = gguf.GGUFWriter(path=None, arch=arch)
        if i == 0:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                _copy_field(w, key, field)
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", len(tensors))
        mine = tensors[i * per:(i + 1) * per]
        for t in mine:
            shape = [int(x) for x in reversed(t.shape.tolist())]   # numpy order
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(t.n_bytes),
                              raw_dtype=t.tensor_type)
        w.write_header_to_file(path=path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        out = w.fout[0]
        for t in mine:
            w.write_padding(out, out.tell())
            out.write(bytes(t.data.tobytes()))
            w.write_padding(out, int(t.n_bytes))
        w.close()
        paths.append(path)
    return paths


def _copy_field(w: gguf.GGUFWriter, key: str, field: gguf.ReaderField) -> None:
    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_key_value(key, value, vtype, sub_type=field.types[-1])
    else:
        w.add_key_value(key, value, vtype)


def write_kind(path: Path, *, arch: str = "llama", kv: dict[str, object] | None = None,
               block_count: int | None = 2, tensors: dict[str, tuple[int, ...]] | None = None,
               ) -> Path:
    """A small GGUF whose header says what the test wants (F32 tensors of zeros)."""
    w = gguf.GGUFWriter(path=None, arch=arch)
    if block_count is not None:
        w.add_uint32(f"{arch}.block_count", block_count)
    for k, v in (kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
    for name, shape in (tensors or {"token_embd.weight": (8, 4)}).items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def hostile_headers() -> dict[str, bytes]:
    """Headers a careless parser dies on: each must come back as "not readable"."""
    head = b"GGUF" + struct.pack("<I", 3)
    return {
        "empty": b"",
        "wrong magic": b"GGML" + b"\0" * 60,
        "version 1": b"GGUF" + struct.pack("<I", 1) + b"\0" * 16,
        "big endian": b"GGUF" + struct.pack(">I", 3) + b"\0" * 16,
        "cut in the counts": head + b"\1\0\0",
        "huge tensor count": head + struct.pack("<QQ", 1 << 62, 0),
        "huge key count": head + struct.pack("<QQ", 0, 1 << 40),
        "huge key length": head + struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1 << 60),
        "huge array": head + struct.pack("<QQ", 0, 1) + _string(b"a.b")
        + struct.pack("<IIQ", 9, 4, 1 << 61),
        "unknown value type": head + struct.pack("<QQ", 0, 1) + _string(b"a.b")
        + struct.pack("<I", 77),
        "nested arrays": head + struct.pack("<QQ", 0, 1) + _string(b"a.b")
        + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1),
        "nine dimensions": head + struct.pack("<QQ", 1, 0) + _string(b"t")
        + struct.pack("<I", 9) + struct.pack("<9Q", *([1] * 9)) + struct.pack("<IQ", 0, 0),
        "unknown tensor type": head + struct.pack("<QQ", 1, 0) + _string(b"t")
        + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 999, 0),
        "impossibly large tensor": head + struct.pack("<QQ", 1, 0) + _string(b"t")
        + struct.pack("<I", 4) + struct.pack("<4Q", *([1 << 40] * 4)) + struct.pack("<IQ", 0, 0),
        "bad alignment": head + struct.pack("<QQ", 0, 1) + _string(b"general.alignment")
        + struct.pack("<II", 4, 3),
    }
