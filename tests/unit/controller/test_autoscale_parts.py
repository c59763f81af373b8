"""The seams of the Builtin autoscaler on their own: which samples feed which signal, which pods
are scraped, which behaviour governs slices and how many engines a sliced plan runs."""

from __future__ import annotations

from typing import Any

from pdserve.builders.scaling import ReplicaPlan
from pdserve.controller.autoscale.behaviour import Behaviour, behaviour_of
from pdserve.controller.autoscale.plans import engine_current
from pdserve.controller.autoscale.series import (
    GAUGES,
    engine_series,
    gateway_series,
    render_series,
)
from pdserve.controller.autoscale.targets import Targets, pod_metrics_url, targets_of
from pdserve.vllm.metrics import sum_samples, window
from tests.support.specs import autoscaled_model as model

SLICED = model(
    prefill={"replicas": 1, "autoscaling": {
        "minReplicas": 1, "maxReplicas": 4, "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300, "scaleUpStep": 3, "scaleDownStep": 2,
        "cooldownSeconds": 10,
    }},
    decode={"replicas": 2, "autoscaling": {
        "minReplicas": 2, "maxReplicas": 8, "scaleUpStabilizationSeconds": 60,
        "scaleDownStabilizationSeconds": 120, "scaleUpStep": 2, "scaleDownStep": 1,
        "cooldownSeconds": 40,
    }},
    placement={"slices": 4, "domain": {}},
)  # fmt: skip


def test_render_busy_is_render_and_derender_handler_time_only() -> None:
    text = (
        'http_request_duration_seconds_sum{handler="/v1/chat/completions/derender"} 3\n'
        'http_request_duration_seconds_sum{handler="/v1/completions/render"} 2\n'
        'http_request_duration_seconds_sum{handler="/health"} 99\n'
        "process_cpu_seconds_total 7\n"
    )
    assert sum_samples(text, render_series) == {"busy": 5.0, "cpu": 7.0}


def test_gateway_busy_is_kept_per_render_pod() -> None:
    text = (
        'pdserve_gateway_render_call_seconds_sum{render_pod="a",stage="derender"} 4\n'
        'pdserve_gateway_render_call_seconds_sum{render_pod="a",stage="render"} 1\n'
        'pdserve_gateway_render_call_seconds_sum{render_pod="b",stage="render"} 2\n'
    )
    assert sum_samples(text, gateway_series) == {"busy:a": 5.0, "busy:b": 2.0}


def test_engine_gauges_are_read_as_they_are_and_counters_as_windows() -> None:
    before = sum_samples(
        "vllm:prompt_tokens_total 100\nvllm:num_requests_waiting 9\nvllm:kv_cache_usage_perc 0.9\n",
        engine_series,
    )
    now = sum_samples(
        "vllm:prompt_tokens 160\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.4\n"
        "vllm:unrelated_total 5\n",
        engine_series,
    )
    assert window(now, before, GAUGES) == {"prompt_tokens": 60.0, "waiting": 2.0, "kv_usage": 0.4}


def pod(name: str, component: str, ip: str | None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip} if ip else {}}


def test_targets_leave_out_pods_being_deleted_unaddressed_or_of_other_pools() -> None:
    pods = [
        pod("qwen-render-a", "render", "10.0.0.1"),
        pod("qwen-render-b", "render", "10.0.0.2", deleting=True),
        pod("qwen-decode-0", "decode", None),
        pod("qwen-prefill-0", "prefill", "10.0.0.3"),
        pod("qwen-preflight-0", "preflight", "10.0.0.4"),
    ]
    assert targets_of(pods, pod_metrics_url) == Targets(
        render={"qwen-render-a": "http://10.0.0.1:8000/metrics"},
        prefill={"qwen-prefill-0": "http://10.0.0.3:8000/metrics"},
    )


def test_slices_follow_the_stricter_behaviour_of_both_pools_within_the_slice_bounds() -> None:
    assert behaviour_of(SLICED, "slices") == Behaviour(
        min_replicas=1, max_replicas=4, up_window=60, down_window=300, up_step=2, down_step=1,
        cooldown=40,
    )  # fmt: skip
    assert behaviour_of(SLICED, "prefill").up_window == 30


def test_a_sliced_plan_runs_per_slice_replicas_times_its_slices() -> None:
    assert engine_current(SLICED, ReplicaPlan(slices=3)) == {"prefill": 3, "decode": 6}
    assert engine_current(SLICED, ReplicaPlan(prefill=2, decode=5)) == {"prefill": 2, "decode": 5}
