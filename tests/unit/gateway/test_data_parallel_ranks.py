"""A pod serving several data-parallel ranks is routed rank by rank: each rank a target with its
own load and prefix-cache affinity, pinned with vLLM's X-data-parallel-rank header, while what
belongs to the pod (its replica check, being marked down, a retry moving on) stays per pod."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
from aiohttp import web

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.builders.gateway import routing_config
from pdserve.contract.routing import GatewayConfig, config_text_of
from pdserve.gateway.discovery import PodDiscovery
from pdserve.gateway.endpoints import (
    DATA_PARALLEL_RANK_HEADER,
    Endpoint,
    Endpoints,
    rank_targets,
)
from pdserve.gateway.load import LoadScraper, parse_engine_loads
from pdserve.gateway.replica_contract import ReplicaCheck, ReplicaContract
from pdserve.kube.client import Kube
from tests.support.serving import serving
from tests.support.specs import GPU_POOLS

POOLS = {"decode": {"service": "d", "port": 8000, "selector": {"c": "decode"},
                    "dataParallelLocal": 2}}  # fmt: skip


def static(*urls: str, ranks: int = 2) -> Endpoints:
    endpoints = [{"url": url, "dataParallelLocal": ranks} for url in urls]
    return Endpoints(
        GatewayConfig.model_validate(
            {"model": "m", "pools": POOLS, "endpoints": {"decode": endpoints}}
        )
    )


def test_each_rank_is_a_target_pinned_by_vllms_header() -> None:
    endpoints = static("http://a:8000", "http://b:8000/")
    targets = endpoints.pools["decode"]
    assert [(e.url, e.rank, e.key) for e in targets] == [
        ("http://a:8000", 0, "http://a:8000#dp0"),
        ("http://a:8000", 1, "http://a:8000#dp1"),
        ("http://b:8000", 0, "http://b:8000#dp0"),
        ("http://b:8000", 1, "http://b:8000#dp1"),
    ]
    assert targets[1].upstream_headers({"X-Request-Id": "r"}) == {
        "X-Request-Id": "r", DATA_PARALLEL_RANK_HEADER: "1",
    }  # fmt: skip
    [single] = static("http://c:8000", ranks=1).pools["decode"]
    assert single.rank is None
    assert single.key == "http://c:8000"
    assert single.upstream_headers({"X-Request-Id": "r"}) == {"X-Request-Id": "r"}


def test_a_pod_marked_down_or_held_out_is_so_on_every_rank() -> None:
    endpoints = static("http://a:8000", "http://b:8000")
    a0, a1, b0, b1 = endpoints.pools["decode"]
    endpoints.mark_down(a0)
    assert a1.down_until == a0.down_until > 0
    assert b0.down_until == b1.down_until == 0
    b1.routable = False
    assert not b0.routable
    assert a0.routable


def test_a_retry_goes_to_another_pod_not_the_failed_pods_other_rank() -> None:
    a0, a1, b0, b1 = static("http://a:8000", "http://b:8000").pools["decode"]
    b0.waiting = b1.waiting = 5  # busier: only a failure of a sends the request there
    assert Endpoints.pick([a0, a1, b0, b1], exclude=[a0]) in (b0, b1)
    assert Endpoints.pick([a0, a1], exclude=[a1]) is None
    assert Endpoints.rank([a0, a1, b0, b1]) == [a0, a1, b0, b1]  # every target, best first


def test_the_warm_rank_wins_within_the_slack_and_load_spreads_over_ranks() -> None:
    a0, a1 = static("http://a:8000").pools["decode"]
    a1.running = 3
    assert Endpoints.pick([a0, a1], affinity={a1.key: 12}) is a1  # its prefix cache
    a1.running = 9
    assert Endpoints.pick([a0, a1], affinity={a1.key: 12}) is a0  # too busy now
    a1.running = 0
    picked = []
    for _ in range(4):
        target = Endpoints.pick([a0, a1])
        assert target is not None
        target.inflight += 1
        picked.append(cast(int, target.rank))
    assert sorted(picked) == [0, 0, 1, 1]


EXPOSITION = """\
vllm:num_requests_waiting{engine="2",model_name="m"} 1.0
vllm:num_requests_waiting{engine="10",model_name="m"} 4.0
vllm:num_requests_running{engine="2",model_name="m"} 3.0
vllm:num_requests_running{engine="10",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="2",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="10",model_name="m"} 0.5
"""


def test_per_rank_load_comes_in_the_order_of_the_engine_label() -> None:
    first, second = parse_engine_loads(EXPOSITION)  # 2 before 10: numbers, not strings
    assert (first["waiting"], first["running"], first["kv_usage"]) == (1.0, 3.0, 0.25)
    assert (second["waiting"], second["running"], second["kv_usage"]) == (4.0, 0.0, 0.5)


async def test_one_scrape_of_a_pod_gives_each_rank_its_own_load() -> None:
    app = web.Application()
    scraped = []

    async def metrics(_: web.Request) -> web.Response:
        scraped.append(1)
        return web.Response(text=EXPOSITION)

    app.router.add_get("/metrics", metrics)
    async with serving(app) as url:
        endpoints = static(url, ranks=3)
        async with aiohttp.ClientSession() as session:
            await LoadScraper(endpoints, session).scrape(endpoints.pools["decode"], decode=True)
    r0, r1, r2 = endpoints.pools["decode"]
    assert len(scraped) == 1
    assert (r0.waiting, r0.running, r1.waiting, r1.running) == (1.0, 3.0, 4.0, 0.0)
    # The pod has no series for a third rank: it is taken as busy as the whole pod.
    assert (r2.waiting, r2.running, r2.kv_usage) == (5.0, 3.0, 0.5)


def test_discovery_routes_each_rank_of_a_ready_pod() -> None:
    config = GatewayConfig.model_validate({"model": "m", "pools": POOLS})
    endpoints = Endpoints(config)
    found = PodDiscovery(cast(Kube, None), config, endpoints)
    found.pods = {
        "m-decode-0": {
            "metadata": {"name": "m-decode-0", "labels": {"c": "decode"}},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    }
    found.publish()
    first = endpoints.pools["decode"]
    assert [(e.name, e.key) for e in first] == [
        ("m-decode-0", "http://10.0.0.7:8000#dp0"), ("m-decode-0", "http://10.0.0.7:8000#dp1"),
    ]  # fmt: skip
    first[1].inflight = 3
    found.publish()  # the same pod again: its targets (and their counts) stay
    assert [e.inflight for e in endpoints.pools["decode"]] == [0, 3]
    assert endpoints.pools["decode"][0].replica is endpoints.pools["decode"][1].replica


async def test_a_pod_is_checked_once_however_many_ranks_it_serves() -> None:
    asked: list[str] = []

    async def fetch(url: str, path: str, body: Mapping[str, Any] | None) -> tuple[int, Any]:
        asked.append(url + path)
        return 404, None  # no check route: routed unchecked

    endpoints = static("http://a:8000", "http://b:8000", ranks=4)
    reported: list[str] = []
    both = asyncio.Event()

    def report(check: ReplicaCheck) -> None:
        reported.append(check.endpoint.label)
        if len(reported) == 2:
            both.set()

    contract = ReplicaContract(endpoints, "m", fetch, report)
    contract.start()
    await asyncio.wait_for(both.wait(), 5)
    assert all(e.routable for e in endpoints.pools["decode"])  # every rank of both pods
    assert sorted(contract.status()["decode"]) == ["http://a:8000", "http://b:8000"]
    # One pod, one check: each of its check calls once, not once per rank.
    assert sorted(u for u in asked if u.startswith("http://a:8000")) == [
        "http://a:8000/v1/models", "http://a:8000/version",
    ]  # fmt: skip
    contract.stop()


def gpu_model(**pools: dict[str, Any]) -> DisaggregatedModel:
    body = copy.deepcopy(GPU_POOLS)
    for name, changes in pools.items():
        body["spec"][name].update(changes)
    return parse_resource(body)


def test_the_operator_tells_the_gateway_how_many_ranks_each_pod_serves() -> None:
    dm = gpu_model(decode={"nodesPerReplica": 4, "dataParallelSize": 16})
    config = routing_config(dm, "p")
    assert config.pools.decode.data_parallel_local == 4
    assert config.pools.prefill is not None
    assert config.pools.prefill.data_parallel_local == 1
    text = config_text_of(config)
    assert text.count("dataParallelLocal") == 1  # unset at 1: such a pool's file reads as before
    assert rank_targets(Endpoint("http://x"), 1) == [Endpoint("http://x")]
