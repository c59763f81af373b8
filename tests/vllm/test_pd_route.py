"""Prefill -> decode between two real vLLM engines over NIXL (UCX on loopback, KV blocks in CPU
memory) behind the gateway, driven with the OpenAI SDK: greedy answers token-identical to
aggregated vLLM and to local prefill on the same decode engine, over the render route and the
OpenAI route; the KV really moves (decode's NIXL transfer count); a conversation's second turn
reuses what decode holds of the first (bidirectional KV); a client that leaves aborts the work.

The render server and the pair run the command lines the operator builds for a CPU model
(tiny_pd_model), for this module only: an idle NIXL engine keeps a core busy polling."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from pdserve.api import DisaggregatedModel
from pdserve.gateway.dataplane import build_binary
from tests.support.chat_cases import CHAT_CASES, STREAM_CASES, long_answer, request
from tests.support.operator_commands import pod_commands, routing_config
from tests.support.real_stack import (
    GatewayUnderTest,
    assert_left_work_is_aborted,
    chat_answer,
    chat_stream_answer,
    data_plane_stats,
    gateway_over,
    pretty,
    table_routes,
)
from tests.support.real_vllm import (
    VllmProcesses,
    VllmServer,
    engine_counts,
    tiny_cpu_engine,
    tiny_cpu_model,
)

PD_CASES = ["reasoning", "tools-auto", "tools-required", "stop-string", "structured-output",
            "logprobs", "length"]  # fmt: skip
PD_STREAM_CASES = [case for case in STREAM_CASES if case in ("reasoning", "tools-auto", "length")]


def tiny_pd_model(model: Path) -> DisaggregatedModel:
    """A CPU DisaggregatedModel as a user would write one for vLLM's CPU build: the engines'
    CPU settings in extraArgs and env, KV buffered in CPU memory, bidirectional KV."""
    engine = tiny_cpu_engine()
    return tiny_cpu_model("tiny-pd", model, {
        "model": {"maxModelLen": 2048},
        "serving": {"reasoningParser": "qwen3", "toolCallParser": "hermes",
                    "enableAutoToolChoice": True},
        "prefill": engine,
        "decode": engine,
        "kvTransfer": {"bidirectional": True, "kvBufferDevice": "cpu"},
        "gateway": {"routing": {"mode": "Disaggregated"}},
    })  # fmt: skip


class Pair:
    def __init__(self, dm: DisaggregatedModel, servers: dict[str, VllmServer]) -> None:
        self.config = routing_config(dm)
        self.render = servers["render"]
        self.prefill = servers["prefill"]
        self.decode = servers["decode"]


@pytest.fixture(scope="module")
def pair(vllm_processes: VllmProcesses, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Render, prefill and decode started with the command lines the operator builds for
    tiny_pd_model (only the pod's IP and ports replaced for one host)."""
    dm = tiny_pd_model(vllm_processes.model)
    procs = VllmProcesses(
        vllm_processes.env, vllm_processes.model, tmp_path_factory.mktemp("vllm-pd-logs")
    )
    with procs.serving_pods(pod_commands(dm)) as servers:
        yield Pair(dm, servers)


@pytest.fixture
async def pd_render_route(pair: Pair) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        render=pair.render.url, prefill=[pair.prefill.url], decode=[pair.decode.url],
        operator_config=pair.config,
    ) as gateway:  # fmt: skip
        yield gateway


@pytest.fixture(params=["python", "dataplane"])
async def bidirectional_route(
    request: pytest.FixtureRequest, pair: Pair
) -> AsyncIterator[GatewayUnderTest]:
    """The render route on either request path: the Python gateway's, or the compiled data
    plane's (the default), which keeps bidirectional KV itself."""
    async with gateway_over(
        render=pair.render.url, prefill=[pair.prefill.url], decode=[pair.decode.url],
        operator_config=pair.config,
        data_plane=build_binary() if request.param == "dataplane" else None,
    ) as gateway:  # fmt: skip
        if request.param == "dataplane":
            await table_routes(gateway, "pd")
        yield gateway


@pytest.fixture
async def local_prefill_route(pair: Pair) -> AsyncIterator[GatewayUnderTest]:
    """The same decode engine prefilling for itself (no prefill pool)."""
    async with gateway_over(render=pair.render.url, decode=[pair.decode.url]) as gateway:
        yield gateway


@pytest.fixture
async def pd_openai_route(pair: Pair) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        prefill=[pair.prefill.url], decode=[pair.decode.url], engine_api="openai",
        operator_config=pair.config,
    ) as gateway:  # fmt: skip
        yield gateway


async def fallbacks(gateway: GatewayUnderTest) -> float:
    """Requests the gateway served by local prefill because P/D failed."""
    await gateway.folded()
    return sum(
        sample.value
        for metric in gateway.gateway.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "pdserve_gateway_fallbacks_total"
    )


@pytest.mark.parametrize("case", PD_CASES)
@pytest.mark.parametrize("route", ["render", "openai"])
async def test_pd_answers_what_aggregated_vllm_answers(
    case: str, route: str, pair: Pair, pd_render_route: GatewayUnderTest,
    pd_openai_route: GatewayUnderTest, local_prefill_route: GatewayUnderTest,
    reference: AsyncOpenAI,
) -> None:  # fmt: skip
    gateway = pd_render_route if route == "render" else pd_openai_route
    body = request(CHAT_CASES[case])
    expected = chat_answer(await reference.chat.completions.create(**body))
    transfers = engine_counts(pair.decode).get("kv_transfers", 0.0)
    got = chat_answer(await gateway.client.chat.completions.create(**body))
    assert got == expected, f"P/D ({route} route):\n{pretty(got)}\nvLLM:\n{pretty(expected)}"
    assert await fallbacks(gateway) == 0, "the gateway fell back to local prefill"
    assert engine_counts(pair.decode).get("kv_transfers", 0.0) > transfers, (
        "decode pulled no KV from prefill: the answer was not disaggregated"
    )
    local = chat_answer(await local_prefill_route.client.chat.completions.create(**body))
    assert local == expected, f"local prefill:\n{pretty(local)}\nvLLM:\n{pretty(expected)}"


