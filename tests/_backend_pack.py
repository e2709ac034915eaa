"""What the backend-pack tests serve: a signed feed, pack archives (safe and hostile), and a
real ggml backend library built from the engine's own llama.cpp source.

``sign`` makes the envelope the server checks (``{"feed": text, "signature": base64}``)
with a key the test generated. ``tar_pack`` writes a .tar.gz with Python's tarfile, whose
``TarInfo`` can say anything an attacker's archive could: absolute names, ``..``, hard
links, devices, fifos, entries under a link.

``cpu_backend_library`` builds ggml's CPU backend as a loadable module (``GGML_BACKEND_DL``)
for another instruction-set level than the bundled one (AVX without AVX2/FMA), from the
pinned llama-cpp-python sdist (the source the engine's libraries were built from, so its
ggml ABI is theirs), cmake target ``ggml-cpu`` only. It is cached under
``~/.cache/bmoe-test/`` keyed by the sdist's SHA-256; the first build takes about two
minutes on two cores.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from _llama_templates import sdist_tarball
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

BUILD_TIMEOUT_S = 900


def new_key(folder: Path) -> tuple[Ed25519PrivateKey, Path]:
    """A fresh signing key and the file holding its public half (base64 of 32 bytes)."""
    key = Ed25519PrivateKey.generate()
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    path = folder / "feed-key.pub"
    path.write_text(base64.b64encode(raw).decode() + "\n")
    return key, path


def sign(key: Ed25519PrivateKey, feed: dict[str, Any]) -> bytes:
    text = json.dumps(feed, indent=1)
    sig = key.sign(text.encode())
    return json.dumps({"feed": text, "signature": base64.b64encode(sig).decode()}).encode()


def tamper(document: bytes, **changes: Any) -> bytes:
    """The signed document with its feed changed after signing (the signature kept)."""
    env = json.loads(document)
    feed = json.loads(env["feed"])
    feed.update(changes)
    env["feed"] = json.dumps(feed, indent=1)
    return json.dumps(env).encode()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "",
           mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = 0o755 if kind == tarfile.DIRTYPE else mode
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def tar_pack(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return buf.getvalue()


def pack_entry(pack_id: str, url: str, data: bytes, target: str, **kw: Any) -> dict[str, Any]:
    return {"id": pack_id, "title": kw.pop("title", pack_id), "target": target,
            "version": kw.pop("version", "1.0.0"), "url": url,
            "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), **kw}


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bmoe-test"


def cpu_backend_library() -> Path:
    """The cached AVX-level ``libggml-cpu.so`` (a GGML_BACKEND_DL module), built if needed."""
    from filelock import FileLock

    tarball = sdist_tarball()
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()[:16]
    out = _cache_root() / f"ggml-cpu-avx-{digest}"
    lib = out / "libggml-cpu.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if lib.is_file():
            return lib
        work = out.with_name(out.name + ".build")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_SKIP_RPATH=ON",
             "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_NATIVE=OFF",
             "-DGGML_AVX=ON", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF", "-DGGML_F16C=ON",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_CURL=OFF"],
            check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        subprocess.run(["cmake", "--build", str(build), "--target", "ggml-cpu", "-j2"],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        built = build / "bin" / "libggml-cpu.so"
        out.mkdir(exist_ok=True)
        tmp = out / "libggml-cpu.so.tmp"
        shutil.copyfile(built, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
        shutil.rmtree(work, ignore_errors=True)
    return lib
