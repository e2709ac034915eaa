"""Helper machines through llama.cpp's RPC backend: some of the model's layers elsewhere.

Theory of operation
-------------------
llama.cpp's RPC backend (`ggml-rpc`, built in with GGML_RPC=ON by scripts/install) makes a
remote machine's CPU (or GPU) a device of the local ggml: the layers given to it keep
their weights and their KV cache in that machine's memory, and each token sends it the
activations of one layer boundary and gets the next back. We add nothing of our own to
that protocol; this module does what llama.cpp itself leaves to whoever calls it:

- the worker (`bmoe-server rpc-worker`): `ggml_backend_rpc_start_server` on the CPU
  device of the local ggml registry, as llama.cpp's `rpc-server` program does (the wheel
  builds no such program). It serves one client at a time, forever.
- the check before a load: ggml-rpc ends the whole process (GGML_ABORT) when it cannot
  connect or the handshake fails, so every endpoint is first reached from Python (a TCP
  connect and the protocol's HELLO, then its devices' memory) with a time limit; a load
  whose helpers cannot be reached is refused naming their addresses.
- the devices: each endpoint goes through the RPC registry's `ggml_backend_rpc_add_server`
  and its devices go, NULL-terminated, into `llama_model_params.devices`; `n_gpu_layers`
  and `tensor_split` say how many layers each one holds (`Split`).
- the guard (bmoe/native/rpcguard.c): a helper that stops answering mid-turn also ends
  in GGML_ABORT, usually on ggml-rpc's dispatcher thread. The guard turns that abort into
  a return code of the decode; the session is then failed for good (its context cannot be
  used or freed: see rpcguard.c) and is leaked at unload. The helpers' sockets of that
  context are shut down here so the helpers still alive serve the next load, and since
  ggml-rpc keeps its connections by endpoint string, a later load reaches the same helper
  through another spelling of it (the port with a leading zero), never the dead socket.
"""

from __future__ import annotations

import ctypes
import importlib
import ipaddress
import os
import re
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc

from .errors import EngineError, LoadError

RPC_CMD_HELLO = 14                 # ggml-rpc.cpp enum rpc_cmd (HELLO must be 14)
RPC_CMD_DEVICE_COUNT = 15
RPC_CMD_GET_DEVICE_MEMORY = 11
RPC_CONN_CAPS_SIZE = 24            # ggml-rpc transport.h
RPC_PROTO_MAJOR = 7                # ggml-rpc.h RPC_PROTO_MAJOR_VERSION of the pinned engine
PROBE_TIMEOUT_S = 5.0              # connect + handshake + device memory, per helper
GGML_BACKEND_DEVICE_TYPE_CPU = 0   # ggml-backend.h enum ggml_backend_dev_type
GUARD_SIGNAL_OFFSET = 7            # SIGRTMIN + this wakes the engine thread (rpcguard.c)
DEFAULT_PORT = 50052               # llama.cpp's rpc-server default

WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: Host ('{host}') is != '127.0.0.1'
         Never expose the RPC server to an open network!
         This is an experimental feature and is not secure!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


class Unreachable(Exception):
    """One helper could not be reached or did not speak the protocol (the message says)."""


# --- endpoints ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """`HOST:PORT[,HOST:PORT...]` → endpoints; ValueError with a sentence if malformed."""
    out: list[Endpoint] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not HOST:PORT (a host name or IPv4 address, a "
                             "colon, a port from 1 to 65535).")
        if ":" in host:
            raise ValueError(f"{part!r}: IPv6 addresses are not supported by llama.cpp's "
                             "RPC client; use an IPv4 address or a host name.")
        endpoint = Endpoint(host, int(port))
        if endpoint in out:
            raise ValueError(f"{part} is listed twice.")
        out.append(endpoint)
    if len(out) > 16:
        raise ValueError("llama.cpp's RPC client takes at most 16 helpers.")
    return tuple(out)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- the check before a load ----------------------------------------------------------------

