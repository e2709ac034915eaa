"""Which CPU kernels a resident model may run here: llama.cpp's extra buffer types or not.

Theory of operation
-------------------
At load llama.cpp may give a weight to one of the CPU backend's *extra buffer types*
(``llama_model_params.use_extra_bufts``): ``CPU_REPACK`` (Q4_0, Q4_K, IQ4_NL and MXFP4
rows interleaved for wider SIMD kernels) and, where the build was compiled for the CPU,
``AMX``. Their kernels are not the file layout's, and on some hosts they fault: the
pinned build's AMX matmul dies with SIGSEGV on every batch of two or more tokens (its
tile configuration is half written), and deepseek2 models abort at context creation with
them. A crash in C takes every session with it, so the engine decides once, per host and
build, before a resident load trusts them:

* no extra buffer type registered: nothing to decide (off);
* ``AMX`` registered: off, without a probe and whatever the setting: the fault is this
  build's, so any host that registers AMX is exposed (a probe that happened to pass on
  stack garbage would prove nothing, and a setting sent over the API must not be able
  to crash the server);
* the ``repack`` setting: ``off`` never uses them, ``on`` uses them unchecked (the
  person's choice, no probe), ``auto`` (the default) runs the probe:
  ``bmoe.kernelprobe`` in a child process: a tiny model in every type the
  buffer types take, a batch and a token each way; a crash or logits that disagree is
  "off", a clean run "on". The verdict is kept in the user's cache folder, keyed by the
  CPU's flags and the llama.cpp libraries' identity, so each host probes once per build.

The expert streamer always loads without them (it reads the file's own layout into its
cache), so its tokens match a resident engine whose choice is off: that is the baseline
the streaming tests compare with. The one exception is the streamer's own: where this
choice turns the kernels on, it repacks MXFP4 experts as it reads them and runs them with
``CPU_REPACK`` (``bmoe.engine.experts.repack``), matching a resident engine whose choice
is on.

Repacking copies every weight it takes out of the file mapping into the process's own
memory, so a model on the file mapping (llama.cpp on mmap, larger than memory) would be
held whole, and under a memory cap the kernel kills the process at load: measured on a
4.2 GiB Q4_K_M slice of Qwen3-30B-A3B, 7.7 GiB resident with repacking, and OOM-killed
under a 1.7 GiB cap. `within_memory` keeps them off, whatever the setting, for a model
that with them would not fit the memory this process may hold.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc

from ..atomicfile import write_text

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
# What a resident load needs beside its repacked weights: llama.cpp's model and context
# structures, a prompt batch's compute buffer, the KV cache of a modest context, the
# runtime
REPACK_MARGIN = 512 << 20
PROBE_TIMEOUT_S = 300           # a tiny model, quantized seven ways: seconds on one core
CACHE_NAME = "kernels.json"
# What the probe checks, as part of each verdict's key: 2 added the four-row MoE prompt
# matmuls (bmoe.engine.moegemm), so verdicts from before are probed again
PROBE_VERSION = 2


@dataclass(frozen=True)
class KernelChoice:
    extra_bufts: bool           # what the resident load sets use_extra_bufts to
    registered: tuple[str, ...]  # the extra buffer types this build registered here
    mode: str                   # the repack setting it was decided under
    decided_by: str             # "setting" | "none registered" | "known fault" | "probe"
    reason: str                 # for people: why on or off

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["registered"] = list(self.registered)
        return out

    def line(self) -> str:
        """The load line's words for it."""
        state = "on" if self.extra_bufts else "off"
        return f"repack {state} ({self.reason})"


# --- what the build registered ------------------------------------------------------------

def _lib_dir() -> Path:
    return Path(lc.__file__).resolve().parent / "lib"


def _ggml() -> ctypes.CDLL | None:
    for name in ("libggml.so", "libggml-base.so"):
        path = _lib_dir() / name
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                continue
            if hasattr(lib, "ggml_backend_dev_by_type"):
                return lib
    return None


_EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def extra_bufts() -> tuple[tuple[str, int], ...]:
    """The CPU backend's extra buffer types in this build, on this host: (name, the
    ``ggml_backend_buffer_type_t``) each, read from ggml itself."""
    lc.llama_backend_init()
    lib = _ggml()
    if lib is None:
        return ()
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = lib.ggml_backend_dev_by_type(0)          # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return ()
    reg = lib.ggml_backend_dev_backend_reg(dev)
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return ()
    bufts = _EXTRA_BUFTS_FN(fn)(dev)
    found = []
    i = 0
    while bufts and bufts[i]:
        raw = lib.ggml_backend_buft_name(bufts[i])
        found.append((raw.decode("utf-8", "replace") if raw else "?", int(bufts[i])))
        i += 1
    return tuple(found)


def registered_extra_bufts() -> tuple[str, ...]:
    """The names of the CPU backend's extra buffer types in this build, on this host
    (``("CPU_REPACK",)``, ``("AMX", "CPU_REPACK")``)."""
    return tuple(name for name, _ in extra_bufts())


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# --- the decision ------------------------------------------------------------------------

