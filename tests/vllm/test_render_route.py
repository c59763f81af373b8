"""The render route against real vLLM: `vllm launch render` -> `vllm serve --enable-scale-out`
(prefill on decode) -> derender, driven with the OpenAI SDK, must answer what vLLM itself
answers for the same request (greedy, so token for token): content, reasoning, tool calls,
finish reasons and token counts, streamed or not, served by the Python gateway or by its
compiled data plane. The OpenAI route over the same engine is the other half of the
comparison."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, NotFoundError

from pdserve.gateway.dataplane import build_binary
from tests.support.chat_cases import CHAT_CASES, STREAM_CASES, request
from tests.support.real_stack import (
    GatewayUnderTest,
    chat_answer,
    chat_stream_answer,
    completion_answer,
    completion_stream_answer,
    data_plane_stats,
    gateway_over,
    pretty,
)
from tests.support.real_vllm import SERVED_NAME, VllmServer


@pytest.fixture(scope="module")
def data_plane() -> Path:
    return build_binary()


@pytest.fixture(params=["python", "data-plane"])
async def tokens_route(
    request: pytest.FixtureRequest, render: VllmServer, engine: VllmServer, data_plane: Path
) -> AsyncIterator[GatewayUnderTest]:
    """The render route served by the Python gateway, or by its data plane, which must have
    served or refused each request itself (a model it does not serve: its own 404; a body its
    cheap validation cannot prove valid, such as a named tool_choice, judged by the Python
    gateway's intake and then served by it; every stream here, stop strings included), never
    handed one over: a fallback after an engine refused its body would hide a wrong body
    behind the Python gateway's right answer."""
    binary = data_plane if request.param == "data-plane" else None
    async with gateway_over(render=render.url, decode=[engine.url], data_plane=binary) as gateway:
        yield gateway
        if binary is not None:
            stats = await data_plane_stats(gateway)
            assert stats["fallbacks"] == {}, stats
            served = stats["routes"]["render_decode"]
            refused = sum(c["count"] for c in stats["metrics"]["requests"]
                          if c["route"] == "unknown")  # fmt: skip
            assert served + refused + sum(stats["fallbacks"].values()) >= 1, stats


@pytest.fixture
async def openai_route(engine: VllmServer) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(decode=[engine.url], engine_api="openai") as gateway:
        yield gateway


@pytest.mark.parametrize("case", CHAT_CASES)
async def test_chat_over_render_matches_vllm(
    case: str, tokens_route: GatewayUnderTest, openai_route: GatewayUnderTest,
    reference: AsyncOpenAI,
) -> None:  # fmt: skip
    body = request(CHAT_CASES[case])
    expected = chat_answer(await reference.chat.completions.create(**body))
    via_render = chat_answer(await tokens_route.client.chat.completions.create(**body))
    via_openai = chat_answer(await openai_route.client.chat.completions.create(**body))
    assert via_render == expected, f"render route:\n{pretty(via_render)}\nvLLM:\n{pretty(expected)}"
    assert via_openai == expected, f"openai route:\n{pretty(via_openai)}\nvLLM:\n{pretty(expected)}"


@pytest.mark.parametrize("case", STREAM_CASES)
async def test_streamed_chat_over_render_matches_vllm(
    case: str, tokens_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    body = {**request(CHAT_CASES[case]), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    expected = chat_stream_answer(
        [c async for c in await reference.chat.completions.create(**body)]
    )
    stream = await tokens_route.client.chat.completions.create(**body)
    got = chat_stream_answer([chunk async for chunk in stream])
    assert got == expected, f"render route:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_completions_over_render_match_vllm(
    stream: bool, tokens_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": "The weather in the city",
                            "max_tokens": 12, "temperature": 0}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        expected = completion_stream_answer(
            [c async for c in await reference.completions.create(**body)]
        )
        got = completion_stream_answer(
            [c async for c in await tokens_route.client.completions.create(**body)]
        )
    else:
        expected = completion_answer(await reference.completions.create(**body))
        got = completion_answer(await tokens_route.client.completions.create(**body))
    assert got == expected, f"render route:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"


def stop_inside(text: str) -> str:
    """Three characters of a greedy answer, past its first few, where they first appear: a stop
    string the engine is sure to meet, completed by a token that may carry more text."""
    for start in range(3, len(text) - 3):
        stop = text[start : start + 3]
        if stop.strip() and text.find(stop) == start:
            return stop
    raise AssertionError(f"no stop string to take from {text!r}")


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_a_stream_ends_where_its_stop_string_starts_as_vllm_ends_it(
    api: str, tokens_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    """A stop string met mid-answer: the engine stops on the token that completes it and
    derender decodes that whole token, so the stream is cut where the stop string starts,
    across chunks, as `vllm serve` streams it (by the data plane itself on that path)."""
    if api == "completions":
        body: dict[str, Any] = {"model": SERVED_NAME, "prompt": "The weather in the city",
                                "max_tokens": 24, "temperature": 0}  # fmt: skip
        whole = (await reference.completions.create(**body)).choices[0].text
        create, answer = reference.completions.create, completion_stream_answer
        ours = tokens_route.client.completions.create
    else:
        body = request(CHAT_CASES["reasoning-off"]) | {"max_tokens": 24}
        whole = (await reference.chat.completions.create(**body)).choices[0].message.content
        create, answer = reference.chat.completions.create, chat_stream_answer  # type: ignore[assignment]
        ours = tokens_route.client.chat.completions.create  # type: ignore[assignment]
    stop = stop_inside(whole or "")
    body |= {"stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
    expected = answer([c async for c in await create(**body)])
    got = answer([c async for c in await ours(**body)])
    assert got == expected, (
        f"stop {stop!r} in {whole!r}; render route:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"
    )
    finished = expected["choices"][0]["finish_reason"]
    assert finished == "stop", pretty(expected)  # the stop string ended it, not the length


async def test_an_unknown_model_is_a_404_naming_it(tokens_route: GatewayUnderTest) -> None:
    with pytest.raises(NotFoundError) as caught:
        await tokens_route.client.chat.completions.create(
            model="no-such-model",
            messages=[{"role": "user", "content": "What is the answer?"}],
            max_tokens=5,
        )
    assert "no-such-model" in str(caught.value)
