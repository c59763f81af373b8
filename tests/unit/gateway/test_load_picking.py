"""Load-aware endpoint picking: engine queues weigh most, the gateway's own in-flight counts
spread traffic between scrapes, a nearly full KV cache is avoided."""

from __future__ import annotations

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.load import LoadScraper, parse_load

METRICS = """
# HELP vllm:num_requests_waiting Requests waiting
vllm:num_requests_waiting{engine="0",model_name="q"} 3.0
vllm:num_requests_waiting{engine="1",model_name="q"} 2.0
vllm:num_requests_running{engine="0",model_name="q"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="q"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="q"} 0.97
vllm:num_requests_waiting_total_bogus 100
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.5"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="q"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="q"} 1.5
vllm:nixl_xfer_time_seconds_count{engine="1",model_name="q"} 1.0
vllm:nixl_xfer_time_seconds_sum{engine="1",model_name="q"} 0.5
"""


def test_engine_metrics_are_summed_over_ranks() -> None:
    assert parse_load(METRICS) == {
        "waiting": 5.0,
        "running": 7.0,
        "kv_usage": 0.97,
        "transfers": 5.0,
        "transfer_seconds": 2.0,
    }


def test_each_scrape_reports_the_transfers_finished_since_the_last() -> None:
    heard: list[tuple[str, float, float]] = []
    config = GatewayConfig.model_validate(
        {"model": "q", "pools": {"decode": {"service": "x", "port": 8000}}}
    )
    scraper = LoadScraper(
        Endpoints(config),
        None,  # type: ignore[arg-type]  # nothing is fetched: totals are fed in directly
        on_transfers=lambda e, n, seconds: heard.append((e.url, n, seconds)),
    )
    decode = Endpoint("http://d")
    scraper.note_transfers(decode, 100.0, 130.0)  # history from before this gateway started
    scraper.note_transfers(decode, 100.0, 130.0)  # nothing new
    scraper.note_transfers(decode, 103.0, 134.5)
    scraper.note_transfers(decode, 2.0, 2.5)  # the engine restarted: counters began again
    assert heard == [("http://d", 3.0, 4.5), ("http://d", 2.0, 2.5)]


def test_a_queue_outweighs_running_requests() -> None:
    queued = Endpoint("http://a", waiting=2)
    busy = Endpoint("http://b", running=6)
    assert Endpoints.pick([queued, busy]) is busy


def test_in_flight_requests_spread_traffic_between_scrapes() -> None:
    a, b = Endpoint("http://a"), Endpoint("http://b")
    picked = []
    for _ in range(4):
        endpoint = Endpoints.pick([a, b])
        assert endpoint is not None
        endpoint.inflight += 1
        picked.append(endpoint.url)
    assert sorted(picked) == ["http://a", "http://a", "http://b", "http://b"]


def test_a_nearly_full_kv_cache_is_avoided() -> None:
    full = Endpoint("http://a", kv_usage=0.99, running=1)
    roomy = Endpoint("http://b", kv_usage=0.5, running=1)
    assert Endpoints.pick([full, roomy]) is roomy


def test_failed_endpoints_are_skipped() -> None:
    a, b = Endpoint("http://a"), Endpoint("http://b", waiting=9)
    assert Endpoints.pick([a, b], exclude=[a]) is b
    assert Endpoints.pick([a], exclude=[a]) is None
