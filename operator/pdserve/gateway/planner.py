"""Which path a request takes: the pools it needs, P/D or not (the routing mode, verified KV
transports, Auto's decision), and what Auto mode learns from the requests that ran."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.endpoints import Endpoint, Endpoints, NoEndpoints, Selection
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.fairqueue import PrefillAdmission
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.policy import AutoPolicy, Decision, QueueState

PD_FAILURES = frozenset({"prefill_failed", "no_kv_params", "kv_load_failed", "lease_expiring"})
"""The fallbacks to local prefill that Auto mode learns from as P/D failures (`fallback`); the
data plane reports its own by these names."""


@dataclass
class Plan:
    selection: Selection
    pd: bool


class RoutePlanner:
    def __init__(
        self,
        config: GatewayConfig,
        endpoints: Endpoints,
        policy: AutoPolicy,
        admission: PrefillAdmission,
        peers: PeerAdmission,
        metrics: GatewayMetrics,
        *,
        endpoint_wait_seconds: float,
        engine_seconds_scale: float,
        step_window_seconds: float,
    ) -> None:
        self.config, self.endpoints, self.policy = config, endpoints, policy
        self.admission, self.peers, self.metrics = admission, peers, metrics
        self.endpoint_wait_seconds = endpoint_wait_seconds
        self.engine_seconds_scale = engine_seconds_scale
        self.step_window_seconds = step_window_seconds

    # ---- the plan ------------------------------------------------------------------------------
    def needed_pools(self) -> list[str]:
        pools = ["decode"]
        if self.config.engine_api == "tokens":
            pools.insert(0, "render")
        return pools

    async def plan(self) -> Plan:
        """Wait for a usable set of endpoints, then P/D or not; NoEndpoints when the routing
        mode demands P/D and no prefill replica can serve. Mode Disaggregated waits for a
        prefill replica too, as for any pool's: mid-rollout the last old one may be gone
        before the new one is checked (replica check), and holding beats failing."""
        needed, wait = self.needed_pools(), self.endpoint_wait_seconds
        if self.config.routing.mode != "Disaggregated" or not self.config.pools.prefill:
            return self.settle(await self.endpoints.wait_select(needed, ["prefill"],
                                                                wait_seconds=wait))  # fmt: skip
        try:
            selection = await self.endpoints.wait_select([*needed, "prefill"], wait_seconds=wait)
        except NoEndpoints:
            # Waited the whole bound: what is there now decides (no prefill: 503, as before).
            selection = self.endpoints.select(needed, ["prefill"])
        return self.settle(selection)

    def settle(self, selection: Selection) -> Plan:
        """The plan for a selected set: the prefill replicas that may take P/D traffic, and P/D
        or not. With no prefill left for want of a verified transport or a compatible decode,
        the request prefills locally (counted), even in mode Disaggregated."""
        unverified = self.keep_verified_prefill(selection)
        unpaired = self.keep_paired_prefill(selection)
        pd = self.wants_pd(selection)
        if (
            self.config.routing.mode == "Disaggregated"
            and not pd
            and self.config.pools.prefill
            and not unverified
            and not unpaired
        ):
            raise NoEndpoints("routing mode Disaggregated but no healthy prefill endpoint")
        return Plan(selection, pd)

    def keep_verified_prefill(self, selection: Selection) -> bool:
        """kvTransfer.verify Required: only prefill replicas whose slice passed the transport
        preflight take P/D traffic; with none, requests prefill locally on decode. True when
        that left no prefill endpoint."""
        prefill = selection.pools.get("prefill")
        if self.config.kv_transfer.verify != "Required" or not prefill:
            return False
        selection.pools["prefill"] = [e for e in prefill if e.kv_transport == "Verified"]
        if selection.pools["prefill"]:
            return False
        self.metrics.fallbacks.labels("transport_unverified").inc()
        return True

    def keep_paired_prefill(self, selection: Selection) -> bool:
        """Only prefill replicas with a decode replica that can pull their KV (equal
        KV-compatibility digests) take P/D traffic: mid engine upgrade a new prefill with only
        old decodes is left out, so no request's transfer is refused. True when that left no
        prefill endpoint (the request prefills locally on decode)."""
        prefill = selection.pools.get("prefill")
        if not prefill or self.config.routing.mode == "Aggregated":
            return False
        decode = selection.pools.get("decode", [])
        selection.pools["prefill"] = [p for p in prefill if Endpoints.kv_compatible(decode, p)]
        if selection.pools["prefill"]:
            return False
        # Not a P/D failure Auto mode learns from: the pools are mid-rollout, not broken.
        self.metrics.fallbacks.labels("no_compatible_decode").inc()
        return True

    def wants_pd(self, selection: Selection) -> bool:
        mode = self.config.routing.mode
        if mode == "Aggregated" or self.config.pools.prefill is None:
            return False
        return bool(selection.pools.get("prefill"))

    # ---- Auto mode -----------------------------------------------------------------------------
    def ttft_budget(self) -> float | None:
        return self.config.routing.slo.ttft_seconds

    def itl_budget(self) -> float | None:
        return self.config.routing.slo.itl_seconds

    def queue_state(self, selection: Selection) -> QueueState:
        """The least busy replica of each engine pool: queued plus running requests (the
        gateway's own in-flight count when it is ahead of the last scrape), and for prefill the
        long prompts held in the gateway's admission queue, shared among the replicas."""

        def active(endpoint: Endpoint) -> float:
            return endpoint.waiting + max(endpoint.running, endpoint.inflight)

        pools = selection.pools
        prefill = pools.get("prefill", [])
        replicas = {e.url for e in prefill}
        queued = (self.admission.queued + self.peers.queued()) / max(1, len(replicas))
        # Per replica, its calmest data-parallel rank: where a request would go there.
        ahead_by: dict[str, float] = {}
        backlog_by: dict[str, float] = {}
        for e in prefill:
            ahead_by[e.url] = min(ahead_by.get(e.url, float("inf")), active(e) + queued)
            backlog = float(e.prefill_backlog)
            backlog_by[e.url] = min(backlog_by.get(e.url, float("inf")), backlog)
        calmest = min(pools.get("decode", []), key=active, default=None)
        return QueueState(
            decode_active=None if calmest is None else active(calmest),
            decode_step_seconds=None if calmest is None else calmest.steps.seconds,
            prefill_ahead=min(ahead_by.values(), default=None),
            prefill_ahead_by=ahead_by,
            prefill_backlog_by=backlog_by,
        )

    def auto_decision(
        self, prompt_tokens: int | None, prefill_available: bool, selection: Selection
    ) -> Decision:
        """Routing mode Auto: P/D or local prefill for this request (see policy.py); P/D keeps
        only the prefill replicas whose KV path fits the TTFT budget."""
        prefill = selection.pools.get("prefill", [])
        self.policy.health.forget(list({e.url for e in self.endpoints.pools.get("prefill", [])}))
        decision = self.policy.decide(
            prompt_tokens=prompt_tokens,
            prefill_available=prefill_available,
            ttft_budget=self.ttft_budget(),
            queues=self.queue_state(selection),
            prefill_replicas=list(dict.fromkeys(e.url for e in prefill)),
            itl_budget=self.itl_budget(),
        )
        if decision.disaggregated and decision.prefill:
            selection.pools["prefill"] = [e for e in prefill if e.url in decision.prefill]
        self.metrics.auto_decisions.labels(decision.reason).inc()
        return decision

    def decide_auto(self, exchange: Exchange, prompt_tokens: int) -> None:
        """In routing mode Auto (else nothing changes): settle P/D or local for the request."""
        if self.config.routing.mode != "Auto":
            return
        decision = self.auto_decision(prompt_tokens, exchange.pd, exchange.selection)
        exchange.pd = decision.disaggregated
        exchange.local_anywhere = decision.anywhere
        exchange.auto_reason = decision.reason

    # ---- what Auto mode learns -----------------------------------------------------------------
    def fallback(self, reason: str) -> None:
        """P/D could not serve a request: count it, and let Auto mode learn from it (one of
        PD_FAILURES)."""
        self.metrics.fallbacks.labels(reason).inc()
        self.policy.health.failure()
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))

    def note_transfers(self, decode: Endpoint, transfers: float, seconds: float) -> None:
        """KV transfers a decode engine finished since the last scrape: Auto mode learns the
        path from them for the prefill replicas of the engine's slice."""
        per_transfer = seconds / transfers * self.engine_seconds_scale
        prefills = Endpoints.same_slice(self.endpoints.pools["prefill"], decode)
        self.policy.health.observe_transfers(
            per_transfer, self.ttft_budget(), list(dict.fromkeys(e.url for e in prefills))
        )
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))

    def note_step(self, endpoint: Endpoint, gap: float, now: float) -> None:
        """A stream's time between two tokens from this engine."""
        endpoint.steps.observe(gap, now, self.step_window_seconds)

    def note_handoff(self, exchange: Exchange, first_token_at: float, prompt_tokens: int) -> None:
        """Prefill answered -> decode's first streamed token: the KV pull plus one decode step,
        what Auto mode predicts the next handoffs from."""
        if exchange.prefill_done_at is None:
            return
        handoff = first_token_at - exchange.prefill_done_at
        exchange.prefill_done_at = None  # once per request
        self.metrics.stage.labels("kv_handoff").observe(handoff)
        prefill = None if exchange.prefilled_on is None else exchange.prefilled_on.url
        self.policy.health.observe(handoff, prompt_tokens, self.ttft_budget(), prefill)
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))
