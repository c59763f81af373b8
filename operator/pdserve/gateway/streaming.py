"""Streaming to the client: the one SSE reader for engine streams (every wait in it bounded),
the client writer (which measures TTFT/ITL as the client sees them), and the derender pipeline
of a tokens stream. A stream the gateway answers always ends with a finish_reason or an error
event, then `[DONE]`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import error_body, without_addresses
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.vllm.derender_gaps import StreamStop
from pdserve.vllm.protocol import ChunkChoice, DerenderStreamRequest, derender_chunk_body
from pdserve.wirejson import dumps

log = logging.getLogger("pdserve.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = "[DONE]"


def sse(data: Any) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


class StreamTimeout(TimeoutError):
    """An engine stream went quiet for longer than it may."""


async def sse_data(
    content: AsyncIterable[bytes],
    *,
    first_by: float,
    idle: float,
    deadline: float,
    stage: str = "decode",
) -> AsyncGenerator[str, None]:
    """What each `data:` line of an engine's SSE stream carries, DONE included; other lines
    (comments, blank separators) are skipped. The first data line must come by `first_by`,
    each next one within `idle` seconds of the last, all by `deadline` (monotonic times):
    otherwise StreamTimeout. Read errors propagate to the caller."""
    lines = aiter(content)
    until, why = first_by, "no first event"
    while True:
        now = time.monotonic()
        if deadline < until:
            until, why = deadline, "the request's deadline passed"
        try:
            async with asyncio.timeout(max(0.0, until - now)):
                raw = await anext(lines)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamTimeout(f"{stage} stream timed out: {why}") from None
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line.startswith("data: "):
            yield line.removeprefix("data: ")
            until, why = time.monotonic() + idle, f"no event for {idle:g} s"


class ClientWriter:
    """Serializes writes to the client and records TTFT/ITL as the client sees them."""

    def __init__(
        self, response: web.StreamResponse, exchange: Exchange, metrics: GatewayMetrics
    ) -> None:
        self.response, self.exchange, self.metrics = response, exchange, metrics
        self.lock = asyncio.Lock()
        self.object_name = "chat.completion.chunk" if exchange.chat else "text_completion"
        self.finished = False  # [DONE] was sent
        exchange.writer = self

    def note_token(self) -> None:
        ex, now = self.exchange, time.monotonic()
        if ex.first_token_at is None:
            ex.first_token_at = now
            self.metrics.ttft.labels(ex.route).observe(now - ex.started)
        elif ex.last_chunk_at is not None:
            self.metrics.itl.labels(ex.route).observe(now - ex.last_chunk_at)
            ex.gaps.append(now - ex.last_chunk_at)
        ex.last_chunk_at = now

    async def send(self, chunk: Any) -> None:
        async with self.lock:
            await self.response.write(sse(chunk))

    async def write_line(self, data: str) -> None:
        """Pass one engine event through as it came."""
        await self.response.write(f"data: {data}\n\n".encode())

    async def error(self, status: int, message: str) -> None:
        """End the stream as failed (the request counts as such): an error event, without
        the upstream addresses the message may name (the log has them)."""
        ex = self.exchange
        ex.stream_error = status
        log.warning(
            "%s: stream ended with %d: %s", ex.request_id, status, message,
            extra={"request_id": ex.request_id},
        )  # fmt: skip
        kind = "GatewayTimeout" if status == 504 else "UpstreamError"
        await self.send(error_body(status, without_addresses(message), kind))

    async def done(self) -> None:
        async with self.lock:
            await self.response.write(b"data: [DONE]\n\n")
            self.finished = True


@dataclass(frozen=True)
class StreamDerender:
    """How the chunks of one streamed tokens request are derendered."""

    post: Callable[[DerenderStreamRequest], Awaitable[dict[str, Any]]]
    model: str
    request_id: str
    prompt_ids: list[int]
    request: Mapping[str, Any]
    chat: bool
    pipelining: bool
    """Merge tokens that arrive during a derender call into the next one (GatewaySettings)."""


class DerenderPipeline:
    """At most one derender call in flight per choice: tokens that arrive meanwhile are merged
    into the next call, so light load is per-token (TTFT untouched) and heavy load batches
    itself, cutting render CPU."""

    def __init__(
        self, derender: StreamDerender, index: int, writer: ClientWriter, metrics: GatewayMetrics
    ) -> None:
        self.derender, self.index, self.writer, self.metrics = derender, index, writer, metrics
        self.queue: asyncio.Queue[tuple[list[int], str | None, str | None]] = asyncio.Queue()
        self.stops = StreamStop(derender.request)
        self.task = asyncio.create_task(self.run())
        self.calls = 0
        self.finished = False
        """The engine sent this choice's finish_reason."""

    def push(self, token_ids: list[int], finish: str | None, stop: str | None = None) -> None:
        """Tokens of the choice; with its finish reason, the stop string that ended it (cut
        out of the text, pdserve/vllm/derender_gaps.py)."""
        if self.finished:
            return  # nothing comes after a finish reason
        self.finished = finish is not None
        self.queue.put_nowait((token_ids, finish, stop))

    async def close(self) -> None:
        """Derender what is still queued and end; a choice the engine never finished ends
        without a finish reason (the route then reports the stream as broken)."""
        if not self.finished:
            self.queue.put_nowait(([], "__abandoned__", None))
        await self.task

    def cancel(self) -> None:
        self.task.cancel()

    async def run(self) -> None:
        d = self.derender
        state: Any = None
        while True:
            token_ids, finish, stop = await self.queue.get()
            while d.pipelining and finish is None and not self.queue.empty():
                more, finish, stop = self.queue.get_nowait()
                token_ids = token_ids + more
            # The stream ended early: derender what arrived, then stop (no finish reason).
            abandoned = finish == "__abandoned__"
            if abandoned:
                finish = None
                if not token_ids:
                    break
            self.calls += 1
            self.metrics.tokens_per_derender.observe(len(token_ids))
            choice = ChunkChoice(
                index=self.index, token_ids=token_ids, finish_reason=finish, logprobs=None
            )
            body = derender_chunk_body(
                d.model, d.request_id, state, choice, d.prompt_ids, d.request, chat=d.chat
            )
            result = await d.post(body)
            state = result.get("stream_state")
            chunk = result["chunk"]
            chunk["id"] = d.request_id
            chunk["model"] = d.model
            choices = chunk.get("choices") or []
            for sent in choices:
                self.stops.correct(sent, stop, final=finish is not None or abandoned)
            if any(_has_content(c) or c.get("finish_reason") for c in choices):
                self.writer.note_token()
                await self.writer.send(chunk)
            if finish is not None or abandoned:
                break
        self.metrics.derender_calls.observe(self.calls)


def _has_content(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        return any(delta.get(k) for k in ("role", "content", "reasoning", "tool_calls"))
    return bool(choice.get("text"))
