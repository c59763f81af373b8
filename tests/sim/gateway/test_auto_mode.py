"""Auto mode against simulated engines: short prompts prefilled locally, long ones on the prefill
pool, and what it learns from streams and the engines' metrics (the KV path's handoff time, per
slice, the decode step time, answer lengths) to keep P/D only where it pays. The decisions run
on both request paths (REQUEST_PATHS): behind the data plane, which decides each request from
the table the Python gateway pushes and reports what it measured, state a test sets is pushed
(`stack.push_table`) and what it reports folded (`stack.fold_stats`) before anything is read."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdserve.gateway.policy import AutoPolicy, PolicySettings
from pdserve.sim.engine_config import TransferConfig
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import (
    LONG,
    PLAIN,
    Stack,
    busy_decode,
    engine,
    ep,
    finished,
    pd_stack,
    routing,
    sse_events,
)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_auto_mode_prefills_short_prompts_locally_and_long_ones_on_prefill(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(
        stack, mode="Auto", load_scrape_seconds=None, data_plane=request_path == "dataplane"
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.engines["prefill"].core.prefix_queries == 0  # short: prefilled on decode
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    # Nothing else runs on decode: a local prefill stalls no stream, and skips the handoff.
    assert stack.engines["prefill"].core.prefix_queries == 0
    await busy_decode(stack)
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert stack.engines["prefill"].core.prefix_queries > 0  # long, decode busy: prefill pool
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    for reason in ("short_prompt", "decode_idle", "long_prompt"):
        assert f'pdserve_gateway_auto_decisions_total{{reason="{reason}"}} 1.0' in metrics
    # Requests are counted under the route they took, not the one Auto started from.
    assert 'pdserve_gateway_requests_total{outcome="ok",route="render"} 2.0' in metrics
    assert 'pdserve_gateway_requests_total{outcome="ok",route="render_pd"} 1.0' in metrics


async def slow_kv_path(stack: Stack, *, data_plane: bool) -> httpx.AsyncClient:
    """Auto with a 100 ms TTFT budget over a decode engine whose KV pulls take 0.2 s (real, at
    this time scale): a measured handoff says the KV path alone misses the budget."""
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)
    return await pd_stack(
        stack,
        decode_config=slow,
        mode="Auto",
        slo={"ttftMs": 100},
        load_scrape_seconds=None,
        data_plane=data_plane,
    )


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_auto_mode_stops_using_a_kv_path_too_slow_for_the_ttft_slo(
    stack: Stack, request_path: str
) -> None:
    client = await slow_kv_path(stack, data_plane=request_path == "dataplane")
    await busy_decode(stack)
    first = await sse_events(client, LONG)
    assert first[-1] == "[DONE]"
    await stack.fold_stats()  # behind the data plane: what it measured, in the next table
    second = await client.post("/v1/chat/completions", json=LONG)
    assert second.status_code == 200
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_over_ttft_budget"} 1.0' in metrics
    status = (await client.get("/status")).json()
    assert status["handoffSecondsPerToken"] > 0


async def test_behind_the_data_plane_auto_learns_its_first_handoff_at_the_next_table_push(
    stack: Stack,
) -> None:
    """The data plane measures the first handoff; until one is known the Python gateway folds
    what it reports at every table push, not at its stats poll (an hour apart here), so the
    next long prompt is already decided by it: the KV path is too slow for the TTFT budget."""
    client = await slow_kv_path(stack, data_plane=True)
    front = stack.gateway_server.data_plane
    assert front is not None
    front.stats_seconds = 3600.0
    await busy_decode(stack)
    await stack.push_table()
    assert (await sse_events(client, LONG))[-1] == "[DONE]"  # P/D: it measures the handoff

    async def learnt() -> float:
        while True:  # what a user would read on the gateway's status
            estimate = (await client.get("/status")).json()["handoffSecondsPerToken"]
            if estimate is not None:
                return float(estimate)
            await asyncio.sleep(0.02)

    assert await asyncio.wait_for(learnt(), timeout=10) > 0
    await stack.push_table()  # the table that carries it (the gateway pushes it within 0.25 s)
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    decisions = (await stack.data_plane_stats())["auto"]["decisions"]
    assert decisions == {"long_prompt": 1, "handoff_over_ttft_budget": 1}


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_auto_learns_the_kv_path_from_decodes_transfer_metrics_without_streams(
    stack: Stack, request_path: str
) -> None:
    """Non-streamed requests give the gateway no first-token time to measure the handoff by:
    the decode engine's vllm:nixl_xfer_time_seconds does (read in the engine's simulated
    seconds, scaled like the engines' time). Until the first handoff is known, one request at a
    time learns the path while the others run whole on the least loaded engine."""
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)  # 20 s simulated: 0.2 s real
    client = await pd_stack(
        stack,
        decode_config=slow,
        mode="Auto",
        slo={"ttftMs": 100},
        load_scrape_seconds=0.05,
        engine_seconds_scale=0.01,
        data_plane=request_path == "dataplane",
    )
    # No other streams here: keep Auto from prefilling on the idle decode replica. The learning
    # request's window is set past any test's length (it is two TTFT budgets, 0.2 s, by
    # default): it cannot run out while a busy machine is slow to bring the second request to
    # its decision. Behind the data plane, which keeps that window, the settings are pushed.
    stack.gateway_server.policy = AutoPolicy(
        PolicySettings(local_when_decode_idle=False, learning_timeout_budgets=1e6)
    )
    await stack.push_table()
    first, second = await asyncio.gather(
        client.post("/v1/chat/completions", json=LONG),
        client.post("/v1/chat/completions", json={**LONG, "max_tokens": 21}),
    )
    assert (first.status_code, second.status_code) == (200, 200)
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="long_prompt"} 1.0' in metrics
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_unknown"} 1.0' in metrics
    # The learning request was not streamed: only the engine's transfer metrics measured it.
    assert stack.gateway_server.metrics.stage.labels("kv_handoff")._sum.get() == 0

    async def learnt() -> float:
        while True:  # the scraper task learns it: poll the status endpoint a user would read
            estimate = (await client.get("/status")).json()["handoffSecondsPerToken"]
            if estimate is not None:
                return float(estimate)
            await asyncio.sleep(0.02)

    per_token = await asyncio.wait_for(learnt(), timeout=5)
    tokens = stack.gateway_server.policy.health.pd_prompt_tokens
    assert tokens is not None
    # Read in the engine's seconds, scaled: at least the transfer's 20 simulated seconds (0.2 s),
    # and nowhere near the unscaled 20 s however long a busy machine stretches the transfer.
    assert 0.2 * 0.99 <= per_token * tokens < 2.0
    await stack.push_table()  # behind the data plane: the table that carries what was learnt
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_over_ttft_budget"} 1.0' in metrics


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
@pytest.mark.parametrize("engine_api", ["tokens", "openai"])
async def test_streams_teach_auto_the_decode_step_time_and_answer_length(
    stack: Stack, engine_api: str, request_path: str
) -> None:
    """What Auto's ITL rule reads: each decode engine's recent time between tokens, and how
    long answers run, from the streams the gateway relays (both engine APIs; behind the data
    plane, which measures the streams it relays, as it reports them)."""
    prefill = await stack.engine("prefill", engine("prefill", api=engine_api))
    decode_url = await stack.engine("decode", engine("decode", api=engine_api))
    endpoints: dict[str, Any] = {"prefill": [ep(prefill)], "decode": [ep(decode_url)]}
    if engine_api == "tokens":
        endpoints["render"] = [ep(await stack.render())]
    config = routing(engine_api, render=engine_api == "tokens", mode="Auto", endpoints=endpoints)
    client = await stack.gateway(
        config, step_window_seconds=0.001, data_plane=request_path == "dataplane"
    )
    events = await sse_events(client, {**PLAIN, "max_tokens": 20})
    assert events[-1] == "[DONE]"
    await stack.fold_stats()
    gateway = stack.gateway_server
    [decode] = gateway.endpoints.pools["decode"]
    assert decode.steps.seconds is not None
    assert 0 < decode.steps.seconds < 1
    assert gateway.policy.output_tokens is not None
    assert 10 <= gateway.policy.output_tokens <= 21


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_auto_mode_learns_each_slices_kv_path_and_avoids_only_the_slow_one(
    stack: Stack, request_path: str
) -> None:
    """Two slices; slice 1's decode pulls KV slowly (a TCP fallback, say): once Auto has seen a
    handoff through each prefill replica, P/D goes through slice 0 only, even while its prefill
    replica is the busier one, instead of giving up P/D for every request."""
    render = await stack.render()
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)  # 0.2 s real at this time scale
    configs = {"p0": engine("prefill"), "p1": engine("prefill"), "d0": engine("decode"), "d1": slow}
    urls = {name: await stack.engine(name, config) for name, config in configs.items()}

    def sliced(name: str, slice_index: str) -> dict[str, Any]:
        return {**ep(urls[name]), "slice": slice_index}

    config = routing(mode="Auto", slo={"ttftMs": 150}, endpoints={
        "render": [ep(render)],
        "prefill": [sliced("p0", "0"), sliced("p1", "1")],
        "decode": [sliced("d0", "0"), sliced("d1", "1")],
    })  # fmt: skip
    client = await stack.gateway(
        config, load_scrape_seconds=None, data_plane=request_path == "dataplane"
    )
    pools = stack.gateway_server.endpoints.pools
    for endpoint in pools["decode"]:
        endpoint.running = 3  # other streams: no idle decode to prefill on
    p0, p1 = pools["prefill"]

    def document(n: int) -> dict[str, Any]:  # no shared prefix: nothing pulls it to one replica
        return {**LONG, "messages": [{"role": "user", "content": f"doc {n} " * 400}]}

    for n, busy in enumerate((p1, p0)):  # one handoff through each slice
        busy.running = 2
        await stack.push_table()
        assert (await sse_events(client, document(n)))[-1] == "[DONE]"  # streams time handoffs
        await stack.fold_stats()
        busy.running = 0
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [1, 1, 1, 1]
    estimates = (await client.get("/status")).json()["handoffSecondsPerTokenByPrefill"]
    assert set(estimates) == {urls["p0"], urls["p1"]}  # learnt per replica
    # What the policy concludes from them, not how many times faster one path measured: slice
    # 1's KV path alone would miss the 150 ms TTFT budget, slice 0's would not.
    health = stack.gateway_server.policy.health
    tokens = int(health.pd_prompt_tokens or 0)
    slow_path = health.predicted_handoff(tokens, urls["p1"])
    fast_path = health.predicted_handoff(tokens, urls["p0"])
    assert slow_path is not None
    assert fast_path is not None
    assert slow_path > 0.150 > fast_path

    p0.running = 2  # slice 0's prefill is now the busier one
    # The prefill speed Auto measured is this machine's (wall clock, busy or not): pin it to
    # one at which local prefill would miss the budget too, so the decision turns on the KV
    # paths alone, as this test means it to.
    health.prefill_seconds_per_token = 1.0 / max(1, tokens)
    await stack.push_table()
    assert (await sse_events(client, document(2)))[-1] == "[DONE]"
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [2, 1, 2, 1]
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="long_prompt"} 3.0' in metrics


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_auto_mode_may_run_a_local_request_whole_on_an_idle_prefill_replica(
    stack: Stack, request_path: str
) -> None:
    """While the P/D path is unusable (here: degraded by failures), local requests may run on the
    least loaded engine of both pools: a prefill engine answers a request without KV params.
    Otherwise local requests stay on decode, keeping the prefill pool for P/D."""
    client = await pd_stack(
        stack, mode="Auto", load_scrape_seconds=None, data_plane=request_path == "dataplane"
    )
    await busy_decode(stack)
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert (finished(stack.engines["prefill"]), finished(stack.engines["decode"])) == (0, 1)
    stack.gateway_server.policy.health.degraded = True
    await stack.push_table()
    answer = await client.post("/v1/chat/completions", json=LONG)
    assert answer.status_code == 200
    message = answer.json()["choices"][0]["message"]
    assert message.get("content") or message.get("reasoning")
    assert (finished(stack.engines["prefill"]), finished(stack.engines["decode"])) == (1, 1)