_lock = threading.Lock()
_decided: dict[str, KernelChoice] = {}


def choose(mode: str = "auto") -> KernelChoice:
    """The kernel choice for a resident load under the ``repack`` setting ``mode``
    (decided once per process and mode; ``auto`` may run the probe, once per host)."""
    if mode not in MODES:
        raise ValueError(f"repack must be one of {', '.join(MODES)}, not {mode!r}")
    with _lock:
        if mode not in _decided:
            _decided[mode] = _decide(mode, registered_extra_bufts())
            log.info("kernels: %s", _decided[mode].line())
        return _decided[mode]


def within_memory(choice: KernelChoice, model_bytes: int, room: int) -> KernelChoice:
    """`choice`, or off where the repacked weights (copied out of the file mapping into
    this process's memory) with `REPACK_MARGIN` would not fit the `room` this process may
    hold (0: unknown, the choice stands). Under `on` too: a setting must not get the
    process killed at load."""
    if not choice.extra_bufts or not room or model_bytes + REPACK_MARGIN <= room:
        return choice
    gib = 1 << 30
    return KernelChoice(False, choice.registered, choice.mode, "memory",
                        f"the model ({model_bytes / gib:.1f} GiB) does not fit the memory "
                        f"this process may hold ({room / gib:.1f} GiB): repacking would copy "
                        "its weights into memory, so they stay in the file's own layout on "
                        "the file mapping")


def _decide(mode: str, registered: tuple[str, ...]) -> KernelChoice:
    if mode == "off":
        return KernelChoice(False, registered, mode, "setting", "turned off by the setting")
    if not registered:
        return KernelChoice(False, registered, mode, "none registered",
                            "this build has no extra buffer types for this CPU")
    if "AMX" in registered:       # even under `on`: a setting must not crash the server
        return KernelChoice(False, registered, mode, "known fault",
                            "this llama.cpp build's AMX kernels fault on batches of two "
                            "or more tokens")
    if mode == "on":
        return KernelChoice(True, registered, mode, "setting",
                            f"turned on by the setting: {', '.join(registered)}")
    usable, why = _probe_cached(registered)
    if usable:
        return KernelChoice(True, registered, mode, "probe",
                            f"{', '.join(registered)} checked by the kernel probe")
    return KernelChoice(False, registered, mode, "probe", why)


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bmoe" / CACHE_NAME


def _build_key(registered: tuple[str, ...]) -> str:
    """What a verdict holds for: these CPU flags, this llama.cpp build, these buffer types,
    and whether the probe is asked to fault (the tests' switch)."""
    h = hashlib.sha256()
    h.update(f"probe {PROBE_VERSION}\n".encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    for lib in sorted(_lib_dir().glob("*.so*")):
        try:
            st = lib.stat()
        except OSError:
            continue
        h.update(f"{lib.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(",".join(registered).encode())
    h.update(os.environ.get("BMOE_KERNEL_PROBE_FAULT", "").encode())
    return h.hexdigest()[:32]


def _probe_cached(registered: tuple[str, ...]) -> tuple[bool, str]:
    key = _build_key(registered)
    path = _cache_path()
    try:
        kept = json.loads(path.read_text())
        entry = kept.get(key) if isinstance(kept, dict) else None
    except (OSError, ValueError):
        kept, entry = {}, None
    if isinstance(entry, dict) and isinstance(entry.get("usable"), bool):
        return entry["usable"], str(entry.get("why", ""))
    usable, why = run_probe()
    kept = kept if isinstance(kept, dict) else {}
    kept[key] = {"usable": usable, "why": why}
    try:
        write_text(path, json.dumps(kept, indent=1) + "\n")
    except OSError as e:
        log.warning("kernels: could not keep the probe's verdict in %s: %s", path, e)
    return usable, why


def run_probe() -> tuple[bool, str]:
    """Run ``bmoe.kernelprobe`` in a child process: (usable, why not)."""
    try:
        done = subprocess.run([sys.executable, "-m", "bmoe.kernelprobe"],
                              capture_output=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return False, f"the kernel probe did not finish in {PROBE_TIMEOUT_S} s"
    except OSError as e:
        return False, f"the kernel probe could not start ({e.strerror})"
    where = _last_step(done.stderr)
    if done.returncode < 0:
        try:
            sig = signal.Signals(-done.returncode).name
        except ValueError:
            sig = f"signal {-done.returncode}"
        return False, f"the kernel probe died with {sig}" + (f" at {where}" if where else "")
    try:
        report = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"the kernel probe ended without a verdict (exit {done.returncode})"
    if not isinstance(report, dict) or not isinstance(report.get("usable"), bool):
        return False, "the kernel probe's verdict was not readable"
    return report["usable"], str(report.get("why") or "")


def _last_step(stderr: bytes) -> str:
    for line in reversed(stderr.decode("utf-8", "replace").splitlines()):
        if line.startswith("kernel probe: "):
            return line[len("kernel probe: "):]
    return ""
