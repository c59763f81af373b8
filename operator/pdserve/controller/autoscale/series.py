"""Which samples of one scrape feed which autoscaling signal, per kind of pod. Each selector
maps a sample (name, labels) to a signal key or None; pdserve.vllm.metrics sums the samples
(`sum_samples`) and turns counters into windows (`window`)."""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.contract.metrics import GATEWAY_RENDER_CALL_SECONDS_SUM, RENDER_POD_LABEL
from pdserve.vllm import metrics

RENDER_PATHS = (
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
)


def render_series(name: str, labels: Mapping[str, str]) -> str | None:
    """A render server: its render/derender handler time and its CPU."""
    if name == "http_request_duration_seconds_sum" and labels.get("handler") in RENDER_PATHS:
        return "busy"
    if name == "process_cpu_seconds_total":
        return "cpu"
    return None


GATEWAY_BUSY_PREFIX = "busy:"


def gateway_series(name: str, labels: Mapping[str, str]) -> str | None:
    """A gateway: its call time per render replica (`busy:<pod>`)."""
    if name == GATEWAY_RENDER_CALL_SECONDS_SUM:
        return f"{GATEWAY_BUSY_PREFIX}{labels.get(RENDER_POD_LABEL, '')}"
    return None


ENGINE_SERIES = {
    **dict.fromkeys(metrics.counter_samples(metrics.PROMPT_TOKENS), "prompt_tokens"),
    metrics.total(metrics.REQUEST_PREFILL_TIME): "prefill_seconds",
    metrics.total(metrics.REQUEST_PROMPT_TOKENS): "prompt_lengths",
    metrics.count(metrics.REQUEST_PROMPT_TOKENS): "prompts",
    metrics.NUM_REQUESTS_WAITING: "waiting",
    metrics.KV_CACHE_USAGE: "kv_usage",
    metrics.total(metrics.INTER_TOKEN_LATENCY): "itl_seconds",
    metrics.count(metrics.INTER_TOKEN_LATENCY): "itl_count",
    metrics.total(metrics.TIME_TO_FIRST_TOKEN): "ttft_seconds",
    metrics.count(metrics.TIME_TO_FIRST_TOKEN): "ttft_count",
}
# Counted as well as summed (vllm.metrics.sum_samples): each data-parallel rank of an engine
# reports its own, so a pod's count is the ranks it runs.
ENGINE_COUNTED = frozenset({"kv_usage", "prefill_seconds"})
# Read as they are, not as windows.
GAUGES = frozenset({"waiting", "kv_usage", *map(metrics.samples_of, ENGINE_COUNTED)})


def engine_series(name: str, labels: Mapping[str, str]) -> str | None:
    """A vLLM engine (prefill or decode): tokens, timings, queue and KV cache."""
    return ENGINE_SERIES.get(name)
