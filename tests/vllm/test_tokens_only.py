"""`vllm serve --tokens-only` engines behind the render route (spec.render.engineApi
TokensOnly): what they serve, the gateway answers as vLLM itself does; what they cannot serve
(stop strings, structured outputs, forced tool calls) the real engine refuses, and the gateway
refuses first, with a 400 naming the parameter and before any engine works on it; a client that
leaves stops the engine (tokens-only engines keep the legacy /abort_requests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from pdserve.gateway.dataplane import build_binary
from pdserve.vllm.protocol import GENERATE_PATH, render_path
from tests.support.chat_cases import CHAT_CASES, long_answer, request
from tests.support.real_stack import (
    GatewayUnderTest,
    assert_left_work_is_aborted,
    chat_answer,
    gateway_over,
    pretty,
)
from tests.support.real_vllm import VllmProcesses, VllmServer, engine_counts

SERVED = ["reasoning", "reasoning-off", "tools-auto", "logprobs", "length"]
REFUSED = {
    "stop-string": "stop",
    "structured-output": "response_format",
    "tools-required": "tool_choice",
    "tools-named": "tool_choice",
}


@pytest.fixture(scope="module")
def tokens_only(
    vllm_processes: VllmProcesses, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    procs = VllmProcesses(
        vllm_processes.env, vllm_processes.model, tmp_path_factory.mktemp("vllm-tokens-only")
    )
    try:
        server = procs.engine("tokens-only", mode="--tokens-only",
                              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
        procs.wait_ready()
        yield server
    finally:
        procs.stop()


@pytest.fixture
async def route(render: VllmServer, tokens_only: VllmServer) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        render=render.url, decode=[tokens_only.url], tokens_engines="tokens_only"
    ) as gateway:
        yield gateway


@pytest.fixture(params=["python", "data-plane"])
async def refusing_route(
    request: pytest.FixtureRequest, render: VllmServer, tokens_only: VllmServer
) -> AsyncIterator[GatewayUnderTest]:
    """The route on either request path: the data plane refuses these itself, or hands over
    what it cannot prove valid cheaply (response_format, a named tool choice)."""
    binary = build_binary() if request.param == "data-plane" else None
    async with gateway_over(
        render=render.url, decode=[tokens_only.url], tokens_engines="tokens_only",
        data_plane=binary,
    ) as gateway:  # fmt: skip
        yield gateway


@pytest.mark.parametrize("case", SERVED)
async def test_what_tokens_only_engines_serve_is_what_vllm_answers(
    case: str, route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    body = request(CHAT_CASES[case])
    expected = chat_answer(await reference.chat.completions.create(**body))
    got = chat_answer(await route.client.chat.completions.create(**body))
    assert got == expected, f"tokens-only:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"


@pytest.mark.parametrize("case", REFUSED)
async def test_what_they_cannot_serve_is_refused_naming_the_parameter(
    case: str, refusing_route: GatewayUnderTest, render: VllmServer, tokens_only: VllmServer
) -> None:
    body = request(CHAT_CASES[case])
    # The engine itself refuses the rendered request: the gateway's refusal is not a guess.
    plain = {key: value for key, value in body.items() if key != "extra_body"}
    async with httpx.AsyncClient(timeout=60) as client:
        rendered = (await client.post(f"{render.url}{render_path(True)}", json=plain)).json()
        rendered["request_id"] = f"refused-{case}"
        direct = await client.post(f"{tokens_only.url}{GENERATE_PATH}", json=rendered)
    assert direct.status_code == 400, direct.text
    before = engine_counts(tokens_only)
    with pytest.raises(BadRequestError) as caught:
        await refusing_route.client.chat.completions.create(**body)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error.get("param") == REFUSED[case], error
    assert "TokensOnly" in str(error.get("message")), error
    assert engine_counts(tokens_only).get("generated") == before.get("generated")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_leaves_stops_a_tokens_only_engine(
    stream: bool, route: GatewayUnderTest, tokens_only: VllmServer
) -> None:
    await assert_left_work_is_aborted(route, long_answer(), stream=stream, engine=tokens_only)
