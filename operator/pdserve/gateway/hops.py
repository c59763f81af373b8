"""The P/D hops both route families share: prefill (with the long-prompt admission slot), the
KV lease check before each decode sent to pull prefill's KV, and a non-streamed decode that
falls back to local prefill when it cannot load prefill's KV (or its lease runs out first).
Prefill waits at most the first-byte timeout, a non-streamed decode (whose first byte is its
whole answer) until the request's deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.errors import GatewayError, LeaseExpiring, UpstreamFailed
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.fairqueue import LONG, PrefillAdmission
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.placement import Placement
from pdserve.gateway.planner import RoutePlanner
from pdserve.gateway.settings import GatewaySettings
from pdserve.gateway.upstream import UpstreamClient

log = logging.getLogger("pdserve.gateway")


class Hops:
    def __init__(
        self,
        upstream: UpstreamClient,
        planner: RoutePlanner,
        placement: Placement,
        admission: PrefillAdmission,
        peers: PeerAdmission,
        settings: GatewaySettings,
    ) -> None:
        self.upstream, self.planner, self.placement = upstream, planner, placement
        self.admission, self.peers, self.settings = admission, peers, settings

    def decode_candidates(self, exchange: Exchange, *, with_kv: bool) -> list[Endpoint]:
        local_on_prefill_pool = self.planner.policy.settings.local_on_prefill_pool
        return self.placement.decode_candidates(
            exchange, with_kv=with_kv, local_on_prefill_pool=local_on_prefill_pool
        )

    async def prefill(
        self,
        exchange: Exchange,
        path: str,
        body: dict[str, Any],
        token_ids: list[int] | None = None,
    ) -> tuple[Endpoint, dict[str, Any]] | None:
        """Run prefill; None when no prefill replica could (the caller prefills on decode)."""
        prompt_tokens = len(token_ids) if token_ids else exchange.estimated_prompt_tokens()
        request_class = self.admission.request_class(
            prompt_tokens, exchange.request.headers.get("X-PDServe-Class")
        )
        pool = exchange.selection.pools["prefill"]
        affinity = self.placement.affinity(exchange, "prefill", token_ids)
        try:
            endpoint, answer = await self.call_prefill(
                exchange, path, body, pool, affinity, request_class, prompt_tokens
            )
            self.placement.remember(exchange, "prefill", endpoint, token_ids)
        except UpstreamFailed as error:
            log.warning(
                "%s: prefill failed (%s); prefilling on decode",
                exchange.request_id,
                error,
                extra={"request_id": exchange.request_id},
            )
            self.planner.fallback("prefill_failed")
            return None
        assert isinstance(answer, dict)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            self.planner.fallback("no_kv_params")
            return None
        # The lease runs from about now (its remote_blocks_expiry_time, if any, is on the
        # engine's own clock): each decode sent to pull the KV checks it (lease_ran_out).
        exchange.prefill_done_at = time.monotonic()
        exchange.prefilled_on = endpoint
        self.planner.policy.health.note_pd_prompt(prompt_tokens)
        return endpoint, params

    def kv_start_by(self, exchange: Exchange) -> float | None:
        """The latest moment (monotonic) a decode pulling prefill's KV may be sent
        (GatewaySettings.kv_start_within of prefill's answer)."""
        if exchange.prefill_done_at is None:
            return None
        lease = self.planner.config.kv_transfer.prefill_lease_seconds
        return exchange.prefill_done_at + self.settings.kv_start_within(lease)

    async def lease_ran_out(self, exchange: Exchange, prefill_endpoint: Endpoint | None) -> bool:
        """Whether a decode sent now would find prefill's KV gone. Then the request prefills
        locally on decode: the fallback is counted and prefill lets its blocks go at once."""
        start_by = self.kv_start_by(exchange)
        if start_by is None or time.monotonic() < start_by:
            return False
        self.planner.fallback("lease_expiring")
        await self.upstream.abort(prefill_endpoint, exchange)
        return True

    async def call_prefill(
        self,
        exchange: Exchange,
        path: str,
        body: dict[str, Any],
        pool: list[Endpoint],
        affinity: Mapping[str, int],
        request_class: str,
        prompt_tokens: int,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        """POST to a prefill replica. A long prompt holds a slot on the best replica with room
        (affinity and load rank them); if that replica fails, the slot goes back and the next
        one with room is tried. UpstreamFailed when none could."""
        # Short prompts need no slot: post_json itself moves on to the next replica.
        # Slots are per replica: a pod's data-parallel ranks share its slots.
        ranked = (
            list(dict.fromkeys(e.url for e in Endpoints.rank(pool, affinity)))
            if request_class == LONG else []
        )  # fmt: skip
        while True:
            granted: str | None = None
            try:
                async with self.peers.slot(request_class, ranked) as granted:
                    begun = time.monotonic()
                    answer = await self.upstream.post_json(
                        "prefill",
                        pool if granted is None else [e for e in pool if e.url == granted],
                        path,
                        body,
                        exchange.headers,
                        self.settings.first_byte_timeout,
                        affinity=affinity,
                        prefill_tokens=prompt_tokens,
                        deadline=self.upstream.deadline(exchange.started),
                    )
                    elapsed = time.monotonic() - begun
                    self.planner.policy.health.observe_prefill(elapsed, prompt_tokens)
                    return answer
            except UpstreamFailed:
                ranked = [url for url in ranked if url != granted]
                if granted is None or not ranked:
                    raise  # no other replica to try: the caller prefills on decode

    async def decode_once(
        self,
        exchange: Exchange,
        path: str,
        body: dict[str, Any],
        local_body: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """`_decode_once`, and when the client goes away meanwhile, the decode replica working
        on it stops: cancelling the call closes its connection, which vLLM's API server takes
        as an abort, and a tokens engine (or a proxy in front of it, which may keep the work
        going on) is also told so (UpstreamClient.abort)."""
        tried: list[Endpoint] = []  # the replicas called, in order (then the retry's)
        retried: list[Endpoint] = []
        try:
            return await self._decode_once(
                exchange, path, body, local_body, prefill_endpoint, token_ids, tried, retried
            )
        except asyncio.CancelledError:
            if called := retried or tried:
                await asyncio.shield(self.upstream.abort(called[-1], exchange))
            raise

    async def _decode_once(
        self,
        exchange: Exchange,
        path: str,
        body: dict[str, Any],
        local_body: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
        token_ids: list[int] | None,
        tried: list[Endpoint],
        retried: list[Endpoint],
    ) -> dict[str, Any]:
        """One non-streamed decode call (local_body: the same request without
        kv_transfer_params, when body carries prefill's). If decode cannot load prefill's KV,
        retry once with local prefill, on another decode replica when there is one (that
        engine answered, so it may serve the retry when it is the only one); if the decode
        replicas given prefill's KV fail or hang, retry locally on one that has not. A decode
        failure is no KV-load fallback. Past prefill's lease no replica is sent its KV: the
        request prefills locally. None left: 502; past the deadline: 504."""
        # Decode prefills itself unless KV arrives: then its own prefix cache matters.
        local = local_body is None
        deadline = self.upstream.deadline(exchange.started)
        try:
            endpoint, answer = await self.upstream.post_json(
                "decode",
                self.decode_candidates(exchange, with_kv=not local),
                path,
                body,
                exchange.headers,
                self.settings.request_timeout,
                affinity=self.placement.affinity(exchange, "decode", token_ids if local else None),
                deadline=deadline,
                tried=tried,
                start_by=None if local else self.kv_start_by(exchange),
            )
            self.placement.remember(exchange, "decode", endpoint, token_ids if local else None)
            exchange.decoded_on = endpoint
            exchange.decode_pulled_kv = not local
        except UpstreamFailed as error:
            pool = self.decode_candidates(exchange, with_kv=False)
            untried = [e for e in pool if all(e is not t for t in tried)]
            kv_failed = "KV transfer" in str(error)  # post_json stops at the first one
            if kv_failed and not untried:
                untried = [tried[-1]]  # the engine that answered it could not pull the KV
            if local_body is None or not untried:
                raise GatewayError(502, str(error), kind="UpstreamError") from None
            if isinstance(error, LeaseExpiring):
                self.planner.fallback("lease_expiring")
            elif kv_failed:
                self.planner.fallback("kv_load_failed")
            else:
                self.upstream.metrics.retries.labels("decode", "upstream_error").inc()
            await self.upstream.abort(prefill_endpoint, exchange)
            try:
                endpoint, answer = await self.upstream.post_json(
                    "decode",
                    untried,
                    path,
                    local_body,
                    exchange.headers,
                    self.settings.request_timeout,
                    deadline=deadline,
                    tried=retried,
                )
            except UpstreamFailed as again:
                raise GatewayError(502, str(again), kind="UpstreamError") from None
            exchange.served_by["decode"] = endpoint.target
            exchange.decoded_on = endpoint
            exchange.decode_pulled_kv = False
        if not (isinstance(answer, dict) and has_choices(answer)):
            # Nothing to derender or pass on: a broken engine (or what stands in front of it).
            raise GatewayError(502, "decode answered without choices", kind="UpstreamError")
        return answer


def has_choices(answer: Mapping[str, Any]) -> bool:
    """An upstream answer carries what a client's answer is made of: a list of choices."""
    choices = answer.get("choices")
    return isinstance(choices, list) and bool(choices) and all(isinstance(c, dict) for c in choices)
