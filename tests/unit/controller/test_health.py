"""Transport health rules: a window of NIXL counters judged against the TTFT-derived budget."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.controller.health import HealthVerdict, judge_health, kv_policy
from pdserve.vllm.metrics import TransferCounters, parse_transfer_counters

METRICS = """\
# HELP vllm:nixl_xfer_time_seconds KV transfer time
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 1.2
# HELP vllm:nixl_num_failed_transfers Failed transfers
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 1.0
# HELP vllm:nixl_num_kv_expired_reqs Expired leases
# TYPE vllm:nixl_num_kv_expired_reqs counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 0.0
"""


def test_counters_come_from_the_engines_metrics_and_survive_restarts() -> None:
    counters = parse_transfer_counters(METRICS)
    assert counters == TransferCounters(transfers=4, seconds=1.2, failed=1, expired=0)
    later = TransferCounters(transfers=10, seconds=2.0, failed=1, expired=0)
    assert later.since(counters) == TransferCounters(6, pytest.approx(0.8), 0, 0)  # type: ignore[arg-type]
    restarted = TransferCounters(transfers=2, seconds=0.1)
    assert restarted.since(later) == restarted


@pytest.mark.parametrize(
    ("window", "budget", "verdict"),
    [
        (TransferCounters(), 1.0, None),
        (TransferCounters(transfers=4, seconds=0.4), 1.0,
         HealthVerdict(True, "Healthy", "4 transfers, average 100 ms (budget 1000 ms: half the TTFT SLO)")),
        (TransferCounters(transfers=4, seconds=6.0), 1.0,
         HealthVerdict(False, "SlowTransfers", "4 transfers, average 1500 ms (budget 1000 ms: half the TTFT SLO)")),
        (TransferCounters(transfers=4, seconds=6.0), None,
         HealthVerdict(True, "Healthy", "4 transfers, average 1500 ms")),
        (TransferCounters(transfers=3, seconds=0.3, failed=2), None,
         HealthVerdict(False, "TransferFailures", "2 failed KV transfers; 3 transfers, average 100 ms")),
    ],
)  # fmt: skip
def test_window_verdicts(
    window: TransferCounters, budget: float | None, verdict: HealthVerdict | None
) -> None:
    assert judge_health(window, budget) == verdict


def test_expired_leases_name_the_fix() -> None:
    verdict = judge_health(TransferCounters(transfers=1, seconds=0.1, expired=3), 1.0)
    assert verdict is not None
    assert (verdict.healthy, verdict.reason) == (False, "LeasesExpiring")
    assert "raise kvTransfer.leaseDurationSeconds" in verdict.message


def lease_model(**kv: Any) -> DisaggregatedModel:
    spec: dict[str, Any] = {"model": {"name": "org/m"}, "prefill": {}, "kvTransfer": kv}
    if "ttft" in kv:
        spec["gateway"] = {"slo": {"ttftMs": kv.pop("ttft")}}
    return parse_resource({"metadata": {"name": "m", "namespace": "ns"}, "spec": spec})


def test_kv_lease_is_checked_against_the_slo_and_the_measured_handoff() -> None:
    assert kv_policy(lease_model(), None) == (
        True, "Consistent", "kvTransfer.leaseDurationSeconds 30 s (vLLM default)",
    )  # fmt: skip
    short = kv_policy(lease_model(leaseDurationSeconds=1, ttft=2000), None)
    assert short[:2] == (False, "LeaseTooShort")
    assert "kvTransfer.leaseDurationSeconds 1 s is shorter than the TTFT SLO (2 s)" in short[2]
    busy = HealthVerdict(True, "Healthy", "", transfer_seconds=1.3, queue_seconds=10.0)
    measured = kv_policy(lease_model(leaseDurationSeconds=20), busy)
    assert measured == (
        False, "LeaseTooShort",
        "kvTransfer.leaseDurationSeconds 20 s is less than 2x the measured decode queueing "
        "10.00 s + transfer 1.30 s; raise kvTransfer.leaseDurationSeconds or add decode capacity",
    )  # fmt: skip
    assert kv_policy(lease_model(leaseDurationSeconds=60), busy)[:2] == (True, "Consistent")
    aggregated = parse_resource({"metadata": {"name": "m"}, "spec": {"model": {"name": "o/m"}}})
    assert kv_policy(aggregated, busy)[:2] == (None, "NoLease")
