"""P/D across data-parallel ranks through the gateway, over simulated engines that run two ranks
each behind one HTTP server (as `vllm serve --data-parallel-size 2` does): the gateway pins each
hop to a rank with vLLM's header, keeps a repeated prefix on the rank that cached it, spreads
distinct requests over the ranks, and any prefill rank hands its KV to any decode rank."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from pdserve.controller.health import TransportMonitor
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_server import EngineServer
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import LONG, PLAIN, RENDER, Stack, engine, ep, routing

pytestmark = pytest.mark.parametrize("request_path", REQUEST_PATHS)

RANKS = 2


def two_ranks(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, data_parallel_size=RANKS, data_parallel_size_local=RANKS)


def ranked(url: str) -> dict[str, Any]:
    return {**ep(url), "dataParallelLocal": RANKS}


def prefilled(server: EngineServer) -> list[int]:
    """Prompt tokens each rank looked up in its prefix cache: the prompts it computed."""
    return [rank.core.prefix_queries for rank in server.ranks]


def finished(server: EngineServer) -> list[float]:
    """Requests each rank finished, by its own `engine` series (vllm:request_success)."""
    counts = [0.0] * RANKS
    for metric in server.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "vllm:request_success_total":
                counts[int(sample.labels["engine"])] += sample.value
    return counts


async def pd_over_ranks(stack: Stack, request_path: str) -> Any:
    render = await stack.render()
    prefill = await stack.engine("prefill", two_ranks(engine("prefill")))
    decode = await stack.engine("decode", two_ranks(engine("decode")))
    endpoints = {"render": [ep(render)], "prefill": [ranked(prefill)], "decode": [ranked(decode)]}
    # No scrapes: the test sets the ranks' load itself, and nothing overwrites it.
    return await stack.gateway(
        routing(endpoints=endpoints),
        load_scrape_seconds=None,
        data_plane=request_path == "dataplane",
    )


async def test_a_repeated_prefix_goes_back_to_the_rank_that_cached_it(
    stack: Stack, request_path: str
) -> None:
    client = await pd_over_ranks(stack, request_path)
    prefill, decode = stack.engines["prefill"], stack.engines["decode"]
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    first = prefilled(prefill)
    [holder] = [i for i, tokens in enumerate(first) if tokens]
    assert prefilled(decode) == [0, 0]  # decode pulled the KV, on whichever rank it ran
    # The warm rank is busier than the other, within the slack: load alone would move.
    targets = stack.gateway_server.endpoints.pools["prefill"]
    targets[holder].running = 2
    await stack.push_table()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    second = prefilled(prefill)
    assert second[1 - holder] == 0  # the other rank computed nothing
    assert second[holder] > first[holder]
    assert prefill.ranks[holder].core.prefix_hits > 0  # it found the prefix it had cached


async def test_the_rank_the_gateway_picks_is_the_rank_that_serves(
    stack: Stack, request_path: str
) -> None:
    client = await pd_over_ranks(stack, request_path)
    # Rank 1 of each pool looks busy to the gateway: every hop goes to rank 0, where the
    # engine's own balancer (idle ranks take turns) would have sent some to rank 1.
    for pool in ("prefill", "decode"):
        stack.gateway_server.endpoints.pools[pool][1].running = 50
    await stack.push_table()
    for i in range(3):
        body = {**PLAIN, "messages": [{"role": "user", "content": f"question {i}"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert prefilled(stack.engines["prefill"])[1] == 0
    assert finished(stack.engines["decode"]) == [3.0, 0.0]


async def test_distinct_requests_spread_over_both_ranks_of_both_pools(
    stack: Stack, request_path: str
) -> None:
    client = await pd_over_ranks(stack, request_path)
    bodies = [
        {**PLAIN, "messages": [{"role": "user", "content": f"story number {i}"}]} for i in range(4)
    ]
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=body) for body in bodies)
    )
    assert [a.status_code for a in answers] == [200] * 4
    assert all(tokens > 0 for tokens in prefilled(stack.engines["prefill"]))
    assert all(count > 0 for count in finished(stack.engines["decode"]))
    assert sum(finished(stack.engines["decode"])) == 4


async def test_a_clients_own_rank_header_never_reaches_the_engines(
    stack: Stack, request_path: str
) -> None:
    render = await stack.render()
    # Routed as one target (no dataParallelLocal): the gateway sends no header of its own.
    both = await stack.engine("both", two_ranks(engine("both")))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(both)]}),
        data_plane=request_path == "dataplane",
    )
    sent = await client.post(
        "/v1/chat/completions", json=PLAIN, headers={"X-data-parallel-rank": "7"}
    )
    assert sent.status_code == 200, sent.text  # rank 7 passed on would be vLLM's 400
    assert RENDER.served_model_name == sent.json()["model"]


async def test_transport_health_names_the_decode_rank_whose_pulls_fail(
    stack: Stack, request_path: str
) -> None:
    """The operator's transport monitor reads each rank's NIXL counters: one rank's broken path
    (its GPU's NIC, on a real node) is named, not averaged away over the pod."""
    client = await pd_over_ranks(stack, request_path)
    decode = f"http://127.0.0.1:{stack.engines['decode'].config.port}"
    monitor = TransportMonitor(lambda key: None, interval=0)
    key = ("llm", "qwen")
    monitor.track(key, [f"{decode}/metrics"], budget=None, names={f"{decode}/metrics": "d-0"})
    await monitor.scrape_once()
    # Decode rank 0 looks busy: the request pulls its KV on rank 1, which fails it once.
    stack.gateway_server.endpoints.pools["decode"][0].running = 50
    await stack.push_table()
    async with httpx.AsyncClient() as engine_client:
        await engine_client.post(f"{decode}/sim/faults", json={"fail_transfers": 1})
    await client.post("/v1/chat/completions", json=PLAIN)
    await monitor.scrape_once()
    verdict = monitor.verdict(key)
    assert verdict is not None
    assert verdict.reason == "TransferFailures"
    assert verdict.message.endswith("; failed on decode d-0 rank 1 (1)"), verdict.message
