"""`pdserve bench run`'s requests: sends a plan to an OpenAI-compatible endpoint (async httpx,
streaming) with the load generator (loadgen.drive), open loop at the planned arrival times or
closed loop at a fixed concurrency, and records every request. A failing target is recorded,
never raised; a stop event (Ctrl-C) ends the run early with what was measured, the requests in
flight marked cancelled. While it runs it samples the gateway's prefill admission queue from
/metrics when the target has one."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import httpx

from pdserve.bench.records import RequestRecord
from pdserve.bench.workload import PlannedRequest
from pdserve.loadgen import Clock, drive

QUEUE_METRIC = "pdserve_gateway_prefill_queue_long"
OLDEST_WAIT_METRIC = "pdserve_gateway_prefill_oldest_wait_seconds"
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    endpoint: Literal["completions", "chat"] = "completions"
    api_key: str | None = None
    metrics_url: str | None = None
    """Prometheus text with the gateway's prefill admission queue; None: not sampled."""
    class_header: bool = True
    """Send X-PDServe-Class: chat|document (pdserve's gateway classes requests by it)."""
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


@dataclass(frozen=True)
class Load:
    rate: float | None = None
    """Offered requests per (simulated) second, open loop; None: closed loop."""
    concurrency: int | None = None
    time_scale: float = 1.0
    """Real seconds per simulated second of the target (1 for real servers)."""
    max_inflight: int = 1024
    request_timeout: float = 600.0
    """Per request, real seconds."""
    metrics_interval: float | None = None
    """Real seconds between gateway queue samples; default half a simulated second, between
    20 and 200 real ms."""

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of a rate and a concurrency")
        if self.time_scale <= 0:
            raise ValueError("the time scale must be positive")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    def sample_every(self) -> float:
        if self.metrics_interval is not None:
            return self.metrics_interval
        return max(0.02, min(0.2, 0.5 * self.time_scale))


@dataclass(frozen=True)
class QueueSample:
    at_ms: float
    queue: float
    oldest_wait_ms: float


@dataclass
class RunResult:
    records: list[RequestRecord]
    samples: list[QueueSample] | None
    """None when the target exposes no gateway queue metrics."""
    interrupted: bool = False
    wall_seconds: float = 0.0


class Progress:
    """A one-line progress bar on a terminal; a line per tenth done otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.sent = self.done = self.failed = 0
        self._shown = -1.0
        self._tenth = -1

    def update(self, *, final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if not final and now - self._shown < 0.2:
                return
            self._shown = now
            width = 30
            filled = int(width * self.done / max(1, self.total))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(
                f"\r{self.label} [{bar}] {self.done}/{self.total} done, {self.sent} sent, "
                f"{self.failed} errors"
            )
            if final:
                self.stream.write("\n")
        else:
            tenth = 10 * self.done // max(1, self.total)
            if tenth == self._tenth and not final:
                return
            self._tenth = tenth
            self.stream.write(
                f"{self.label}: {self.done}/{self.total} done, {self.failed} errors\n"
            )
        self.stream.flush()


def request_body(target: Target, request: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _has_output(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(key) for key in ("content", "reasoning", "tool_calls")
        ):
            return True
    return False


def _error_text(status: int, payload: bytes) -> str:
    text = payload.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error", body.get("message", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        text = str(error)
    return f"HTTP {status}: {text.strip()}"[:MAX_ERROR_CHARS]


def new_record(request: PlannedRequest, clock: Clock) -> RequestRecord:
    return RequestRecord(
        request_id=request.request_id,
        request_class=request.request_class,
        group=request.group,
        prompt_tokens=request.prompt_tokens,
        requested_output_tokens=request.output_tokens,
        sent_at_ms=clock.now_ms(),
        warmup=request.warmup,
    )


async def stream_into(
    record: RequestRecord,
    client: httpx.AsyncClient,
    target: Target,
    request: PlannedRequest,
    clock: Clock,
) -> None:
    """Send one streamed request and fill its record; every failure ends up in the record's
    error (a cancellation marks it cancelled and propagates)."""
    headers = {"X-Request-Id": request.request_id}
    if target.class_header and request.request_class in ("chat", "document"):
        headers["X-PDServe-Class"] = request.request_class
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    chunks = 0
    usage: dict[str, Any] | None = None
    last: float | None = None
    done = False
    try:
        async with client.stream(
            "POST", target.url, json=request_body(target, request), headers=headers
        ) as response:
            if response.status_code != 200:
                record.error = _error_text(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    record.error = _error_text(200, data.encode())
                    continue
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
                if _has_output(event):
                    now = clock.now_ms()
                    chunks += 1
                    if last is None:
                        record.first_token_at_ms = now
                    else:
                        record.inter_token_ms.append(now - last)
                    last = now
        if not done and record.error is None:
            record.error = "the stream ended without [DONE]"
    except asyncio.CancelledError:
        record.cancelled = True
        raise
    except Exception as error:  # a broken target must never end the run
        record.error = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
    finally:
        record.finished_at_ms = clock.now_ms()
        if usage is not None and isinstance(usage.get("completion_tokens"), int):
            record.output_tokens = usage["completion_tokens"]
        else:
            record.output_tokens = chunks
        if usage is not None and isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        if record.error is None and chunks == 0 and not record.cancelled:
            record.error = "no output tokens"


def parse_queue(text: str) -> tuple[float, float] | None:
    """(long prompts waiting, oldest wait in seconds) from the gateway's metrics, if present."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (QUEUE_METRIC, OLDEST_WAIT_METRIC):
            with suppress(ValueError):
                values[name] = float(value.split()[0])
    if QUEUE_METRIC not in values:
        return None
    return values[QUEUE_METRIC], values.get(OLDEST_WAIT_METRIC, 0.0)


