"""Calls to the engines and render servers: one JSON POST retried across a pool's replicas,
streamed POSTs, aborts. Every call has a timeout (and none outlives the request's deadline);
an engine that cannot be reached or does not answer in time is marked down so the next pick
skips it, and a retry never goes back to a replica that already failed the request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import aiohttp

from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.engine_connections import EngineConnector
from pdserve.gateway.errors import (
    GatewayError,
    LeaseExpiring,
    UpstreamFailed,
    out_of_time,
    upstream_failure,
    upstream_message,
)
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.settings import GatewaySettings
from pdserve.vllm.protocol import ABORT_PATH, AbortRequest, abort_body
from pdserve.wirejson import dumps, loads_trusted

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


def json_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` for a body already encoded (pdserve.wirejson), with its content type."""
    return {**headers, "Content-Type": "application/json"}


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
                connector=EngineConnector(limit=0, keepalive_timeout=s.keepalive_expiry),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def deadline(self, started: float) -> float:
        """When a request that began at `started` (monotonic) has to be answered."""
        return started + self.settings.request_timeout

    def past_deadline(self, stage: str, endpoint: Endpoint | None) -> GatewayError:
        where = f" at {endpoint.url}" if endpoint is not None else ""
        return GatewayError(
            504,
            f"{stage}{where} did not answer within the request's limit of "
            f"{self.settings.request_timeout:g} s",
            kind="GatewayTimeout",
        )

    async def post_stream(
        self,
        endpoint: Endpoint,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        deadline: float | None = None,
    ) -> aiohttp.ClientResponse:
        """Open a streamed POST: its response headers within the first-byte timeout (and the
        deadline); the events are read with their own timeouts (streaming.sse_data). An engine
        that cannot be reached or does not answer is marked down (the error propagates for the
        caller to retry or report); GatewayError 504 once the deadline has passed."""
        wait = self.settings.first_byte_timeout
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                raise self.past_deadline("decode", endpoint)
        try:
            async with asyncio.timeout(wait):
                return await self.session.post(
                    f"{endpoint.url}{path}", data=dumps(body),
                    headers=json_headers(endpoint.upstream_headers(headers)),
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=self.settings.connect_timeout
                    ),
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
        deadline: float | None = None,
        tried: list[Endpoint] | None = None,
        start_by: float | None = None,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        """POST to one replica of a pool; on connection errors, timeouts, 5xx or a 200 that
        is not JSON try the next one. `prefill_tokens`: the prompt the call prefills, counted
        on the replica meanwhile.
        `deadline` (monotonic): no attempt outlives it; GatewayError 504 once it has passed.
        `start_by` (monotonic): no attempt starts after it (the body points at prefill's KV,
        whose lease runs out then); LeaseExpiring once it has passed.
        `tried`: replicas not to use, and where the ones this call used are added, so the
        caller's next attempt can skip them too."""
        tried = [] if tried is None else tried
        last, timed_out = "no endpoint", False
        while (endpoint := self.endpoints.pick(candidates, tried, affinity)) is not None:
            begun = time.monotonic()
            if start_by is not None and begun >= start_by:
                raise LeaseExpiring(
                    stage, f"prefill's KV lease runs out before {stage} could pull it"
                )
            tried.append(endpoint)
            limit = timeout if deadline is None else min(timeout, deadline - begun)
            if limit <= 0:
                raise self.past_deadline(stage, None)
            on_render = stage in ("render", "derender")
            if on_render:
                self.metrics.render_inflight.labels(endpoint.label).inc()
            try:
                async with (
                    counted(endpoint, prefill_tokens),
                    self.session.post(
                        f"{endpoint.url}{path}",
                        data=dumps(body),
                        headers=json_headers(endpoint.upstream_headers(headers)),
                        timeout=aiohttp.ClientTimeout(
                            total=limit, sock_connect=self.settings.connect_timeout
                        ),
                    ) as response,
                ):
                    status = response.status
                    payload = await response.read()
            except (TimeoutError, aiohttp.ClientError) as error:
                self.endpoints.mark_down(endpoint)
                if deadline is not None and time.monotonic() >= deadline:
                    raise self.past_deadline(stage, endpoint) from None
                timed_out = isinstance(error, TimeoutError)
                if timed_out:
                    connect = self.settings.connect_timeout
                    last = out_of_time(stage, endpoint.url, error, limit, connect)
                else:
                    last = f"{stage} at {endpoint.url}: {upstream_failure(error)}"
                    log.info(
                        "%s at %s failed: %r",
                        stage,
                        endpoint.url,
                        error,
                        extra={"request_id": headers.get("X-Request-Id")},
                    )
            else:
                if status < 500:
                    self.metrics.stage.labels(stage).observe(time.monotonic() - begun)
                    if status >= 400:
                        raise GatewayError(status, upstream_message(payload), kind="UpstreamError")
                    try:
                        return endpoint, loads_trusted(payload)
                    except ValueError:  # a broken replica (or what stands in front of it)
                        last, timed_out = f"{stage} at {endpoint.url} answered non-JSON", False
                else:
                    message = upstream_message(payload)
                    last, timed_out = f"{stage} at {endpoint.url}: HTTP {status}: {message}", False
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
        raise UpstreamFailed(stage, last, timed_out=timed_out)

    async def abort(self, endpoint: Endpoint | None, exchange: Exchange) -> None:
        """Stop the work `endpoint` does for a tokens-route exchange: POST vLLM's
        /inference/v1/abort_requests with the engine's name of the request, the exchange's
        headers along (the client's credentials, when the gateway passes them on: --api-key
        guards /inference). OpenAI engines (plain `vllm serve`) have no abort endpoint: they
        stop when the request's connection closes, which the caller's closing of the response
        (or cancelling of the call) does, so nothing is posted to them."""
        if endpoint is None or not exchange.tokens_api:
            return
        self.metrics.aborts.inc()
        # The engine named the request after the X-Request-Id it was sent (else the body's
        # request_id, which is the same id): name it the same way.
        sent_as = exchange.headers.get("X-Request-Id") or exchange.request_id
        await self.post_abort(endpoint, abort_body(sent_as), exchange.headers)

    async def post_abort(
        self, endpoint: Endpoint, body: AbortRequest, headers: Mapping[str, str]
    ) -> None:
        """Best effort: an engine that does not answer is not waited on for long."""
        with suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with self.session.post(
                f"{endpoint.url}{ABORT_PATH}",
                data=dumps(body),
                headers=json_headers(headers),
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as response:
                await response.read()