@dataclass(frozen=True)
class Helper:
    endpoint: Endpoint
    version: str
    devices: tuple[tuple[int, int], ...]     # (free, total) bytes per remote device

    @property
    def free(self) -> int:
        return sum(f for f, _ in self.devices)

    @property
    def total(self) -> int:
        return sum(t for _, t in self.devices)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise Unreachable("it closed the connection during the handshake")
        data += chunk
    return data


def _command(sock: socket.socket, cmd: int, body: bytes, reply: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(body)) + body)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != reply:
        raise Unreachable(f"it answered {size} bytes where the protocol has {reply}")
    return _recv_exact(sock, reply)


def probe(endpoint: Endpoint, timeout: float = PROBE_TIMEOUT_S) -> Helper:
    """Connect, HELLO, count the devices and read their memory; Unreachable if not."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as s:
            s.settimeout(timeout)
            hello = _command(s, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE),
                             4 + RPC_CONN_CAPS_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != RPC_PROTO_MAJOR:
                raise Unreachable(f"it speaks RPC protocol {major}.{minor}.{patch}, the "
                                  f"engine here {RPC_PROTO_MAJOR}.x (install the same bmoe "
                                  "version on both machines)")
            (count,) = struct.unpack("<I", _command(s, RPC_CMD_DEVICE_COUNT, b"", 4))
            devices = []
            for i in range(count):
                free, total = struct.unpack("<QQ", _command(
                    s, RPC_CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                devices.append((free, total))
    except socket.timeout:
        raise Unreachable(f"no answer within {timeout:g} s (is it serving another "
                          "client?)") from None
    except OSError as e:
        raise Unreachable(e.strerror or type(e).__name__) from None
    if not devices:
        raise Unreachable("it offers no device")
    return Helper(endpoint, f"{major}.{minor}.{patch}", tuple(devices))


def reach(endpoints: tuple[Endpoint, ...]) -> list[Helper]:
    """Every helper, or LoadError naming each one that cannot be reached and why."""
    helpers, failures = [], []
    for endpoint in endpoints:
        try:
            helpers.append(probe(endpoint))
        except Unreachable as e:
            failures.append(f"{endpoint} ({e})")
    if failures:
        raise LoadError("The model was not loaded: these RPC helpers cannot be reached: "
                        + "; ".join(failures) + ". Start `bmoe-server rpc-worker` there, "
                        "or change {rpc}.")
    return helpers


# --- the libraries --------------------------------------------------------------------------

def _libdir() -> Path:
    return Path(lc.__file__).parent / "lib"


def _loaded(name: str) -> ctypes.CDLL:
    """The copy of llama_cpp/lib/`name` this process already runs. The wheel ships
    libggml.so and libggml.so.0 as two files: opening the other one would give a second
    ggml, with its own abort callback and backend registry."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if str(_libdir()) in line}
    for path in sorted(paths):
        if Path(path).name in (name, name + ".0"):
            return ctypes.CDLL(path)
    return ctypes.CDLL(str(_libdir() / (name + ".0")))


def _ggml() -> ctypes.CDLL:
    lib = _loaded("libggml.so")
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    return lib


def _rpc_proc(ggml: ctypes.CDLL, name: str) -> int:
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise LoadError("This engine was built without llama.cpp's RPC backend: run "
                        "scripts/install (it builds llama-cpp-python with GGML_RPC=ON).")
    address = ggml.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not address:
        raise LoadError(f"llama.cpp's RPC backend has no {name}.")
    return int(address)


# --- the worker -----------------------------------------------------------------------------

def run_worker(host: str, port: int, threads: int, cache_dir: str | None,
               allow_network: bool) -> int:
    """Serve this machine's CPU to one bmoe server at a time, until killed. Exit code."""
    if not is_loopback(host) and not allow_network:
        print(f"rpc-worker: refusing to listen on {host}: llama.cpp's RPC is unauthenticated "
              "and anyone who reaches the port can run code on this machine's memory. "
              "Add --allow-network to listen on a network address anyway.", file=sys.stderr)
        return 2
    if not is_loopback(host):
        print(WARNING.format(host=host), file=sys.stderr)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    ggml = _ggml()
    start = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                             ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))(
        _rpc_proc(ggml, "ggml_backend_rpc_start_server"))
    cpu = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not cpu:
        print("rpc-worker: ggml has no CPU device", file=sys.stderr)
        return 1
    devices = (ctypes.c_void_p * 1)(cpu)
    # The server loop never returns to Python: let SIGINT/SIGTERM end the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None,
          max(1, threads), 1, devices)
    print(f"rpc-worker: could not listen on {host}:{port} (in use, or not an address of "
          "this machine)", file=sys.stderr)
    return 1


