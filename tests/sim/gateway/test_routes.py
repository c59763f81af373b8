"""The gateway's four routes over simulated render servers and engines on loopback: P/D over
the tokens API (render -> prefill -> decode -> derender), render with one pool, P/D and
aggregated over the OpenAI API, the same answers either way, n choices."""

from __future__ import annotations

import pytest

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import (
    CHAT,
    MODEL,
    PLAIN,
    Stack,
    engine,
    ep,
    pd_stack,
    routing,
    sse_events,
)


async def test_route1_pd_non_stream_splits_reasoning_and_tool_calls(stack: Stack) -> None:
    client = await pd_stack(stack)
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert answer["model"] == MODEL
    assert stack.engines["decode"].core.prefix_queries == 0  # decode pulled KV, did not prefill


async def test_answers_match_the_aggregated_path_token_for_token(stack: Stack) -> None:
    client = await pd_stack(stack)
    render = await stack.render()
    aggregated = await stack.engine("both", engine("both"))
    other = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(aggregated)]})
    )
    pd = (await client.post("/v1/chat/completions", json=PLAIN)).json()
    local = (await other.post("/v1/chat/completions", json=PLAIN)).json()
    assert pd["choices"][0]["message"] == local["choices"][0]["message"]
    assert pd["usage"] == local["usage"]


async def test_route3_render_and_one_pool(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]})
    )
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert answer["choices"][0]["message"]["tool_calls"]
    events = await sse_events(client, PLAIN)
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_route2_openai_pd_and_route4_aggregated(stack: Stack, request_path: str) -> None:
    prefill = await stack.engine("prefill", engine("prefill", api="openai"))
    decode = await stack.engine("decode", engine("decode", api="openai"))
    data_plane = request_path == "dataplane"
    client = await stack.gateway(
        routing(
            "openai", render=False, endpoints={"prefill": [ep(prefill)], "decode": [ep(decode)]}
        ),
        data_plane=data_plane,
    )
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "kv_transfer_params" not in answer
    assert stack.engines["decode"].core.prefix_queries == 0
    events = await sse_events(client, PLAIN)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    # The streamed P/D request taught Auto mode this KV path's handoff time, in any mode.
    await stack.fold_stats()
    assert (await client.get("/status")).json()["handoffSecondsPerToken"] > 0
    assert (
        'pdserve_gateway_stage_seconds_count{stage="kv_handoff"} 1.0'
        in (await client.get("/metrics")).text
    )

    aggregated = await stack.gateway(
        routing(
            "openai",
            render=False,
            mode="Aggregated",
            endpoints={"prefill": [ep(prefill)], "decode": [ep(decode)]},
        ),
        data_plane=data_plane,
    )
    before = stack.engines["decode"].core.prefix_queries
    assert (await aggregated.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.engines["decode"].core.prefix_queries > before  # prefilled on decode itself


async def test_n_choices_stream_and_not(stack: Stack) -> None:
    client = await pd_stack(stack)
    body = {**PLAIN, "n": 2, "seed": 3}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    events = await sse_events(client, body)
    assert events[-1] == "[DONE]"
    by_index: dict[int, str] = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content") or ""
    assert by_index[0] == answer["choices"][0]["message"]["content"]
    assert by_index[1] == answer["choices"][1]["message"]["content"]
