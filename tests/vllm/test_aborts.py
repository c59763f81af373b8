"""A client that leaves stops the engine's work, on both routes, streamed or not: the engine
stops the request, unfinished, long before the 2,000 tokens it was asked for (vLLM 0.32's
scale-out engines name tokens requests `generate-tokens-<id>` and have no legacy
/abort_requests; the OpenAI route aborts by closing the upstream connection)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.chat_cases import long_answer
from tests.support.real_stack import GatewayUnderTest, assert_left_work_is_aborted, gateway_over
from tests.support.real_vllm import VllmServer, engine_counts


@pytest.fixture(params=["render", "openai"])
async def route(
    request: pytest.FixtureRequest, render: VllmServer, engine: VllmServer
) -> AsyncIterator[GatewayUnderTest]:
    if request.param == "render":
        gateway = gateway_over(render=render.url, decode=[engine.url])
    else:
        gateway = gateway_over(decode=[engine.url], engine_api="openai")
    async with gateway as under_test:
        yield under_test


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_leaves_stops_the_engine(
    stream: bool, route: GatewayUnderTest, engine: VllmServer
) -> None:
    await assert_left_work_is_aborted(route, long_answer(), stream=stream, engine=engine)
    assert engine_counts(engine).get("running") == 0
