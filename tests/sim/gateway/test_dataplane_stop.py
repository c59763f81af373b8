"""A gateway pod that stops mid-rollout: the requests its data plane holds for engines (the old
pool's gone, the new one's not checked yet) are served once engines come, while the pod
drains, as the Python gateway's own waiting requests are: its routing tables keep coming until
the data plane has exited."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.sim_gateway import MODEL, Stack, engine, ep, routing

BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("request_path", ["dataplane"])
async def test_a_request_held_for_engines_while_the_gateway_stops_is_served_when_they_come(
    stack: Stack, request_path: str
) -> None:
    urls = {
        role: await stack.engine(role, engine(role, api="openai")) for role in ("prefill", "decode")
    }
    config = routing("openai", render=False, endpoints={r: [ep(u)] for r, u in urls.items()})
    client = await stack.gateway(config, data_plane=True, endpoint_wait_seconds=30)
    gateway = stack.gateway_server
    front = gateway.data_plane
    assert front is not None
    decode = list(gateway.endpoints.pools["decode"])
    gateway.endpoints.replace("decode", [])  # the old decode pod gone, the new one unchecked
    await front.push(gateway.upstream.session)
    assert front.status()["route"] == "unavailable"
    sent = asyncio.create_task(client.post("/v1/chat/completions", json=BASE))
    deadline = asyncio.get_running_loop().time() + 15
    while (await stack.data_plane_stats())["inflight"] != 1:  # held in the data plane
        assert not sent.done(), sent.result().text
        assert asyncio.get_running_loop().time() < deadline, "the request never arrived"
        await asyncio.sleep(0.02)  # polling the data plane's count, with a deadline
    stopping = asyncio.create_task(front.stop())  # SIGTERM's drain is over: the pod stops
    gateway.endpoints.replace("decode", decode)  # the new decode pod passed its check
    answer = await asyncio.wait_for(sent, 20)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    await asyncio.wait_for(stopping, 20)
    assert front.process is not None
    assert front.process.returncode == 0
