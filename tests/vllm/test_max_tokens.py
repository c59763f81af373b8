"""The client's output limit through the render route on real vLLM: `vllm launch render` leaves
max_tokens out of the engine request it answers when it equals SamplingParams' default (16),
and `/inference/v1/generate` then resolves its own limit, the whole context left. A client's 16
must stay 16 whichever request path serves it (Python gateway or data plane), with the
gateway's --max-tokens-cap as with a client's own number; without any limit the answer must run
as far as vLLM's own chat endpoint lets it. ignore_eos keeps the tiny model from stopping
early, so the completion tokens are the limit the engine applied."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from pdserve.gateway.dataplane import build_binary
from tests.support.real_stack import GatewayUnderTest, data_plane_stats, gateway_over
from tests.support.real_vllm import SERVED_NAME, VllmServer

QUESTION: dict[str, Any] = {
    "model": SERVED_NAME,
    "messages": [{"role": "user", "content": "Count from one to one hundred."}],
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture(scope="module")
def data_plane() -> Path:
    return build_binary()


async def served(
    path: str, render: VllmServer, engine: VllmServer, data_plane: Path, **settings: Any
) -> AsyncIterator[GatewayUnderTest]:
    """The render route on `path`; on the data plane, every request served by it, the
    max-tokens cap's refusals and fill-ins included."""
    binary = data_plane if path == "data-plane" else None
    async with gateway_over(render=render.url, decode=[engine.url], data_plane=binary,
                            **settings) as gateway:  # fmt: skip
        yield gateway
        if binary is not None:
            stats = await data_plane_stats(gateway)
            assert stats["fallbacks"] == {}, stats
            assert stats["routes"]["render_decode"] >= 1


@pytest.fixture(params=["python", "data-plane"])
async def tokens_route(
    request: pytest.FixtureRequest, render: VllmServer, engine: VllmServer, data_plane: Path
) -> AsyncIterator[GatewayUnderTest]:
    async for gateway in served(str(request.param), render, engine, data_plane):
        yield gateway


@pytest.fixture(params=["python", "data-plane"])
async def capped_route(
    request: pytest.FixtureRequest, render: VllmServer, engine: VllmServer, data_plane: Path
) -> AsyncIterator[GatewayUnderTest]:
    async for gateway in served(str(request.param), render, engine, data_plane, max_tokens_cap=16):
        yield gateway


async def tokens_and_finish(client: AsyncOpenAI, body: dict[str, Any]) -> tuple[int, str]:
    answer = await client.chat.completions.create(**body)
    assert answer.usage is not None
    return answer.usage.completion_tokens, answer.choices[0].finish_reason


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_limit_of_16_is_the_engines_limit(
    field: str, tokens_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    body = {**QUESTION, field: 16}
    assert await tokens_and_finish(reference, body) == (16, "length")
    assert await tokens_and_finish(tokens_route.client, body) == (16, "length")


async def test_a_max_tokens_cap_of_16_is_the_engines_limit(capped_route: GatewayUnderTest) -> None:
    assert await tokens_and_finish(capped_route.client, QUESTION) == (16, "length")


async def test_without_a_limit_the_answer_runs_as_far_as_vllms_own(
    tokens_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    expected = await tokens_and_finish(reference, QUESTION)
    assert expected[1] == "length"
    assert await tokens_and_finish(tokens_route.client, QUESTION) == expected