# --- the devices of a load ------------------------------------------------------------------

_dead_spellings: set[str] = set()     # endpoint strings whose ggml-rpc connection is dead


def spelling(endpoint: Endpoint) -> str:
    """The endpoint string to hand ggml-rpc: one whose cached connection is not dead."""
    zeros = 0
    while True:
        text = f"{endpoint.host}:{'0' * zeros}{endpoint.port}"
        if text not in _dead_spellings:
            return text
        zeros += 1


@dataclass(frozen=True)
class Split:
    """How many layers go to the helpers (llama.cpp's n_gpu_layers: the last ones, the
    output layer counted) and each device's share of them (tensor_split)."""
    n_layers: int
    shares: tuple[float, ...]


HELPER_MEMORY_USE = 0.9    # of the memory a helper reports free, what its layers may take


def layer_bytes(path: str | os.PathLike[str]) -> list[int]:
    """Bytes of each repeating layer (blk.N.*) in file order, then of the output layer
    (output*.weight): the units llama.cpp's n_gpu_layers counts from the end."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    try:
        layers: dict[int, int] = {}
        output = 0
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            if m:
                layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + int(t.n_bytes)
            elif t.name.startswith("output"):
                output += int(t.n_bytes)
        return [layers[i] for i in sorted(layers)] + [output]
    finally:
        reader.tensors.clear()
        del reader


def split_by_memory(helpers: list[Helper], sizes: list[int]) -> Split:
    """As many of the last layers (`sizes`: layer_bytes) as fit in the helpers' reported
    free memory (HELPER_MEMORY_USE of it), shared among their devices by that memory."""
    free = [float(f) for h in helpers for f, _ in h.devices]
    total = sum(free) or 1.0
    room, used, n = total * HELPER_MEMORY_USE, 0, 0
    for size in reversed(sizes):
        if used + size > room:
            break
        used, n = used + size, n + 1
    return Split(n, tuple(f / total for f in free))


class RpcDevices:
    """The helpers of one load: their ggml devices, the split, and the decode guard."""

    def __init__(self, endpoints: tuple[Endpoint, ...], helpers: list[Helper]) -> None:
        self.endpoints = endpoints
        self.helpers = helpers
        self.spellings = [spelling(e) for e in endpoints]
        self.failed: str | None = None
        ggml = _ggml()
        add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
            _rpc_proc(ggml, "ggml_backend_rpc_add_server"))
        devices: list[int] = []
        self.names: list[str] = []
        for text in self.spellings:
            reg = add(text.encode())
            if not reg:
                raise LoadError(f"The RPC helper at {text} offers no device.")
            for i in range(ggml.ggml_backend_reg_dev_count(reg)):
                dev = ggml.ggml_backend_reg_dev_get(reg, i)
                devices.append(int(dev))
                self.names.append(ggml.ggml_backend_dev_name(dev).decode())
        self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
        self._split = (ctypes.c_float * lc.llama_max_devices())()
        self._guard = _Guard()

    def split_for(self, path: str | os.PathLike[str], layers: int = -1) -> Split:
        """The split of this load: the last `layers` layers (llama.cpp's n_gpu_layers), or
        with -1 the last layers that fit the helpers' memory; shared by that memory."""
        self.layer_bytes = layer_bytes(path)
        split = split_by_memory(self.helpers, self.layer_bytes)
        if layers >= 0:
            split = Split(min(layers, len(self.layer_bytes)), split.shares)
        return split

    def first_remote_layer(self, split: Split) -> int:
        """The first repeating layer a helper holds (llama.cpp offloads the last
        n_gpu_layers units, the output layer counted); the layer count if none."""
        n_repeating = len(self.layer_bytes) - 1
        return max(0, min(n_repeating, n_repeating + 1 - split.n_layers))

    def configure(self, params: Any, split: Split) -> None:
        """Put the helpers' devices and `split` into llama_model_params."""
        for i, share in enumerate(split.shares[:len(self._split)]):
            self._split[i] = share
        params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        params.n_gpu_layers = split.n_layers
        params.split_mode = lc.LLAMA_SPLIT_MODE_LAYER
        params.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        self.split = split
        counts = _layers_per_device(split, len(self.layer_bytes) - 1)
        self.layers = counts


    def load_model(self, path: bytes, params: Any) -> Any:
        """llama_model_load_from_file under the guard; a lost helper raises LoadError."""
        model = self._guard.load(path, params)
        if model is _Guard.ENDED:
            self._fail(self._guard.message(), "while the model loaded")
            raise LoadError(self.failed or "")
        return model

    def init_context(self, model: Any, params: Any) -> Any:
        """llama_init_from_model under the guard; a lost helper raises LoadError."""
        ctx = self._guard.init(model, params)
        if ctx is _Guard.ENDED:
            self._fail(self._guard.message(), "while the model loaded")
            raise LoadError(self.failed or "")
        return ctx

    def decode(self, ctx: Any, batch: Any) -> int:
        """llama_decode and llama_synchronize under the guard; a lost helper raises
        EngineError (and fails us)."""
        if self.failed:
            raise EngineError("failed", self.failed)
        rc = self._guard.decode(ctx, batch)
        if rc == self._guard.jumped:
            self._fail(self._guard.message())
            raise EngineError("failed", self.failed or "")
        return rc

    def _fail(self, detail: str, when: str = "in the middle of the turn") -> None:
        for text in self.spellings:
            _dead_spellings.add(text)
        shutdown_sockets_to(self.endpoints)
        lost = []
        for endpoint in self.endpoints:
            try:
                probe(endpoint, timeout=1.0)
            except Unreachable:
                lost.append(str(endpoint))
        who = ", ".join(lost) if lost else ", ".join(str(e) for e in self.endpoints)
        ended = "so the turn ended" if "turn" in when else "so the load failed"
        self.failed = (f"The RPC helper at {who} stopped answering {when}, {ended}. The "
                       "model must be loaded again (with the helper running, or without it).")
        print(f"bmoe: lost an RPC helper ({who}): {detail.strip()}", file=sys.stderr)

    def describe(self) -> list[dict[str, Any]]:
        """The helpers as /api/info lists them."""
        out = []
        names = iter(self.names)
        layers = iter(getattr(self, "layers", []))
        for h in self.helpers:
            for free, total in h.devices:
                out.append({"name": next(names, ""), "kind": "rpc",
                            "endpoint": str(h.endpoint), "protocol": h.version,
                            "memory_free": free, "memory_total": total,
                            "layers": next(layers, 0),
                            "status": "lost" if self.failed else "ok"})
        return out


def _layers_per_device(split: Split, n_layer: int) -> list[int]:
    """How llama.cpp deals the split's layers (the output counted) to the devices: layer
    i of the offloaded run goes to the first device whose cumulative share exceeds
    i / n (llama-model.cpp, get_layer_buft_list)."""
    n = n_layer + 1 if split.n_layers < 0 else min(split.n_layers, n_layer + 1)
    bounds, acc = [], 0.0
    for share in split.shares:
        acc += share
        bounds.append(acc / (sum(split.shares) or 1.0))
    counts = [0] * len(split.shares)
    for i in range(n):
        at = next((d for d, b in enumerate(bounds) if i / n < b), len(bounds) - 1)
        counts[at] += 1
    return counts


def shutdown_sockets_to(endpoints: tuple[Endpoint, ...]) -> int:
    """Shut down (not close: ggml-rpc still owns the fds) this process's TCP connections
    to `endpoints`, so each helper sees the end of its client and serves the next one."""
    wanted = set()
    for e in endpoints:
        try:
            for info in socket.getaddrinfo(e.host, e.port, socket.AF_INET, socket.SOCK_STREAM):
                wanted.add((str(info[4][0]), e.port))
        except OSError:
            continue
    count = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM \
                    and tuple(s.getpeername()) in wanted:
                s.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            s.close()
    return count


# --- the guard ------------------------------------------------------------------------------

class _Guard:
    """bmoe/native/rpcguard.c, bound to the loaded libraries."""

    _lib: ctypes.CDLL | None = None
    ENDED = object()          # what load/init return when the guard ended the call

    def __init__(self) -> None:
        if _Guard._lib is None:
            _Guard._lib = _load_guard()
        lib = _Guard._lib
        self.lib = lib
        self.jumped = lib.bmoe_rpcguard_jumped_code()
        llama = _loaded("libllama.so")
        self._decode = ctypes.cast(llama.llama_decode, ctypes.c_void_p)
        self._sync = ctypes.cast(llama.llama_synchronize, ctypes.c_void_p)
        self._load = ctypes.cast(llama.llama_model_load_from_file, ctypes.c_void_p)
        self._init = ctypes.cast(llama.llama_init_from_model, ctypes.c_void_p)

    def load(self, path: bytes, params: Any) -> Any:
        ended = ctypes.c_int(0)
        model = self.lib.bmoe_rpcguard_load(self._load, path, ctypes.byref(params),
                                            ctypes.byref(ended))
        return _Guard.ENDED if ended.value else model

    def init(self, model: Any, params: Any) -> Any:
        ended = ctypes.c_int(0)
        ctx = self.lib.bmoe_rpcguard_init(self._init, model, ctypes.byref(params),
                                          ctypes.byref(ended))
        return _Guard.ENDED if ended.value else ctx

    def decode(self, ctx: Any, batch: Any) -> int:
        return int(self.lib.bmoe_rpcguard_decode(self._decode, self._sync, ctx, batch))

    def message(self) -> str:
        out = ctypes.create_string_buffer(1024)
        self.lib.bmoe_rpcguard_message(out, len(out))
        return out.value.decode("utf-8", "replace")


def _load_guard() -> ctypes.CDLL:
    rpcguard = importlib.import_module("bmoe.native.rpcguard")
    if [f[0] for f in lc.llama_batch._fields_] != ["n_tokens", "token", "embd", "pos",
                                                   "n_seq_id", "seq_id", "logits"]:
        raise LoadError("llama_batch changed in this llama-cpp-python: the RPC guard "
                        "(bmoe/native/rpcguard.c) needs updating.")
    lib = ctypes.CDLL(rpcguard.__file__)
    lib.bmoe_rpcguard_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.bmoe_rpcguard_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         lc.llama_batch]
    lib.bmoe_rpcguard_decode.restype = ctypes.c_int32
    lib.bmoe_rpcguard_message.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for which, layout in ((0, lc.llama_model_params), (1, lc.llama_context_params)):
        if ctypes.sizeof(layout) != 8 * lib.bmoe_rpcguard_params_words(which) \
                or ctypes.alignment(layout) != 8:
            raise LoadError(f"{layout.__name__} changed in this llama-cpp-python: the RPC "
                            "guard (bmoe/native/rpcguard.c) needs updating.")
    for name in ("bmoe_rpcguard_load", "bmoe_rpcguard_init"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_void_p
    ggml_base = _loaded("libggml-base.so")
    set_abort = ctypes.cast(ggml_base.ggml_set_abort_callback, ctypes.c_void_p)
    omp: int | None = None
    try:
        omp = ctypes.cast(ctypes.CDLL("libgomp.so.1").omp_in_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        omp = None
    sig = signal.SIGRTMIN + GUARD_SIGNAL_OFFSET
    if lib.bmoe_rpcguard_install(set_abort, omp, int(sig)) != 0:
        raise LoadError("The RPC guard could not be installed.")
    return lib


def wait_for_worker(endpoint: Endpoint, timeout: float) -> Helper:
    """Probe `endpoint` until it answers (tests, the benchmark); Unreachable at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return probe(endpoint, timeout=1.0)
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
