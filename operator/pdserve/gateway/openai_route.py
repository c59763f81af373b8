"""Routes 2 and 4, engines that speak OpenAI: the OpenAI-level P/D handoff (prefill, then
decode with its kv_transfer_params), or straight to decode (aggregated, and P/D's fallback).
Streams are passed through event by event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.errors import (
    GatewayError,
    json_response,
    out_of_time,
    upstream_failure,
    upstream_message,
    without_addresses,
)
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.hops import Hops
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.placement import Placement
from pdserve.gateway.planner import RoutePlanner
from pdserve.gateway.streaming import DONE, SSE_HEADERS, ClientWriter, StreamTimeout, sse_data
from pdserve.gateway.upstream import UpstreamClient, counted
from pdserve.vllm.protocol import (
    openai_decode_body,
    openai_path,
    openai_prefill_body,
    prefill_handoff_params,
)
from pdserve.wirejson import dumps_text, loads_trusted

log = logging.getLogger("pdserve.gateway")


class OpenAIRoute:
    def __init__(
        self,
        upstream: UpstreamClient,
        hops: Hops,
        planner: RoutePlanner,
        placement: Placement,
        metrics: GatewayMetrics,
    ) -> None:
        self.upstream, self.hops, self.planner = upstream, hops, planner
        self.placement, self.metrics = placement, metrics

    async def serve(self, ex: Exchange) -> web.StreamResponse:
        path = openai_path(ex.chat)
        kv: dict[str, Any] | None = None
        prefill_endpoint: Endpoint | None = None
        self.planner.decide_auto(ex, ex.estimated_prompt_tokens())
        if ex.pd:
            prefill_body = openai_prefill_body(ex.body, prefill_handoff_params())
            prefilled = await self.hops.prefill(ex, path, prefill_body)
            if prefilled is not None:
                prefill_endpoint, kv = prefilled
        body = openai_decode_body(ex.body, kv)
        if not ex.stream:
            answer = await self.hops.decode_once(
                ex, path, body, ex.body if kv is not None else None, prefill_endpoint
            )
            answer.pop("kv_transfer_params", None)
            usage = answer.get("usage") or {}
            ex.prompt_tokens = usage.get("prompt_tokens")
            ex.output_tokens = usage.get("completion_tokens")
            return json_response(answer)
        if kv is not None and await self.hops.lease_ran_out(ex, prefill_endpoint):
            body = openai_decode_body(ex.body, None)
        return await self.proxy_stream(ex, path, body)

    async def proxy_stream(
        self, ex: Exchange, path: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        with_kv = "kv_transfer_params" in body
        endpoint = self.upstream.endpoints.pick(
            self.hops.decode_candidates(ex, with_kv=with_kv),
            affinity=self.placement.affinity(ex, "decode", None),
        )
        if endpoint is None:
            raise GatewayError(503, "no healthy decode endpoint")
        self.placement.remember(ex, "decode", endpoint, None)
        # Count the stream on its engine at once: the next pick must not wait for a scrape.
        backlog = 0 if with_kv else ex.estimated_prompt_tokens()
        async with counted(endpoint, backlog) as prefilled:
            return await self._proxy_stream(ex, endpoint, path, body, prefilled)

    async def _proxy_stream(
        self,
        ex: Exchange,
        endpoint: Endpoint,
        path: str,
        body: dict[str, Any],
        prefilled: Callable[[], None],
    ) -> web.StreamResponse:
        """Pass decode's events through. The stream ends with every choice's finish_reason, or
        with an error event (decode's own, or the gateway's when decode broke, went quiet past
        the idle timeout or the deadline, sent a malformed event or `[DONE]` before a
        finish_reason; the connection to decode is then closed, which aborts its work);
        `[DONE]` either way."""
        s = self.upstream.settings
        deadline = self.upstream.deadline(ex.started)
        try:
            upstream = await self.upstream.post_stream(
                endpoint, path, body, ex.headers, deadline=deadline
            )
        except TimeoutError as error:
            raise GatewayError(
                504,
                out_of_time("decode", endpoint.url, error, s.first_byte_timeout, s.connect_timeout),
                kind="GatewayTimeout",
            ) from None
        except aiohttp.ClientError as error:
            log.info("decode at %s failed: %r", endpoint.url, error)
            raise GatewayError(
                502, f"decode at {endpoint.url}: {upstream_failure(error)}", kind="UpstreamError"
            ) from None
        try:
            if upstream.status != 200:
                raise GatewayError(
                    upstream.status if upstream.status < 500 else 502,
                    upstream_message(await upstream.read()),
                    kind="UpstreamError",
                )
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(ex.request)
            writer = ClientWriter(response, ex, self.metrics)
            done = False
            broke = ""
            status = 502
            events = 0
            finishes: dict[int, bool] = {}  # choice index -> its finish_reason came
            last_event: float | None = None
            opened = time.monotonic()
            try:
                try:
                    lines = sse_data(
                        upstream.content,
                        first_by=opened + s.first_byte_timeout,
                        idle=s.idle_timeout,
                        deadline=deadline,
                    )
                    async with aclosing(lines) as stream:
                        async for data in stream:
                            if data == DONE:
                                done = True
                                break
                            try:
                                event = loads_trusted(data)
                                if "error" in event:  # decode's own error event: pass it on
                                    ex.stream_error = status
                                    data = scrubbed(event, data)
                                for choice in event.get("choices") or []:
                                    index = int(choice.get("index", 0))
                                    finished = choice.get("finish_reason") is not None
                                    finishes[index] = finishes.get(index, False) or finished
                            except (ValueError, TypeError, AttributeError) as error:
                                broke = f"decode sent a malformed event ({error})"
                                break
                            now = time.monotonic()
                            if last_event is not None:
                                self.planner.note_step(endpoint, now - last_event, now)
                            last_event = now
                            events += 1
                            if "kv_transfer_params" in body:
                                self.planner.note_handoff(ex, now, ex.estimated_prompt_tokens())
                            prefilled()
                            writer.note_token()
                            await writer.write_line(data)
                except StreamTimeout as error:
                    broke, status = str(error), 504
                except (TimeoutError, aiohttp.ClientError) as error:
                    broke = f"decode stream broke ({type(error).__name__})"
                complete = done and bool(finishes) and all(finishes.values())
                if complete and ex.stream_error is None:
                    self.planner.policy.observe_output(events)
                elif ex.stream_error is None:
                    if not broke:
                        broke = "sent [DONE] before a finish_reason" if done else "closed it"
                        broke = f"decode {broke}"
                    await writer.error(
                        status, f"decode stream ended before the answer was complete: {broke}"
                    )
                await writer.done()
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away. A plain `vllm serve` has no abort endpoint: closing
                # the connection is what aborts its request.
                upstream.close()
                raise
            if not complete:
                # Decode may still be generating (a stalled stream): stop it the same way.
                upstream.close()
            return response
        finally:
            upstream.release()


def scrubbed(event: dict[str, Any], data: str) -> str:
    """An engine's error event as the client may see it: without the addresses its message may
    name (the gateway's own error events are scrubbed the same way)."""
    error = event.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return data
    message = without_addresses(error["message"])
    if message == error["message"]:
        return data
    return dumps_text({**event, "error": {**error, "message": message}})