@pytest.mark.parametrize("case", PD_STREAM_CASES)
async def test_streamed_pd_answers_what_aggregated_vllm_answers(
    case: str, pair: Pair, pd_render_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    body = {**request(CHAT_CASES[case]), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    expected = chat_stream_answer(
        [c async for c in await reference.chat.completions.create(**body)]
    )
    transfers = engine_counts(pair.decode).get("kv_transfers", 0.0)
    stream = await pd_render_route.client.chat.completions.create(**body)
    got = chat_stream_answer([chunk async for chunk in stream])
    assert got == expected, f"P/D stream:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"
    assert await fallbacks(pd_render_route) == 0, "the gateway fell back to local prefill"
    assert engine_counts(pair.decode).get("kv_transfers", 0.0) > transfers


# Longer than a KV block (128 tokens on the CPU backend): reuse starts at a whole block.
SYSTEM = " ".join(["You answer questions about the weather in a city, briefly and politely."] * 12)


async def test_a_second_turn_reuses_decodes_kv_of_the_first(
    bidirectional_route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    turn = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the answer?"}]  # fmt: skip
    headers = {"X-Conversation-Id": "conversation-1"}
    first = await bidirectional_route.client.chat.completions.create(
        **request({"messages": turn, **no_thinking}), extra_headers=headers
    )
    turn += [{"role": "assistant", "content": first.choices[0].message.content or ""},
             {"role": "user", "content": "What is the weather in Paris?"}]  # fmt: skip
    body = request({"messages": turn, **no_thinking})
    expected = chat_answer(await reference.chat.completions.create(**body))
    second = await bidirectional_route.client.chat.completions.create(**body, extra_headers=headers)
    got = chat_answer(second)
    await bidirectional_route.folded()
    registry = bidirectional_route.gateway.metrics.registry
    outcome = {
        sample.labels["outcome"]: sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "pdserve_gateway_bidirectional_reuse_total"
    }
    assert outcome.get("reused") == 1, f"second turn's reuse outcome: {outcome}"
    reused = registry.get_sample_value("pdserve_gateway_bidirectional_reused_tokens_total")
    assert reused is not None
    assert reused >= 128
    assert got == expected, f"second turn:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"
    assert await fallbacks(bidirectional_route) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_leaves_stops_both_engines(
    stream: bool, pair: Pair, pd_render_route: GatewayUnderTest
) -> None:
    await assert_left_work_is_aborted(
        pd_render_route, long_answer(), stream=stream, engine=pair.decode
    )
    assert engine_counts(pair.prefill).get("running") == 0


async def test_auto_mode_on_the_data_plane_disaggregates_over_real_nixl(
    pair: Pair, reference: AsyncOpenAI
) -> None:
    """Routing mode Auto decided in the compiled data plane, over the real pair: a long prompt
    while decode is busy goes P/D (decode pulls its KV over NIXL) and answers what aggregated
    vLLM answers; nothing is handed to the Python gateway."""
    auto = {**pair.config, "routing": {**pair.config["routing"], "mode": "Auto"}}
    document = request(
        {
            "max_tokens": 16,
            "messages": [
                {
                    "role": "user",
                    "content": (
                        "Summarize in one line: "
                        + "The weather is mild today and the wind is calm. " * 50
                    ),
                }
            ],
        }
    )
    expected = chat_answer(await reference.chat.completions.create(**document))
    async with gateway_over(
        prefill=[pair.prefill.url], decode=[pair.decode.url], engine_api="openai",
        operator_config=auto, data_plane=build_binary(),
    ) as gateway:  # fmt: skip
        await table_routes(gateway, "auto")
        # Counted before decode is busy: its 2,000 tokens take seconds, a scrape of a busy
        # engine's /metrics as long (the long prompt must be decided while it runs).
        transfers = engine_counts(pair.decode).get("kv_transfers", 0.0)
        # A short prompt prefills on decode (short_prompt), and keeps it busy with its answer.
        held = await gateway.client.chat.completions.create(**{**long_answer(), "stream": True})
        await anext(aiter(held))
        got = chat_answer(await gateway.client.chat.completions.create(**document))
        await held.close()  # the client leaves: its work is aborted
        assert got == expected, f"Auto P/D:\n{pretty(got)}\nvLLM:\n{pretty(expected)}"
        stats = await data_plane_stats(gateway)
        seen = {key: stats.get(key) for key in ("routes", "fallbacks", "localPrefill")}
        assert engine_counts(pair.decode).get("kv_transfers", 0.0) > transfers, (
            "decode pulled no KV from prefill: Auto did not disaggregate the long prompt: "
            f"{seen}, decisions {stats['auto']['decisions']}"
        )
        assert stats["fallbacks"] == {}, stats
        assert (stats["routes"]["pd"], stats["routes"]["decode"]) == (1, 1), stats["routes"]
        assert stats["auto"]["decisions"] == {"short_prompt": 1, "long_prompt": 1}, stats["auto"]
