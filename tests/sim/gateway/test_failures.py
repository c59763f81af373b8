"""Failures injected through the simulators, and how the gateway still answers: failed KV
transfers, a dead prefill or render replica, decode dying mid-stream, a lease too short for
decode."""

from __future__ import annotations

import httpx
import pytest

from devtools.localplane import free_port
from pdserve.sim.engine_config import TransferConfig
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, pd_stack, routing, sse_events

pytestmark = pytest.mark.parametrize("request_path", REQUEST_PATHS)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_failed_kv_transfer_still_answers(
    stack: Stack, policy: str, request_path: str
) -> None:
    client = await pd_stack(stack, policy=policy, data_plane=request_path == "dataplane")
    await httpx.AsyncClient().post(
        f"http://127.0.0.1:{stack.engines['decode'].config.port}/sim/faults",
        json={"fail_transfers": 2},
    )
    for body in (PLAIN, {**PLAIN, "stream": True}):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    if policy == "fail":
        assert 'pdserve_gateway_fallbacks_total{reason="kv_load_failed"} 2.0' in metrics


async def test_prefill_down_falls_back_to_local_prefill(stack: Stack, request_path: str) -> None:
    render = await stack.render()
    decode = await stack.engine("decode", engine("both"))
    dead = f"http://127.0.0.1:{free_port()}"
    client = await stack.gateway(
        routing(endpoints={"render": [ep(render)], "prefill": [ep(dead)], "decode": [ep(decode)]}),
        data_plane=request_path == "dataplane",
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    await stack.fold_stats()
    assert 'reason="prefill_failed"' in (await client.get("/metrics")).text


async def test_render_replica_down_is_retried_on_another(stack: Stack, request_path: str) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    dead = f"http://127.0.0.1:{free_port()}"
    client = await stack.gateway(
        routing(
            prefill=False, endpoints={"render": [ep(dead), ep(render)], "decode": [ep(decode)]}
        ),
        data_plane=request_path == "dataplane",
    )
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200


async def test_decode_crash_mid_stream_gives_an_error_event_and_done(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=request_path == "dataplane")
    decode_port = stack.engines["decode"].config.port
    await httpx.AsyncClient().post(
        f"http://127.0.0.1:{decode_port}/sim/faults", json={"drop_stream_after": 3}
    )
    events = await sse_events(client, {**PLAIN, "max_tokens": 100})
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    assert "ended before the answer was complete" in events[-2]["error"]["message"]


async def test_a_lease_that_would_expire_before_decode_is_not_used(
    stack: Stack, request_path: str
) -> None:
    """The gateway goes by the routing config's lease (vLLM's prefill reports no expiry time):
    half a second, less than the 1 s margin, runs out before any decode could pull."""
    short_lease = engine("prefill")
    short_lease.transfer = TransferConfig(lease_seconds=0.5)
    client = await pd_stack(
        stack,
        prefill_config=short_lease,
        kv_transfer={"prefillLeaseSeconds": 0.5},
        data_plane=request_path == "dataplane",
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.engines["prefill"].core.held_blocks == 0  # the lease was released at once
    assert stack.engines["decode"].core.prefix_queries > 0  # decode prefilled itself
    events = await sse_events(client, PLAIN)
    assert events[-1] == "[DONE]"
    assert all("error" not in event for event in events[:-1]), events
    assert stack.engines["prefill"].core.held_blocks == 0
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_fallbacks_total{reason="lease_expiring"} 2.0' in metrics
