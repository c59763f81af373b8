"""The vLLM metrics pdserve reads (each name written once: the simulators expose them, the
operator and the gateway read them) and one way to read an exposition: samples summed over
label sets, counters turned into windows where a counter that went down means the engine
restarted and counts from zero."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass

from prometheus_client.parser import text_string_to_metric_families

# Gauges.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
# Counters (exposed with a _total suffix by prometheus_client, without one by some versions).
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
REQUEST_SUCCESS = "vllm:request_success"
NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
NIXL_FAILED_NOTIFICATIONS = "vllm:nixl_num_failed_notifications"
NIXL_KV_EXPIRED_REQUESTS = "vllm:nixl_num_kv_expired_reqs"
# Histograms (read through their _count and _sum).
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"
NIXL_POST_TIME = "vllm:nixl_post_time_seconds"
NIXL_BYTES_TRANSFERRED = "vllm:nixl_bytes_transferred"


def counter_samples(name: str) -> tuple[str, str]:
    """The sample names a counter can appear under."""
    return (f"{name}_total", name)


def count(histogram: str) -> str:
    return f"{histogram}_count"


def total(histogram: str) -> str:
    return f"{histogram}_sum"


Totals = dict[str, float]
Selector = Callable[[str, Mapping[str, str]], str | None]


def samples_of(key: str) -> str:
    """The key under which `sum_samples` counts the samples it summed into `key`."""
    return f"{key}:samples"


def sum_samples(text: str, select: Selector, counted: frozenset[str] = frozenset()) -> Totals:
    """Sum every sample `select(name, labels)` maps to a key (label sets: data-parallel ranks,
    finish reasons). For the keys in `counted`, also how many samples were summed, under
    `samples_of(key)` (an engine's data-parallel ranks each report their own KV-cache use)."""
    totals: Totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = select(sample.name, sample.labels)
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
                if key in counted:
                    samples = samples_of(key)
                    totals[samples] = totals.get(samples, 0.0) + 1
    return totals


def counter_delta(now: float, then: float) -> float:
    """A counter's increase since `then`; one that went down (the engine restarted) counts from
    zero."""
    return now - then if now >= then else now


def window(now: Totals, before: Totals, gauges: frozenset[str] = frozenset()) -> Totals:
    """Counter deltas since `before`; `gauges` as they are now."""
    return {
        key: value if key in gauges else counter_delta(value, before.get(key, 0.0))
        for key, value in now.items()
    }


@dataclass(frozen=True)
class TransferCounters:
    """Cumulative NIXL counters of one or more decode engines."""

    transfers: float = 0.0
    seconds: float = 0.0
    failed: float = 0.0
    expired: float = 0.0
    queued: float = 0.0  # requests that left decode's queue (REQUEST_QUEUE_TIME)
    queue_seconds: float = 0.0

    def __add__(self, other: TransferCounters) -> TransferCounters:
        pairs = zip(astuple(self), astuple(other), strict=True)
        return TransferCounters(*(a + b for a, b in pairs))

    def since(self, before: TransferCounters | None) -> TransferCounters:
        """What happened since `before` (counter_delta per field)."""
        if before is None:
            return self
        pairs = zip(astuple(self), astuple(before), strict=True)
        return TransferCounters(*(counter_delta(a, b) for a, b in pairs))


TRANSFER_SAMPLES = {
    count(NIXL_XFER_TIME): "transfers",
    total(NIXL_XFER_TIME): "seconds",
    **dict.fromkeys(counter_samples(NIXL_FAILED_TRANSFERS), "failed"),
    **dict.fromkeys(counter_samples(NIXL_KV_EXPIRED_REQUESTS), "expired"),
    count(REQUEST_QUEUE_TIME): "queued",
    total(REQUEST_QUEUE_TIME): "queue_seconds",
}


def parse_transfer_counters(text: str) -> TransferCounters:
    """A decode engine's KV transfer counters from its exposition."""
    return sum(parse_engine_transfer_counters(text).values(), TransferCounters())


def parse_engine_transfer_counters(text: str) -> dict[str, TransferCounters]:
    """A decode server's KV transfer counters per engine it manages, by the `engine` label
    (vLLM's global data-parallel rank; "" for samples without one): each rank's NIXL agent
    pulls on its own, so a broken path of one rank shows only in its own counters."""
    fields: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = TRANSFER_SAMPLES.get(sample.name)
            if field is not None:
                engine = fields.setdefault(sample.labels.get("engine", ""), {})
                engine[field] = engine.get(field, 0.0) + sample.value
    return {engine: TransferCounters(**values) for engine, values in fields.items()}
