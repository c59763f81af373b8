"""The KV path between prefill and decode: verified transports and slices, transport health
from the decode engines' NIXL metrics, and bidirectional KV reused by a conversation's next
turn."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from pdserve.controller.health import HealthVerdict, TransportMonitor
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, finished, pd_stack, routing


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_verify_required_keeps_pd_on_verified_slices_and_decode_in_the_same_slice(
    stack: Stack, request_path: str
) -> None:
    render = await stack.render()
    urls = {
        name: await stack.engine(name, engine(role))
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    }

    def sliced(name: str, slice_index: str, transport: str) -> dict[str, Any]:
        return {**ep(urls[name]), "slice": slice_index, "kvTransport": transport}

    config = routing(endpoints={
        "render": [ep(render)],
        "prefill": [sliced("p0", "0", "Failed"), sliced("p1", "1", "Verified")],
        "decode": [sliced("d0", "0", "Failed"), sliced("d1", "1", "Verified")],
    })  # fmt: skip
    config["kvTransfer"] = {"verify": "Required"}
    client = await stack.gateway(
        config, load_scrape_seconds=None, data_plane=request_path == "dataplane"
    )
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [0, 3, 0, 3]

    # The operator marks slice 1 failed too: no verified KV path is left, so requests prefill
    # locally on decode instead of failing (even in Disaggregated mode).
    stack.gateway_server.endpoints.pools["prefill"][1].kv_transport = "Failed"
    await stack.push_table()
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert finished(stack.engines["p1"]) == 3
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_fallbacks_total{reason="transport_unverified"} 1.0' in metrics


async def test_transport_health_follows_the_decode_engines_nixl_metrics(stack: Stack) -> None:
    """The operator's scraper against real simulated engines: healthy transfers, then failed
    ones, then ones slower than the budget (half of a 5 s TTFT SLO). Simulated time runs 100x
    faster than real time, so scheduling jitter counts for a lot: the budget leaves room."""
    client = await pd_stack(stack)
    decode = f"http://127.0.0.1:{stack.engines['decode'].config.port}"
    changed: list[tuple[str, str]] = []
    monitor = TransportMonitor(changed.append, interval=0)
    key = ("llm", "qwen")
    gateway = str(client.base_url).rstrip("/")
    monitor.track(key, [f"{decode}/metrics"], budget=2.5, gateways=[gateway])
    try:
        await monitor.scrape_once()
        assert monitor.verdict(key) is None  # no transfer yet

        async def send(faults: dict[str, int] | None = None) -> HealthVerdict | None:
            if faults:
                await httpx.AsyncClient().post(f"{decode}/sim/faults", json=faults)
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
            await monitor.scrape_once()
            return monitor.verdict(key)

        healthy = await send()
        assert healthy is not None
        assert (healthy.healthy, healthy.reason) == (True, "Healthy")
        assert healthy.message.startswith("2 transfers, average ")
        failing = await send({"fail_transfers": 1})
        assert failing is not None
        assert (failing.healthy, failing.reason) == (False, "TransferFailures")
        slow = await send({"delay_transfers": 2, "delay_ms": 20000})
        assert slow is not None
        assert (slow.healthy, slow.reason) == (False, "SlowTransfers")
        assert "budget 2500 ms" in slow.message
        assert changed == [key, key, key]  # each flip asks for a reconcile
        # The gateway gave up on P/D (Auto mode degraded): the condition says so, whatever the
        # engines' last window looked like, until the gateway recovers.
        stack.gateway_server.policy.health.degraded = True
        await monitor.scrape_once()
        fallback = monitor.verdict(key)
        assert fallback is not None
        assert (fallback.healthy, fallback.reason) == (False, "GatewayFallback")
        assert fallback.message.startswith("1 of 1 gateway replicas prefill everything locally")
        stack.gateway_server.policy.health.degraded = False
        await monitor.scrape_once()
        assert monitor.verdict(key) == slow
        await stack.exits.aclose()  # engines gone
        await monitor.scrape_once()
        gone = monitor.verdict(key)
        assert gone is not None
        assert gone.reason == "MetricsUnreachable"
    finally:
        await monitor.close()


def bidirectional(role: str) -> EngineConfig:
    config = engine(role)
    config.transfer = TransferConfig(bidirectional=True)
    return config


async def bidirectional_stack(stack: Stack, **kv_transfer: Any) -> httpx.AsyncClient:
    return await pd_stack(
        stack,
        prefill_config=bidirectional("prefill"),
        decode_config=bidirectional("decode"),
        kv_transfer={"bidirectional": True, **kv_transfer},
        load_scrape_seconds=None,
    )


async def two_turns(
    client: httpx.AsyncClient, between: float = 0
) -> tuple[list[dict[str, Any]], httpx.Response]:
    """A conversation's first turn, and its second `between` seconds later: the history, and
    the second turn's answer."""
    history = [{"role": "user", "content": " ".join(["tell me about the weather"] * 30)}]
    first = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-1"}
    )
    assert first.status_code == 200, first.text
    history += [
        first.json()["choices"][0]["message"],
        {"role": "user", "content": "and tomorrow?"},
    ]
    await asyncio.sleep(between)
    second = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-1"}
    )
    assert second.status_code == 200, second.text
    return history, second


