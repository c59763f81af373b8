"""Per-request JSON Lines log in the chunked-prefill article's format: enough to recompute TTFT,
ITL and end-to-end time per request class afterwards. Written by a background task from a
bounded queue, so a slow disk never slows requests down (lines are dropped and counted instead)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.gateway.requests")


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class RequestLog:
    def __init__(self, path: Path, *, max_pending: int = 10_000) -> None:
        self.path = path
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=max_pending)
        self.dropped = 0
        self.task: asyncio.Task[None] | None = None

    def record(self, entry: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(entry)
        except asyncio.QueueFull:
            self.dropped += 1

    async def run(self) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            while True:
                batch = [await self.queue.get()]
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                handle.write("".join(json.dumps(e) + "\n" for e in batch))
                handle.flush()

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name="request-log")

    async def stop(self) -> None:
        if self.task is None:
            return
        while not self.queue.empty() and not self.task.done():  # noqa: ASYNC110 - drain once
            await asyncio.sleep(0.01)
        self.task.cancel()
