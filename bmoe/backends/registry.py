"""What ggml registered in this process, the installed packs loaded at start, and whether a
pack's driver library loads here.

ggml keeps one registry of compute backends per process: those built into llama.cpp's
libraries register themselves, and a library built with ``GGML_BACKEND_DL`` registers
when ``ggml_backend_load(path)`` loads it. Both are read here through llama-cpp-python's
own copy of libggml (``ggml_backend_reg_count`` / ``_get`` / ``_name``), with ctypes.

``load_installed`` runs once at the server's start, before any model is loaded: each
installed pack's libraries are first loaded in a child process (``python -m
bmoe.backends.probe load PATH``), so a library that ends the process it is loaded into
(a broken driver, a missing instruction) ends the child and the pack is reported as not
loaded; only one the child loaded is loaded into the server. A failure is a line on
stderr and an entry of ``GET /api/backends``'s ``load``, never fatal. ``applies`` asks a
child the same way whether a driver library (``libvulkan.so.1``) loads.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_S = 30.0
PACK_FILE = "pack.json"


@dataclass
class LoadResult:
    pack: str
    library: str
    loaded: bool
    backend: str = ""
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.pack, "library": self.library, "loaded": self.loaded,
                "backend": self.backend, "error": self.error}


def _lib_dir() -> Path:
    import llama_cpp   # the engine's library: its libggml holds the registry
    return Path(llama_cpp.__file__).resolve().parent / "lib"


@cache
def _ggml() -> tuple[Any, Any] | None:
    """(libggml, libggml-base) of llama-cpp-python, typed; None when they cannot be read."""
    try:
        ggml = ctypes.CDLL(str(_lib_dir() / "libggml.so"))
        base = ctypes.CDLL(str(_lib_dir() / "libggml-base.so"))
    except OSError:
        return None
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_count.argtypes = []
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    base.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    if hasattr(ggml, "ggml_backend_load"):
        ggml.ggml_backend_load.restype = ctypes.c_void_p
        ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    return ggml, base


def registered() -> list[str]:
    """The name of every backend ggml registered in this process, in its order."""
    libs = _ggml()
    if libs is None:
        return []
    ggml, base = libs
    names = []
    for i in range(ggml.ggml_backend_reg_count()):
        raw = base.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i))
        names.append(raw.decode("utf-8", "replace") if raw else "?")
    return names


def can_load_backends() -> bool:
    libs = _ggml()
    return libs is not None and hasattr(libs[0], "ggml_backend_load")


def load_here(path: str) -> str:
    """Load one backend library into this process: the name it registered under.
    OSError with a sentence when ggml refused it."""
    libs = _ggml()
    if libs is None or not hasattr(libs[0], "ggml_backend_load"):
        raise OSError("this build's ggml cannot load backend libraries")
    before = libs[0].ggml_backend_reg_count()
    reg = libs[0].ggml_backend_load(path.encode())
    if not reg or libs[0].ggml_backend_reg_count() == before:
        raise OSError("ggml did not load it (a library built from another llama.cpp, for "
                      "another processor, or missing a library it needs)")
    raw = libs[1].ggml_backend_reg_name(reg)
    return raw.decode("utf-8", "replace") if raw else "?"


def _child(*args: str) -> tuple[bool, str, str]:
    """Run the probe in a child: (it succeeded, the name it printed, why it did not)."""
    try:
        done = subprocess.run([sys.executable, "-m", "bmoe.backends.probe", *args],
                              capture_output=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env=dict(os.environ, BMOE_LLAMA_LOG="0"))
    except subprocess.TimeoutExpired:
        return False, "", f"loading it did not finish within {PROBE_TIMEOUT_S:.0f} s"
    except OSError:
        return False, "", "the check could not be started"
    out = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(out[-1]) if out else {}
    except ValueError:
        answer = {}
    if done.returncode < 0:
        return False, "", f"loading it ended the process that tried (signal {-done.returncode})"
    if done.returncode != 0 or not answer.get("ok"):
        why = str(answer.get("error") or "it did not load")
        said = [line.split(": ", 1)[1] for line in
                done.stderr.decode("utf-8", "replace").splitlines()
                if line.startswith(("load_backend: failed", "load_backend: backend"))]
        if said:   # ggml's own words: the loader's reason, the library's path in it
            why = f"ggml did not load it: {said[-1][:300]}"
        return False, "", why
    return True, str(answer.get("name", "")), ""


def registered_at_start(loaded_any: bool) -> list[str]:
    """What ggml registered at this start. Read in this process only once a pack was
    loaded into it (the registry is touched then anyway); otherwise asked of a child:
    touching ggml's registry in the server before a model loads defeats the RPC guard
    (bmoe/native/rpcguard.c), and a lost helper would end the process."""
    if loaded_any:
        return registered()
    ok, names, _ = _child("list")
    return [n for n in names.split(",") if n] if ok else []


def driver_loads(name: str) -> bool:
    """Whether the system library ``name`` (a driver: ``libvulkan.so.1``) loads here, asked
    in a child process."""
    return _child("dlopen", name)[0]


def applies(drivers: list[str]) -> bool:
    """Whether a pack driving ``drivers`` applies here: one of them loads (a pack that
    names none needs nothing beyond this system)."""
    return not drivers or any(driver_loads(d) for d in drivers)


def pack_libraries(folder: Path, named: list[str]) -> list[Path]:
    """The libraries of an installed pack to load: those its feed entry named, else every
    ggml backend library at its top."""
    if named:
        return [folder / n for n in named]
    found = [p for p in sorted(folder.iterdir()) if p.is_file() and (
        (p.name.startswith("libggml-") and (p.name.endswith(".so") or ".so." in p.name
                                             or p.name.endswith(".dylib")))
        or (p.name.startswith("ggml-") and p.name.endswith(".dll")))]
    return found


def read_pack(folder: Path) -> dict[str, Any] | None:
    """An installed pack's ``pack.json``, or None when it has none that reads."""
    try:
        data = json.loads((folder / PACK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("id"), str) else None


def installed_packs(backends_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every installed pack under ``backends_dir``: (its folder, its pack.json)."""
    try:
        folders = sorted(p for p in backends_dir.iterdir()
                         if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    out = []
    for folder in folders:
        meta = read_pack(folder)
        if meta is not None and meta["id"] == folder.name:
            out.append((folder, meta))
    return out


def load_installed(backends_dir: Path) -> list[LoadResult]:
    """Load every installed pack's libraries into this process (each first tried in a
    child), printing one line for each; the results, failures included."""
    results = []
    for folder, meta in installed_packs(backends_dir):
        named = [n for n in meta.get("libraries", []) if isinstance(n, str)]
        libraries = pack_libraries(folder, named)
        if not libraries:
            results.append(LoadResult(folder.name, "", False,
                                      error="the pack holds no backend library"))
        for lib in libraries:
            rel = os.path.relpath(lib, folder)
            if not can_load_backends():
                result = LoadResult(folder.name, rel, False,
                                    error="this build's ggml cannot load backend libraries")
            else:
                ok, _, why = _child("load", str(lib))
                if not ok:
                    result = LoadResult(folder.name, rel, False, error=why)
                else:
                    try:
                        result = LoadResult(folder.name, rel, True, backend=load_here(str(lib)))
                    except OSError as e:
                        result = LoadResult(folder.name, rel, False, error=str(e))
            results.append(result)
            if result.loaded:
                print(f"bmoe: backend pack {result.pack}: loaded {result.library} "
                      f"({result.backend})", file=sys.stderr, flush=True)
            else:
                print(f"bmoe: backend pack {result.pack}: {result.library or 'nothing'} was not "
                      f"loaded ({result.error}); the server runs without it",
                      file=sys.stderr, flush=True)
    return results
