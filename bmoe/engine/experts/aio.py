"""Linux native AIO (io_setup / io_submit / io_getevents) for O_DIRECT reads, over ctypes.

Why not threads: a missed slice first takes over a victim's pages (`memory.move_pages`,
an mremap), and a remap flushes the TLB of every CPU that ran a thread of this process
recently. With reader threads that is the other CPUs, every time: measured on this kind
of VM a 1 MiB move cost 70 us with one thread, 715 us with two reader lanes and ~1,100 us
with four, enough to halve the engine's read rate. With AIO one thread moves the pages
and submits every read of a layer at once; the kernel keeps them all in flight (queue
depth = the layer's reads) and no other thread of ours touches the address space.

Only what the reader needs: one context, PREAD commands on one descriptor, all waited
for. `Aio.open()` returns None where the kernel or the platform has no AIO.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

# syscall numbers: io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Iocb(ctypes.Structure):      # struct iocb, little-endian layout
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Event(ctypes.Structure):     # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class Aio:
    """One AIO context of `depth` requests at most in flight."""

    def __init__(self, ctx: int, depth: int, calls: tuple[int, int, int, int]) -> None:
        self._ctx, self.depth = ctx, depth
        self._setup, self._destroy, self._getevents, self._submit = calls
        self.timeout: float | None = None    # seconds pread_all waits for a completion

    @classmethod
    def open(cls, depth: int) -> Aio | None:
        calls = _SYSCALLS.get(platform.machine())
        if calls is None or os.environ.get("BMOE_AIO", "1") == "0":
            return None
        ctx = ctypes.c_ulong(0)
        if _libc.syscall(calls[0], ctypes.c_long(depth), ctypes.byref(ctx)) != 0:
            return None
        return cls(ctx.value, depth, calls)

    def pread_all(self, fd: int, reads: list[tuple[int, int, int]]) -> list[int]:
        """Read each (buffer address, length, file offset); returns each one's result:
        bytes read, or -errno. Raises TimeoutError when no read completed for `timeout`
        seconds (the reads still in flight stay so: the context is not usable any more,
        and close() waits for them)."""
        timeout = self.timeout
        results = [0] * len(reads)
        iocbs = (_Iocb * len(reads))()
        for i, (addr, n, off) in enumerate(reads):
            iocbs[i].data, iocbs[i].opcode, iocbs[i].fildes = i, _IOCB_CMD_PREAD, fd
            iocbs[i].buf, iocbs[i].nbytes, iocbs[i].offset = addr, n, off
        ptrs = (ctypes.POINTER(_Iocb) * len(reads))(*[ctypes.pointer(c) for c in iocbs])
        events = (_Event * self.depth)()
        sent = done = 0
        while done < len(reads):
            want = min(len(reads) - sent, self.depth - (sent - done))
            if want > 0:
                got = _libc.syscall(self._submit, ctypes.c_ulong(self._ctx), ctypes.c_long(want),
                                    ctypes.byref(ptrs, sent * ctypes.sizeof(ctypes.c_void_p)))
                if got < 0:
                    err = ctypes.get_errno()
                    if err == errno.EINTR or (err == errno.EAGAIN and sent > done):
                        got = 0
                    elif sent == done:       # nothing in flight: refuse the rest
                        for i in range(sent, len(reads)):
                            results[i] = -err
                        return results
                    else:
                        got = 0
                sent += got
            if sent == done:
                continue
            ts = None
            if timeout is not None:
                ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
            n = _libc.syscall(self._getevents, ctypes.c_ulong(self._ctx), ctypes.c_long(1),
                              ctypes.c_long(self.depth), events,
                              ctypes.byref(ts) if ts is not None else None)
            if n < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise OSError(ctypes.get_errno(), "io_getevents")
            if n == 0 and timeout is not None:
                raise TimeoutError(f"no read completed in {timeout:g} s")
            for e in events[:n]:
                results[e.data] = e.res
            done += n
        return results

    def close(self) -> None:
        if self._ctx:
            _libc.syscall(self._destroy, ctypes.c_ulong(self._ctx))
            self._ctx = 0