async def sample_queue(
    client: httpx.AsyncClient,
    url: str,
    clock: Clock,
    interval: float,
    samples: list[QueueSample],
) -> bool:
    """Poll until cancelled; False at once when the target has no such metrics."""
    while True:
        try:
            response = await client.get(url, timeout=5)
            parsed = parse_queue(response.text) if response.status_code == 200 else None
        except httpx.HTTPError:
            parsed = None
        if parsed is None and not samples:
            return False
        if parsed is not None:
            queue, oldest = parsed
            samples.append(QueueSample(clock.now_ms(), queue, oldest / clock.scale * 1000))
        await asyncio.sleep(interval)


async def run_load(
    target: Target,
    requests: list[PlannedRequest],
    load: Load,
    *,
    stop: asyncio.Event | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Send every planned request (or until stop is set) and wait for the answers."""
    stop = stop or asyncio.Event()
    clock = Clock(load.time_scale)
    records: list[RequestRecord] = []
    limits = httpx.Limits(
        max_connections=load.max_inflight, max_keepalive_connections=load.max_inflight
    )
    timeout = httpx.Timeout(load.request_timeout, connect=10.0)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(request: PlannedRequest) -> None:
            record = new_record(request, clock)
            if progress is not None:
                progress.sent += 1
            try:
                await stream_into(record, client, target, request, clock)
            finally:
                records.append(record)
                if progress is not None:
                    progress.done += 1
                    progress.failed += record.error is not None
                    progress.update()

        samples: list[QueueSample] = []
        sampler: asyncio.Task[bool] | None = None
        if target.metrics_url:
            sampler = asyncio.create_task(
                sample_queue(client, target.metrics_url, clock, load.sample_every(), samples)
            )
        interrupted = await drive(
            requests,
            one,
            clients=load.concurrency,
            offset=lambda request: request.offset,
            clock=clock,
            max_inflight=load.max_inflight,
            stop=stop,
        )
        available = True
        if sampler is not None:
            if sampler.done():
                available = sampler.result()
            else:
                sampler.cancel()
                with suppress(asyncio.CancelledError):
                    await sampler
    if progress is not None:
        progress.update(final=True)
    by_id = {r.request_id: r for r in records}
    return RunResult(
        records=[by_id[r.request_id] for r in requests if r.request_id in by_id],
        samples=samples if sampler is not None and available else None,
        interrupted=interrupted,
        wall_seconds=time.perf_counter() - started,
    )
