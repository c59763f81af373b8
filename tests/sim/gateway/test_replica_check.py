"""The replica check: a render replica whose parsers differ from its group's never takes
traffic, and says why; every replica waits out of routing until checked; one that cannot be
checked is routed unchecked rather than taking the model down."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
from aiohttp import web

from pdserve.gateway.endpoints import Endpoint
from tests.support.serving import serving
from tests.support.sim_gateway import CHAT, PLAIN, RENDER, Stack, engine, ep, routing


def checked(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "replicaCheck": "Enforce"}


def served(stack: Stack) -> list[int]:
    """Chat renders each render replica answered (its request counter)."""
    return [
        int(
            sum(
                sample.value
                for metric in render.metrics.registry.collect()
                for sample in metric.samples
                if sample.name == "pdserve_sim_render_requests_total"
                and sample.labels.get("endpoint") == "/v1/chat/completions/render"
            )
        )
        for render in stack.renders
    ]


async def verdicts(client: httpx.AsyncClient) -> dict[str, dict[str, dict[str, str]]]:
    answer: dict[str, dict[str, dict[str, str]]] = (await client.get("/status")).json()[
        "replicaCheck"
    ]
    return answer


async def test_a_render_replica_with_another_reasoning_parser_never_takes_traffic(
    stack: Stack,
) -> None:
    good_a, good_b = await stack.render(), await stack.render()
    odd = await stack.render(dataclasses.replace(RENDER, reasoning_parser=None))
    decode = await stack.engine("both", engine("both"))
    render_eps = [ep(good_a) | {"name": "good-a"}, ep(odd) | {"name": "odd"},
                  ep(good_b) | {"name": "good-b"}]  # fmt: skip
    client = await stack.gateway(
        checked(routing(prefill=False, endpoints={"render": render_eps, "decode": [ep(decode)]}))
    )
    # Requests sent at once wait for the checks, then go to verified replicas only.
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=CHAT if i % 2 else PLAIN) for i in range(12))
    )
    assert [a.status_code for a in answers] == [200] * 12
    status = await verdicts(client)
    assert status["render"]["good-a"] == {"verdict": "Verified"}
    assert status["render"]["good-b"] == {"verdict": "Verified"}
    odd_verdict = status["render"]["odd"]
    assert odd_verdict["verdict"] == "Mismatch"
    assert odd_verdict["reason"].startswith(
        "derender content, derender reasoning differ from 2 other replica(s) of its render group"
    )
    assert status["decode"] == {decode.rstrip("/"): {"verdict": "Verified"}}
    counts = served(stack)
    # In the order started: the odd replica rendered its check alone; the good ones every
    # request, plus their checks.
    assert counts[2] == 1, counts
    assert counts[0] + counts[1] == 12 + 2, counts
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_replica_check{pool="render",replica="odd",verdict="Mismatch"} 1.0' in (
        metrics
    )


async def test_a_replica_is_routed_once_checked_and_a_tie_goes_to_the_first_checked(
    stack: Stack,
) -> None:
    """One good replica serving, then a disagreeing one added by discovery: the one checked
    first keeps the traffic (a tie), the newcomer is kept out."""
    good = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        checked(routing(prefill=False, endpoints={"render": [ep(good)], "decode": [ep(decode)]}))
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    odd = await stack.render(dataclasses.replace(RENDER, tool_call_parser=None,
                                                 enable_auto_tool_choice=False))  # fmt: skip
    endpoints = stack.gateway_server.endpoints
    endpoints.replace(
        "render", [*endpoints.pools["render"], Endpoint(odd.rstrip("/"), "p1", name="odd")]
    )
    assert not endpoints.pools["render"][1].routable  # out of routing until checked

    async def settled() -> dict[str, Any]:
        while (await verdicts(client))["render"]["odd"]["verdict"] == "Pending":  # noqa: ASYNC110 - polled with a deadline
            await asyncio.sleep(0.01)
        return (await verdicts(client))["render"]

    render = await asyncio.wait_for(settled(), 20)
    assert render[good.rstrip("/")] == {"verdict": "Verified"}
    assert render["odd"]["verdict"] == "Mismatch"
    # It refuses tool_choice auto (no tool parser): checked with none, which it does run, and
    # unlike its group it leaves the tool call in the content (the simulator also renders no
    # tools with none, vLLM does).
    differing = render["odd"]["reason"].split(" differ from 1 other replica(s)")[0].split(", ")
    assert {"derender content", "derender tool_calls", "tool choice"} <= set(differing)
    for _ in range(6):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert served(stack)[1] == 2  # its check alone: auto refused, then none


async def test_render_replicas_without_a_tool_parser_are_checked_with_tool_choice_none(
    stack: Stack,
) -> None:
    """A model served without tool calling: render refuses the check's tool_choice auto (400,
    as vLLM does without --enable-auto-tool-choice); checked with none instead, its replicas are
    verified, not left unchecked after the retries."""
    plain = dataclasses.replace(RENDER, tool_call_parser=None, enable_auto_tool_choice=False)
    renders = [ep(await stack.render(plain)) | {"name": f"r{i}"} for i in range(2)]
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        checked(routing(prefill=False, endpoints={"render": renders, "decode": [ep(decode)]}))
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    status = await verdicts(client)
    assert status["render"] == {"r0": {"verdict": "Verified"}, "r1": {"verdict": "Verified"}}


async def test_a_replica_that_cannot_be_checked_is_routed_unchecked(stack: Stack) -> None:
    """An older render server without /tokenize (404): routed, marked Unchecked."""
    real = await stack.render()

    async def no_tokenize(request: web.Request) -> web.StreamResponse:
        if request.path == "/tokenize":
            return web.Response(status=404)
        async with httpx.AsyncClient(base_url=real) as upstream:
            answer = await upstream.request(
                request.method, request.path, content=await request.read(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
        return web.Response(
            body=answer.content, status=answer.status_code, content_type="application/json"
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", no_tokenize)
    async with serving(app) as older:
        decode = await stack.engine("both", engine("both"))
        client = await stack.gateway(
            checked(
                routing(prefill=False, endpoints={"render": [ep(older)], "decode": [ep(decode)]})
            )
        )
        assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
        entry = (await verdicts(client))["render"][older.rstrip("/")]
        assert entry == {
            "verdict": "Unchecked",
            "reason": "it does not serve /tokenize (404)",
        }