def reused_tokens(stack: Stack) -> float:
    """Prompt tokens the prefill engine took from decode's KV instead of computing them."""
    return sum(
        float(sample.value)
        for metric in stack.engines["prefill"].metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "pdserve_sim_bidirectional_reused_tokens_total"
    )


async def test_bidirectional_kv_of_the_last_turn_is_reused_by_the_next_turns_prefill(
    stack: Stack,
) -> None:
    """Decode's expiry time is a reading of its own monotonic clock (time.perf_counter(), as
    vLLM's): the gateway holds the turn for the routing config's TTL on its own clock and hands
    the engine's number on untouched."""
    client = await bidirectional_stack(stack)
    before = time.perf_counter()
    history, second = await two_turns(client)
    await stack.fold_stats()
    gateway_metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_bidirectional_reuse_total{outcome="reused"} 1.0' in gateway_metrics
    assert reused_tokens(stack) >= 150  # the first turn's prompt, at least, came back from decode
    if not stack.data_plane:  # the data plane's own store: dataplane/bidirectional_test.go
        held = stack.gateway_server.decode_kv.held["c-1"]  # the second turn's, from decode
        expiry = held.params["remote_blocks_expiry_time"]
        assert before < expiry < time.perf_counter() + 480 * 0.01  # decode's clock + its TTL
        assert held.expires_at > time.monotonic() + 400  # the gateway's: routing's 480 s

    # Another conversation never gets this one's KV.
    other = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-2"}
    )
    assert other.status_code == 200
    await stack.fold_stats()
    assert 'outcome="reused"} 1.0' in (await client.get("/metrics")).text

    # The third turn reads back what decode holds of the second (the first's is freed: read).
    pulled = reused_tokens(stack)
    history += [
        second.json()["choices"][0]["message"],
        {"role": "user", "content": "and the day after?"},
    ]
    third = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-1"}
    )
    assert third.status_code == 200, third.text
    await stack.fold_stats()
    assert 'outcome="reused"} 2.0' in (await client.get("/metrics")).text
    assert reused_tokens(stack) > pulled + 150


async def test_a_turn_held_past_the_decode_ttl_is_not_handed_to_the_next_prefill(
    stack: Stack,
) -> None:
    client = await bidirectional_stack(stack, decodeBlocksTtlSeconds=0.2)
    await two_turns(client, between=0.4)
    await stack.fold_stats()
    gateway_metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_bidirectional_reuse_total{outcome="expired"} 1.0' in gateway_metrics
    assert 'outcome="reused"' not in gateway_metrics
    assert reused_tokens(stack) == 0
