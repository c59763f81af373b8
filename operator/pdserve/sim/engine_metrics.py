"""The simulated engine's Prometheus registry: vLLM's metric names (pdserve.vllm.metrics) with
its labels and buckets, and what each token, finished request, KV transfer and scrape records in
it. One registry per server, each family created once; every data-parallel rank records under
its own `engine="<global rank>"` label, as vLLM's API server does for the ranks it manages
(`engine_idxs=engine_ranks_managed`, vllm/v1/engine/async_llm.py L199)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.sim.engine_core import EngineCore, Sequence
from pdserve.vllm import metrics

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


# vLLM's 1-2-5 buckets up to a long context.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


SimSeconds = Callable[[float], float]
"""Real elapsed seconds -> the simulated seconds a real engine would report."""


class EngineMetrics:
    """The server's registry and its metric families (no label values: see `rank`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge(metrics.NUM_REQUESTS_RUNNING, "Requests in the running batch")
        self.waiting = gauge(metrics.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled")
        self.kv_usage = gauge(metrics.KV_CACHE_USAGE, "KV cache usage, 0-1")
        self.prefix_queries = counter(metrics.PREFIX_CACHE_QUERIES, "Prompt tokens looked up")
        self.prefix_hits = counter(metrics.PREFIX_CACHE_HITS, "Prompt tokens found cached")
        self.preemptions = counter(metrics.NUM_PREEMPTIONS, "Preemptions")
        self.prompt_tokens = counter(metrics.PROMPT_TOKENS, "Prompt tokens processed")
        self.request_prompt_tokens = histogram(
            metrics.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed", TOKEN_BUCKETS
        )
        self.generation_tokens = counter(metrics.GENERATION_TOKENS, "Tokens generated")
        self.success = Counter(
            metrics.REQUEST_SUCCESS, "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.ttft = histogram(metrics.TIME_TO_FIRST_TOKEN, "Time to first token")
        self.itl = histogram(metrics.INTER_TOKEN_LATENCY, "Inter-token latency")
        self.tpot = histogram(metrics.TIME_PER_OUTPUT_TOKEN, "Time per output token")
        self.e2e = histogram(metrics.E2E_REQUEST_LATENCY, "End-to-end latency")
        self.queue = histogram(metrics.REQUEST_QUEUE_TIME, "Time waiting in queue")
        self.prefill = histogram(metrics.REQUEST_PREFILL_TIME, "Prefill time")
        self.decode = histogram(metrics.REQUEST_DECODE_TIME, "Decode time")
        self.xfer_time = histogram(metrics.NIXL_XFER_TIME, "KV transfer time")
        self.post_time = histogram(metrics.NIXL_POST_TIME, "KV transfer post time")
        self.xfer_bytes = histogram(
            metrics.NIXL_BYTES_TRANSFERRED,
            "KV bytes per transfer",
            tuple(float(2**i) for i in range(10, 36, 2)),
        )
        self.failed_transfers = counter(metrics.NIXL_FAILED_TRANSFERS, "Failed KV transfers")
        self.failed_notifications = counter(
            metrics.NIXL_FAILED_NOTIFICATIONS, "Failed transfer notifications"
        )
        self.expired = counter(metrics.NIXL_KV_EXPIRED_REQUESTS, "Requests whose KV lease expired")
        self.reused = counter(
            "pdserve_sim_bidirectional_reused_tokens",
            "Prompt tokens whose KV came back from decode (bidirectional)",
        )

    def rank(self, engine: int, sim_seconds: SimSeconds = float) -> RankMetrics:
        """The recorder of DP rank `engine` (global): its series exist at zero from now on, as
        vLLM exposes every metric from the start, not from its first event (a reader that sums
        a metric must find it on an idle engine too)."""
        recorder = RankMetrics(self, {"model_name": self.model, "engine": str(engine)}, sim_seconds)
        for family in (
            self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
            self.preemptions, self.prompt_tokens, self.request_prompt_tokens,
            self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e, self.queue,
            self.prefill, self.decode, self.xfer_time, self.post_time, self.xfer_bytes,
            self.failed_transfers, self.failed_notifications, self.expired, self.reused,
        ):  # fmt: skip
            family.labels(**recorder.labels)
        return recorder


@dataclass(frozen=True)
class RankMetrics:
    """What one DP rank records, under its own labels."""

    families: EngineMetrics
    labels: dict[str, str]
    sim_seconds: SimSeconds

    # ---- the scheduler -------------------------------------------------------------------------
    def on_token(self, seq: Sequence, now: float) -> None:
        """A token left the engine at `now` (monotonic)."""
        m, labels, sim = self.families, self.labels, self.sim_seconds
        if seq.first_token_at == now and seq.emitted == 1:
            m.ttft.labels(**labels).observe(sim(now - seq.arrival))
            if seq.admitted_at is not None:
                m.prefill.labels(**labels).observe(sim(now - seq.admitted_at))
        elif seq.last_token_at is not None:
            m.itl.labels(**labels).observe(sim(now - seq.last_token_at))
        m.generation_tokens.labels(**labels).inc()

    def on_finish(self, seq: Sequence) -> None:
        m, labels, sim = self.families, self.labels, self.sim_seconds
        now = seq.last_token_at or time.monotonic()
        m.e2e.labels(**labels).observe(sim(now - seq.arrival))
        if seq.admitted_at is not None:
            m.queue.labels(**labels).observe(sim(seq.admitted_at - seq.arrival))
        if seq.first_token_at is not None:
            m.decode.labels(**labels).observe(sim(now - seq.first_token_at))
            if seq.emitted > 1:
                m.tpot.labels(**labels).observe(sim(now - seq.first_token_at) / (seq.emitted - 1))
        m.prompt_tokens.labels(**labels).inc(len(seq.prompt_ids) - seq.cached_tokens)
        m.request_prompt_tokens.labels(**labels).observe(len(seq.prompt_ids))
        m.success.labels(**labels, finished_reason=seq.finish_reason).inc()

    def refresh(self, core: EngineCore) -> None:
        """The gauges and the prefix cache counters from the scheduler's state, before a scrape."""
        m, labels = self.families, self.labels
        m.running.labels(**labels).set(len(core.running))
        m.waiting.labels(**labels).set(len(core.waiting))
        m.kv_usage.labels(**labels).set(core.kv_usage())
        query = m.prefix_queries.labels(**labels)
        query.inc(core.prefix_queries - query._value.get())
        hits = m.prefix_hits.labels(**labels)
        hits.inc(core.prefix_hits - hits._value.get())

    # ---- the KV handoff ------------------------------------------------------------------------
    def lease_expired(self) -> None:
        self.families.expired.labels(**self.labels).inc()

    def transfer_failed(self) -> None:
        self.families.failed_transfers.labels(**self.labels).inc()

    def transferred(self, sim_seconds: float, num_bytes: int) -> None:
        """A pull that arrived: its simulated duration and size."""
        self.families.xfer_time.labels(**self.labels).observe(sim_seconds)
        self.families.xfer_bytes.labels(**self.labels).observe(num_bytes)

    def reused(self, tokens: int) -> None:
        """Prompt tokens whose KV came back from decode (bidirectional)."""
        self.families.reused.labels(**self.labels).inc(tokens)
