"""Parity gating: the gateway never pairs replicas with different chat templates or parsers, and
holds requests while a pool's only replica is replaced instead of failing them."""

from __future__ import annotations

import asyncio

from pdserve.gateway.endpoints import Endpoint
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, finished, routing


async def test_parity_gating_never_mixes_templates(stack: Stack) -> None:
    render_a = await stack.render()
    render_b = await stack.render()
    decode = await stack.engine("both", engine("both"))
    only_b = await stack.gateway(
        routing(
            prefill=False,
            endpoints={
                "render": [ep(render_a, "old"), ep(render_b, "p1")],
                "decode": [ep(decode, "p1")],
            },
        )
    )
    assert (await only_b.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.renders[0].metrics.requests._metrics == {}  # the old-template replica idles
    mixed = await stack.gateway(
        routing(
            prefill=False, endpoints={"render": [ep(render_a, "old")], "decode": [ep(decode, "p1")]}
        ),
        endpoint_wait_seconds=0.2,
    )
    response = await mixed.post("/v1/chat/completions", json=PLAIN)
    assert response.status_code == 503
    assert "refusing to mix chat templates or parsers" in response.json()["error"]["message"]
    assert (await mixed.get("/ready")).status_code == 503


async def test_a_request_waits_for_a_replaced_pools_new_replica_then_is_served(
    stack: Stack,
) -> None:
    """A pool's only replica being replaced (a parity rollout, a restart) holds requests for
    the bound instead of failing them; they are served once discovery finds the new one."""
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render, "p1")], "decode": []}),
        endpoint_wait_seconds=30,
    )
    assert stack.gateway_server is not None
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=PLAIN))

    async def held() -> None:
        while "pdserve_gateway_inflight_requests 1.0" not in (await client.get("/metrics")).text:  # noqa: ASYNC110 - polled with a deadline
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held(), timeout=10)
    assert not waiting.done()  # with no decode endpoint it can only be waiting
    stack.gateway_server.endpoints.replace("decode", [Endpoint(decode.rstrip("/"), "p1")])
    response = await asyncio.wait_for(waiting, timeout=10)
    assert response.status_code == 200, response.text


async def test_disaggregated_mode_waits_for_a_prefill_replica_mid_rollout(stack: Stack) -> None:
    """Mode Disaggregated with no routable prefill replica (the last old one gone, the new one
    still being checked): the request is held, then served prefill -> decode; only after the
    whole bound with none does it get 503, as before."""
    render = await stack.render()
    prefill = await stack.engine("prefill", engine("prefill"))
    decode = await stack.engine("decode", engine("decode"))
    endpoints = {"render": [ep(render)], "prefill": [], "decode": [ep(decode)]}
    client = await stack.gateway(routing(endpoints=endpoints), endpoint_wait_seconds=30)
    assert stack.gateway_server is not None
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=PLAIN))

    async def held() -> None:
        while "pdserve_gateway_inflight_requests 1.0" not in (await client.get("/metrics")).text:  # noqa: ASYNC110 - polled with a deadline
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held(), timeout=10)
    assert not waiting.done()
    stack.gateway_server.endpoints.replace("prefill", [Endpoint(prefill.rstrip("/"), "p1")])
    response = await asyncio.wait_for(waiting, timeout=10)
    assert response.status_code == 200, response.text
    assert finished(stack.engines["prefill"]) == 1

    impatient = await stack.gateway(routing(endpoints=endpoints), endpoint_wait_seconds=0.2)
    refused = await impatient.post("/v1/chat/completions", json=PLAIN)
    assert refused.status_code == 503
    assert "no healthy prefill endpoint" in refused.json()["error"]["message"]
