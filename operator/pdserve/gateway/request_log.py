"""Per-request JSON Lines log in the chunked-prefill article's format: enough to recompute TTFT,
ITL and end-to-end time per request class afterwards. Written by a background task from a
bounded queue, so a slow disk never slows requests down (lines are dropped and counted instead).

Behind the compiled data plane the log has two writers: this gateway (the requests handed to it)
and the data plane (those it served, dataplane/requestlog.go), which writes to the file this log
opened (`fd`, passed down). So that their lines never interleave, each write here holds whole
lines and at most PIPE_BUF bytes (a write that size to a pipe, such as a container's standard
output, is atomic; so is any write to a file opened for appending), and the data plane writes
one line per write."""

from __future__ import annotations

import asyncio
import logging
import os
import select
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pdserve.wirejson import dumps

log = logging.getLogger("pdserve.gateway.requests")


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def atomic_writes(lines: Iterable[bytes], limit: int = select.PIPE_BUF) -> Iterator[bytes]:
    """`lines` joined into writes of whole lines, each at most `limit` bytes unless one line
    alone is longer (then it is a write of its own)."""
    pending: list[bytes] = []
    size = 0
    for line in lines:
        if pending and size + len(line) > limit:
            yield b"".join(pending)
            pending, size = [], 0
        pending.append(line)
        size += len(line)
    if pending:
        yield b"".join(pending)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RequestLog:
    def __init__(self, path: Path, *, max_pending: int = 10_000) -> None:
        self.path = path
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=max_pending)
        self.dropped = 0
        self.task: asyncio.Task[None] | None = None
        self.fd: int | None = None
        """The log's open file, once started (the data plane writes its entries to it too)."""

    def record(self, entry: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(entry)
        except asyncio.QueueFull:
            self.dropped += 1

    async def run(self) -> None:
        assert self.fd is not None
        while True:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for write in atomic_writes(dumps(e) + b"\n" for e in batch):
                write_all(self.fd, write)

    def start(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.task = asyncio.create_task(self.run(), name="request-log")

    async def stop(self) -> None:
        if self.task is None:
            return
        while not self.queue.empty() and not self.task.done():  # noqa: ASYNC110 - drain once
            await asyncio.sleep(0.01)
        self.task.cancel()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
