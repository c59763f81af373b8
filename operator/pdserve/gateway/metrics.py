"""Gateway Prometheus metrics (its own registry, served on /metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.contract.metrics import (
    GATEWAY_PD_DEGRADED,
    GATEWAY_PD_RECENT_FAILURES,
    GATEWAY_RENDER_CALL_SECONDS,
    RENDER_POD_LABEL,
)
from pdserve.gateway.dataplane_metrics import ROUTES, DataPlaneCounts, WithDataPlane

LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BY_ROUTE = ("route",)
BY_RENDER_CALL = (RENDER_POD_LABEL, "stage")
BY_STAGE = ("stage",)
DATA_PLANE_RUNTIME = {
    "allocated_bytes": "Bytes the data plane allocated",
    "allocated_objects": "Objects the data plane allocated",
    "gc_cycles": "Garbage collections the data plane ran",
    "gc_cpu_seconds": "CPU seconds the data plane's garbage collector used",
}
"""The data plane's /stats `runtime` keys (dataplane/runtimestats.go) -> each counter's help."""


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_gateway_requests",
            "Requests by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        # `pdserve gateway --data-plane`: what the compiled data plane served itself, and what it
        # handed to this gateway (these are then counted in pdserve_gateway_requests too).
        self.dataplane_requests = Counter(
            "pdserve_gateway_dataplane_requests",
            "Requests the data plane served itself, by route (pd, decode)",
            ["route"],
            registry=r,
        )
        self.dataplane_fallbacks = Counter(
            "pdserve_gateway_dataplane_fallbacks",
            "Requests the data plane handed to the Python gateway, by reason",
            ["reason"],
            registry=r,
        )
        # The data plane's Go runtime (its /stats `runtime`, by the key it gives each): what a
        # tail latency owes to its garbage collector.
        self.dataplane_runtime = {
            key: Counter(f"pdserve_gateway_dataplane_{key}", help, registry=r)
            for key, help in DATA_PLANE_RUNTIME.items()
        }
        self.inflight = Gauge("pdserve_gateway_inflight_requests", "Requests in flight", registry=r)
        # These and render_call are collected with what the data plane measured added (with
        # `--data-plane`; dataplane_metrics.py), so they count every request.
        self.ttft = Histogram(
            "pdserve_gateway_ttft_seconds",
            "Time to first token seen by clients",
            BY_ROUTE,
            buckets=LATENCY,
            registry=None,
        )
        self.itl = Histogram(
            "pdserve_gateway_itl_seconds",
            "Gap between chunks sent to clients",
            BY_ROUTE,
            buckets=LATENCY,
            registry=None,
        )
        self.e2e = Histogram(
            "pdserve_gateway_e2e_seconds", "Request latency", BY_ROUTE, buckets=LATENCY,
            registry=None,
        )  # fmt: skip
        self.stage = Histogram(
            "pdserve_gateway_stage_seconds",
            "Latency per stage (render, prefill, kv_handoff, decode_first_token, derender)",
            BY_STAGE,
            buckets=LATENCY,
            registry=None,
        )
        # Per render replica (pod name): what the gateway sees of parser load, queueing in the
        # render server included. The operator's Builtin render autoscaler and the Prometheus
        # Adapter rule (pdserve_render_gateway_busy) read the seconds' rate as busy time.
        self.render_inflight = Gauge(
            "pdserve_gateway_render_inflight",
            "Render and derender calls in flight per render replica",
            [RENDER_POD_LABEL],
            registry=r,
        )
        self.render_call = Histogram(
            GATEWAY_RENDER_CALL_SECONDS,
            "Render and derender call latency per render replica",
            BY_RENDER_CALL,
            buckets=LATENCY,
            registry=None,
        )
        self.derender_calls = Histogram(
            "pdserve_gateway_derender_calls_per_stream",
            "Derender calls per streamed choice",
            buckets=COUNTS,
            registry=None,
        )
        self.tokens_per_derender = Histogram(
            "pdserve_gateway_tokens_per_derender_call",
            "Tokens merged into one derender call",
            buckets=COUNTS,
            registry=None,
        )
        self.with_data_plane = {
            name: WithDataPlane(histogram, labels, bounds, r)
            for name, histogram, labels, bounds in (
                ("e2e", self.e2e, BY_ROUTE, LATENCY), ("ttft", self.ttft, BY_ROUTE, LATENCY),
                ("itl", self.itl, BY_ROUTE, LATENCY),
                ("renderCalls", self.render_call, BY_RENDER_CALL, LATENCY),
                ("stages", self.stage, BY_STAGE, LATENCY),
                ("derenderCalls", self.derender_calls, (), COUNTS),
                ("derenderTokens", self.tokens_per_derender, (), COUNTS),
            )
        }  # fmt: skip
        self._data_plane_requests = DataPlaneCounts(self.requests)
        self._data_plane_render_inflight: dict[str, float] = {}  # by URL, as last reported
        self._data_plane_inflight = 0.0  # as last reported
        self.retries = Counter(
            "pdserve_gateway_retries", "Retries on another replica", ["stage", "reason"], registry=r
        )
        self.fallbacks = Counter(
            "pdserve_gateway_fallbacks",
            "Requests served by local prefill on decode instead of P/D",
            ["reason"],
            registry=r,
        )
        self.auto_decisions = Counter(
            "pdserve_gateway_auto_decisions",
            "Routing mode Auto: requests by decision reason (P/D: long_prompt, "
            "local_would_break_itl, probe; local: short_prompt, decode_idle, handoff_unknown, "
            "handoff_over_ttft_budget, kv_path_over_ttft_budget, prefill_queue_over_ttft_budget, "
            "degraded, no_prefill)",
            ["reason"],
            registry=r,
        )
        self.pd_degraded = Gauge(
            GATEWAY_PD_DEGRADED,
            "1 while Auto mode routes everything local because the P/D path is failing",
            registry=r,
        )
        self.pd_recent_failures = Gauge(
            GATEWAY_PD_RECENT_FAILURES,
            "Recent P/D handoff failures (failed or expired transfers, handoffs over the TTFT "
            "budget) Auto mode counts towards degrading",
            registry=r,
        )
        self.prefill_queue = Gauge(
            "pdserve_gateway_prefill_queue_long",
            "Long prompts waiting for a prefill slot (short ones never wait)",
            registry=r,
        )
        self.prefill_oldest_wait = Gauge(
            "pdserve_gateway_prefill_oldest_wait_seconds",
            "How long the oldest waiting long prompt has waited",
            registry=r,
        )
        self.prefill_aged = Gauge(
            "pdserve_gateway_prefill_aged_admissions",
            "Long prompts admitted by aging (waited max_wait_seconds)",
            registry=r,
        )
        self.replica_checks = Gauge(
            "pdserve_gateway_replica_check",
            "1 for each render and engine replica's replica-check verdict (Pending, Verified, "
            "Mismatch: kept out of routing, Unchecked: routed unchecked)",
            ["pool", "replica", "verdict"],
            registry=r,
        )
        self.admission_leader_errors = Gauge(
            "pdserve_gateway_admission_leader_errors",
            "Long prompts admitted by this replica because the admission leader could not be "
            "asked (the cluster-wide limit may then overshoot)",
            registry=r,
        )
        self.bidirectional = Counter(
            "pdserve_gateway_bidirectional_reuse",
            "Conversation turns whose prefill could reuse decode's KV of the last turn, by outcome "
            "(reused, prefix_mismatch, expired, decode_gone, incompatible)",
            ["outcome"],
            registry=r,
        )
        self.bidirectional_tokens = Counter(
            "pdserve_gateway_bidirectional_reused_tokens",
            "Prompt tokens whose KV the gateway pointed prefill to on decode (bidirectional)",
            registry=r,
        )
        self.decode_held_blocks = Gauge(
            "pdserve_gateway_decode_held_kv_blocks",
            "Bidirectional KV: blocks each decode replica holds for finished P/D requests of this "
            "gateway (its own reckoning, gateway/held_kv.py), against the budget past which "
            "requests prefill locally (fallbacks reason decode_kv_held)",
            ["replica"],
            registry=r,
        )
        self.aborts = Counter(
            "pdserve_gateway_upstream_aborts",
            "Aborts posted to tokens engines after a client went away or a stream broke",
            registry=r,
        )

    def fold_data_plane(self, measured: Mapping[str, Any], render_pods: Mapping[str, str]) -> None:
        """What the data plane measured (its /stats `metrics`), into these series: its routes
        named as this gateway names them, its render servers by pod (`render_pods`: URL -> pod)."""
        named = {"renderCalls": render_pods, "stages": {}}  # the others by route
        for name, series in self.with_data_plane.items():
            series.fold(measured.get(name) or [], named.get(name, ROUTES))
        self._data_plane_requests.fold(measured.get("requests") or [])

    def fold_inflight(self, reported: float) -> None:
        """The data plane's requests in flight now, added to this gateway's own in `inflight`:
        the gauge counts every request the pod holds, whichever process serves it (a request
        the data plane handed over is counted there alone: app.py counts it once)."""
        self.inflight.inc(reported - self._data_plane_inflight)
        self._data_plane_inflight = reported

    def fold_render_inflight(
        self, reported: Mapping[str, Any], render_pods: Mapping[str, str]
    ) -> None:
        """The data plane's render calls in flight now (by render URL; none listed: 0), added
        to this gateway's own in `render_inflight`: the gauge counts every call, whoever made
        it, and each render pod's series exists from the first poll on."""
        for url, pod in render_pods.items():
            now, before = (
                float(reported.get(url, 0)),
                self._data_plane_render_inflight.get(url, 0.0),
            )
            gauge = self.render_inflight.labels(pod)
            if now != before:
                gauge.inc(now - before)
                self._data_plane_render_inflight[url] = now
