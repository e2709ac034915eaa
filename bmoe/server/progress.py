"""A download's progress for a person: a `rich` bar per shard on a terminal, plain lines
otherwise.

`DownloadView.open(stream, files)` takes the files of one catalog entry in the order
the download fetches them (name, bytes) and is fed the entry's bytes received so far
(`update`), however the caller learns them (a job in this process, or the server's
listing). Since a job fetches its files in order, the bytes received fill the shards in
that order, so each shard's bar follows from the one total.

On a terminal (`stream.isatty()`): one `rich` bar per shard with its bytes, rate and
time left. Otherwise: a line when a shard starts, at most one every `PLAIN_EVERY_S`
while it runs, and one when it is whole, so a log or a pipe reads as a record.
"""

from __future__ import annotations

import time
from typing import IO, Protocol

PLAIN_EVERY_S = 2.0
MB = 1e6


class DownloadView(Protocol):
    def update(self, received: int, note: str = "") -> None: ...
    def close(self) -> None: ...


def open_view(stream: IO[str], files: list[tuple[str, int]], *, prefix: str = "") -> DownloadView:
    if stream.isatty():
        return RichView(stream, files)
    return PlainView(stream, files, prefix)


def shard_bytes(files: list[tuple[str, int]], received: int) -> list[int]:
    """Each file's bytes when `received` bytes of them have come, in order."""
    out = []
    for _, size in files:
        take = min(size, received) if size else received
        out.append(max(0, take))
        received -= take
    return out


def mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


class PlainView:
    def __init__(self, stream: IO[str], files: list[tuple[str, int]], prefix: str) -> None:
        self.stream, self.files, self.prefix = stream, files, prefix
        self.shown: dict[int, float] = {}           # shard -> when its last line was said
        self.whole: set[int] = set()
        self.last = (time.monotonic(), 0)
        self.rate = 0.0
        self.note = ""

    def _say(self, line: str) -> None:
        print(f"{self.prefix}{line}", file=self.stream, flush=True)

    def update(self, received: int, note: str = "") -> None:
        now = time.monotonic()
        t0, r0 = self.last
        if now - t0 >= 0.5:
            inst = max(0, received - r0) / (now - t0)
            self.rate = inst if not self.rate else 0.7 * self.rate + 0.3 * inst
            self.last = (now, received)
        if note and note != self.note:
            self._say(note)
        self.note = note
        for i, got in enumerate(shard_bytes(self.files, received)):
            name, size = self.files[i]
            if i in self.whole or (not got and i not in self.shown):
                continue
            if size and got >= size:
                self.whole.add(i)
                self._say(f"{name}: {mb(size)}, whole")
            elif i not in self.shown or now - self.shown[i] >= PLAIN_EVERY_S:
                self.shown[i] = now
                self._say(self._line(name, got, size))

    def _line(self, name: str, got: int, size: int) -> str:
        if not size:
            return f"{name}: {mb(got)}"
        line = f"{name}: {mb(got)} of {mb(size)} ({100 * got / size:.0f}%)"
        if self.rate > 0:
            line += f", {mb(int(self.rate))}/s, {max(0, size - got) / self.rate:.0f} s left"
        return line

    def close(self) -> None:
        pass


class RichView:
    def __init__(self, stream: IO[str], files: list[tuple[str, int]]) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        self.files = files
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=Console(file=stream),
                                 transient=False)
        self.tasks = [self.progress.add_task(name, total=size or None, start=False)
                      for name, size in files]
        self.started: set[int] = set()
        self.note = ""
        self.progress.start()

    def update(self, received: int, note: str = "") -> None:
        if note and note != self.note:
            self.progress.console.print(note)
        self.note = note
        for i, got in enumerate(shard_bytes(self.files, received)):
            if got and i not in self.started:
                self.started.add(i)
                self.progress.start_task(self.tasks[i])
            self.progress.update(self.tasks[i], completed=got)

    def close(self) -> None:
        self.progress.stop()
