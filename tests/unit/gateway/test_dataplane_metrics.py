"""What the data plane served shows in the gateway's own series: its histograms' counts added
to the gateway's (buckets cumulative as Prometheus reads them, its routes and render servers
named as the gateway names them), its request counts added once however often they are read."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.gateway.metrics import GatewayMetrics


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def reported(route: str, counts: list[int], total: float) -> dict[str, object]:
    return {"labels": [route], "counts": counts, "sum": total}


def test_the_data_planes_latencies_are_added_to_the_gateways_own() -> None:
    metrics = GatewayMetrics()
    metrics.e2e.labels("openai_pd").observe(0.003)  # one the Python gateway served itself
    counts = [2, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # two at <= 5 ms, one at <= 1 s
    metrics.fold_data_plane({"e2e": [reported("pd", counts, 0.51)]}, {})
    name = "pdserve_gateway_e2e_seconds"
    assert sample(metrics, f"{name}_bucket", route="openai_pd", le="0.005") == 3
    assert sample(metrics, f"{name}_bucket", route="openai_pd", le="0.5") == 3
    assert sample(metrics, f"{name}_bucket", route="openai_pd", le="1.0") == 4
    assert sample(metrics, f"{name}_bucket", route="openai_pd", le="+Inf") == 4
    assert sample(metrics, f"{name}_count", route="openai_pd") == 4
    assert abs((sample(metrics, f"{name}_sum", route="openai_pd") or 0) - 0.513) < 1e-9
    # Read again (its counts are cumulative): nothing is added twice.
    metrics.fold_data_plane({"e2e": [reported("pd", counts, 0.51)]}, {})
    assert sample(metrics, f"{name}_count", route="openai_pd") == 4
    assert b'pdserve_gateway_e2e_seconds_count{route="openai_pd"} 4.0' in generate_latest(
        metrics.registry
    )


def test_render_calls_are_labelled_by_pod_and_requests_counted_by_delta() -> None:
    metrics = GatewayMetrics()
    one = [1] + [0] * 13
    calls = [{"labels": ["http://10.0.0.7:8000", "derender"], "counts": one, "sum": 0.002}]
    requests = [{"route": "render_decode", "outcome": "ok", "count": 2}]
    pods = {"http://10.0.0.7:8000": "model-render-0"}
    metrics.fold_data_plane({"renderCalls": calls, "requests": requests}, pods)
    metrics.fold_data_plane({"renderCalls": calls, "requests": requests}, pods)
    assert sample(
        metrics, "pdserve_gateway_render_call_seconds_count",
        render_pod="model-render-0", stage="derender",
    ) == 1  # fmt: skip
    assert sample(metrics, "pdserve_gateway_requests_total", route="render", outcome="ok") == 2


def test_a_histogram_of_other_buckets_is_left_out() -> None:
    metrics = GatewayMetrics()
    metrics.fold_data_plane({"ttft": [reported("pd", [1, 2], 0.1)]}, {})
    assert sample(metrics, "pdserve_gateway_ttft_seconds_count", route="openai_pd") is None


def test_render_calls_in_flight_are_the_gateways_own_plus_the_data_planes_now() -> None:
    metrics = GatewayMetrics()
    pods = {"http://10.0.0.7:8000": "model-render-0", "http://10.0.0.8:8000": "model-render-1"}
    metrics.render_inflight.labels("model-render-0").inc()  # one call of the Python gateway

    def inflight(pod: str) -> float | None:
        return sample(metrics, "pdserve_gateway_render_inflight", render_pod=pod)

    metrics.fold_render_inflight({"http://10.0.0.7:8000": 2}, pods)
    assert (inflight("model-render-0"), inflight("model-render-1")) == (3, 0)
    metrics.fold_render_inflight({"http://10.0.0.7:8000": 2}, pods)  # read again: still now
    assert inflight("model-render-0") == 3
    metrics.fold_render_inflight({"http://10.0.0.8:8000": 1}, pods)  # pod 0's calls answered
    assert (inflight("model-render-0"), inflight("model-render-1")) == (1, 1)


def test_the_data_planes_derender_counts_are_added_to_the_gateways_own() -> None:
    metrics = GatewayMetrics()
    metrics.derender_calls.observe(3)  # a choice the Python gateway relayed
    # One choice of two calls, and its calls of one token each (bounds 1, 2, 4, ..., 1024).
    calls = {"labels": [], "counts": [0, 1] + [0] * 10, "sum": 2}
    tokens = {"labels": [], "counts": [2] + [0] * 11, "sum": 2}
    for _ in range(2):  # cumulative: read twice, added once
        metrics.fold_data_plane({"derenderCalls": [calls], "derenderTokens": [tokens]}, {})
    name = "pdserve_gateway_derender_calls_per_stream"
    assert sample(metrics, f"{name}_bucket", le="2.0") == 1
    assert sample(metrics, f"{name}_bucket", le="4.0") == 2
    assert sample(metrics, f"{name}_sum") == 5
    assert sample(metrics, "pdserve_gateway_tokens_per_derender_call_count") == 2


def test_requests_in_flight_are_the_gateways_own_plus_the_data_planes_now() -> None:
    metrics = GatewayMetrics()
    gauge = "pdserve_gateway_inflight_requests"
    metrics.inflight.inc()  # one the Python gateway serves itself
    metrics.fold_inflight(3)
    assert metrics.registry.get_sample_value(gauge) == 4
    metrics.fold_inflight(1)  # two of the data plane's ended
    assert metrics.registry.get_sample_value(gauge) == 2
    metrics.inflight.dec()
    metrics.fold_inflight(0)
    assert metrics.registry.get_sample_value(gauge) == 0
