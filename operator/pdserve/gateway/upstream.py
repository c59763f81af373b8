"""Calls to the engines and render servers: one JSON POST retried across a pool's replicas,
streamed POSTs, aborts. Every call has a timeout; an engine that cannot be reached is marked
down so the next pick skips it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import aiohttp

from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.errors import GatewayError, UpstreamFailed, upstream_message
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.settings import GatewaySettings
from pdserve.vllm.protocol import abort_body

log = logging.getLogger("pdserve.gateway")


@asynccontextmanager
async def counted(endpoint: Endpoint, prefill_tokens: int = 0) -> AsyncIterator[Callable[[], None]]:
    """Count a request on its engine from the moment it is sent (so the next pick sees it,
    without waiting for a scrape), with the prompt it still has to prefill until the
    yielded `prefilled()` is called."""
    endpoint.inflight += 1
    endpoint.prefill_backlog += prefill_tokens
    remaining = prefill_tokens

    def prefilled() -> None:
        nonlocal remaining
        endpoint.prefill_backlog -= remaining
        remaining = 0

    try:
        yield prefilled
    finally:
        endpoint.inflight -= 1
        prefilled()


class UpstreamClient:
    def __init__(
        self, endpoints: Endpoints, metrics: GatewayMetrics, settings: GatewaySettings
    ) -> None:
        self.endpoints, self.metrics, self.settings = endpoints, metrics, settings
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """aiohttp, not httpx, upstream: per request it costs a fraction of the CPU."""
        if self._session is None:
            s = self.settings
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=s.keepalive_expiry),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout),
                json_serialize=json.dumps,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def stream_timeout(self) -> aiohttp.ClientTimeout:
        """No total limit for a stream; a read that stalls this long fails it."""
        s = self.settings
        return aiohttp.ClientTimeout(
            total=None, sock_connect=s.connect_timeout, sock_read=s.decode_timeout
        )

    async def post_stream(
        self, endpoint: Endpoint, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """Open a streamed POST; an engine that cannot be reached is marked down (the error
        propagates for the caller to retry or report)."""
        try:
            return await self.session.post(
                f"{endpoint.url}{path}", json=body, headers=dict(headers),
                timeout=self.stream_timeout(),
            )  # fmt: skip
        except (TimeoutError, aiohttp.ClientError):
            self.endpoints.mark_down(endpoint)
            raise

    async def post_json(
        self,
        stage: str,
        candidates: list[Endpoint],
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout: float,  # noqa: ASYNC109 - a per-hop client timeout, not a cancel scope
        *,
        retry: bool = True,
        affinity: Mapping[str, int] | None = None,
        prefill_tokens: int = 0,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        """POST to one replica of a pool; on connection errors or 5xx try the next one.
        `prefill_tokens`: the prompt the call prefills, counted on the replica meanwhile."""
        tried: list[Endpoint] = []
        last = "no endpoint"
        while (endpoint := self.endpoints.pick(candidates, tried, affinity)) is not None:
            tried.append(endpoint)
            begun = time.monotonic()
            on_render = stage in ("render", "derender")
            if on_render:
                self.metrics.render_inflight.labels(endpoint.label).inc()
            try:
                async with (
                    counted(endpoint, prefill_tokens),
                    self.session.post(
                        f"{endpoint.url}{path}",
                        json=body,
                        headers=dict(headers),
                        timeout=aiohttp.ClientTimeout(
                            total=timeout, sock_connect=self.settings.connect_timeout
                        ),
                    ) as response,
                ):
                    status = response.status
                    payload = await response.read()
            except (TimeoutError, aiohttp.ClientError) as error:
                last = f"{stage} at {endpoint.url}: {type(error).__name__}: {error}"
                self.endpoints.mark_down(endpoint)
            else:
                if status < 500:
                    self.metrics.stage.labels(stage).observe(time.monotonic() - begun)
                    if status >= 400:
                        raise GatewayError(status, upstream_message(payload), kind="UpstreamError")
                    try:
                        return endpoint, json.loads(payload)
                    except json.JSONDecodeError:
                        raise GatewayError(
                            502,
                            f"{stage} at {endpoint.url} answered non-JSON",
                            kind="UpstreamError",
                        ) from None
                message = upstream_message(payload)
                last = f"{stage} at {endpoint.url}: HTTP {status}: {message}"
                if "KV transfer" in last:
                    raise UpstreamFailed(stage, last, status)
            finally:
                if on_render:
                    self.metrics.render_inflight.labels(endpoint.label).dec()
                    spent = time.monotonic() - begun
                    self.metrics.render_call.labels(endpoint.label, stage).observe(spent)
            if not retry:
                break
            self.metrics.retries.labels(stage, "upstream_error").inc()
            log.warning(
                "%s; trying another replica",
                last,
                extra={"request_id": headers.get("X-Request-Id")},
            )
        raise UpstreamFailed(stage, last)

    async def abort(self, endpoint: Endpoint | None, request_ids: list[str]) -> None:
        if endpoint is None:
            return
        self.metrics.aborts.inc()
        with suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with self.session.post(
                f"{endpoint.url}/abort_requests",
                json=abort_body(request_ids),
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as response:
                await response.read()
