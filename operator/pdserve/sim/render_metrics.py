"""What the simulated render server exposes on /metrics: a real `vllm launch render`'s HTTP
metrics and process CPU, and the simulator's own render/derender counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# prometheus-fastapi-instrumentator's default buckets, as vLLM's API servers expose them.
HTTP_BUCKETS = (0.1, 0.5, 1.0)


class RenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # What a real `vllm launch render` exposes: HTTP metrics per handler (its parse load is
        # the busy time of the render/derender handlers) and the process's CPU.
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ["method", "handler"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "pdserve_sim_render_requests",
            "Requests by endpoint and status",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.inflight_derender = Gauge(
            "pdserve_sim_render_inflight_derender",
            "Derender calls in flight",
            registry=self.registry,
        )
        self.parse_cpu = Counter(
            "pdserve_sim_render_parse_cpu_seconds",
            "CPU seconds spent decoding and parsing output",
            registry=self.registry,
        )
        self.derender_calls = Counter(
            "pdserve_sim_render_derender_calls",
            "Derender calls",
            ["stream"],
            registry=self.registry,
        )
        self.streams = Counter(
            "pdserve_sim_render_derender_streams",
            "Streams started (first chunk derendered)",
            registry=self.registry,
        )
