"""P/D by data-parallel rank on real vLLM: a prefill engine running two data-parallel ranks
behind one API server (`--data-parallel-size 2`, the command line the operator builds for a
pool with dataParallelSize 2) hands its KV over NIXL to a decode engine, behind the gateway,
which pins every prefill to one rank with vLLM's X-data-parallel-rank header. Greedy answers
are those of aggregated vLLM; distinct prompts reach both ranks; a repeated prompt goes back to
the rank that cached it (its own prefix cache hits); decode pulls from whichever rank prefilled
(NIXL's side channel at base port + rank).

What runs only on GPUs is not here: ranks over nodes (hybrid load balancing), expert parallelism
(the tiny model is dense: vLLM runs its ranks as independent engines)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping

import httpx
import pytest
from openai import AsyncOpenAI

from pdserve.api import DisaggregatedModel
from pdserve.vllm.metrics import PREFIX_CACHE_HITS, PROMPT_TOKENS, counter_samples, sum_samples
from tests.support.chat_cases import CHAT_CASES, request
from tests.support.operator_commands import pod_commands, routing_config
from tests.support.real_stack import GatewayUnderTest, chat_answer, gateway_over, pretty
from tests.support.real_vllm import (
    VllmProcesses,
    VllmServer,
    engine_counts,
    tiny_cpu_engine,
    tiny_cpu_model,
)

RANKS = 2


def tiny_dp_model(model: str) -> DisaggregatedModel:
    """Prefill with two data-parallel ranks in its pod (engine cores in their own processes:
    vLLM runs data parallelism only so), decode with one; KV over NIXL in CPU memory."""
    return tiny_cpu_model("tiny-dp", model, {
        "model": {"maxModelLen": 2048},
        "serving": {"reasoningParser": "qwen3", "toolCallParser": "hermes",
                    "enableAutoToolChoice": True},
        "prefill": {**tiny_cpu_engine(one_process=False), "dataParallelSize": RANKS},
        "decode": tiny_cpu_engine(),
        "kvTransfer": {"kvBufferDevice": "cpu"},
        "gateway": {"routing": {"mode": "Disaggregated"}},
    })  # fmt: skip


class Group:
    def __init__(self, dm: DisaggregatedModel, servers: Mapping[str, VllmServer]) -> None:
        self.config = routing_config(dm)
        self.render, self.prefill = servers["render"], servers["prefill"]
        self.decode = servers["decode"]


@pytest.fixture(scope="module")
def group(
    vllm_processes: VllmProcesses, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Group]:
    dm = tiny_dp_model(str(vllm_processes.model))
    procs = VllmProcesses(
        vllm_processes.env, vllm_processes.model, tmp_path_factory.mktemp("vllm-dp-logs")
    )
    with procs.serving_pods(pod_commands(dm)) as servers:
        yield Group(dm, servers)


@pytest.fixture
async def route(group: Group) -> AsyncIterator[GatewayUnderTest]:
    async with gateway_over(
        render=group.render.url, prefill=[group.prefill.url], decode=[group.decode.url],
        operator_config=group.config, load_scrape_seconds=None,
    ) as gateway:  # fmt: skip
        yield gateway


def per_rank(server: VllmServer, metric: str) -> list[float]:
    """A counter of the engine's /metrics per data-parallel rank (its `engine` label)."""
    names = counter_samples(metric)
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    totals = sum_samples(text, lambda name, labels: labels.get("engine") if name in names else None)
    return [totals.get(str(rank), 0.0) for rank in range(RANKS)]


def test_the_operator_routes_each_rank_of_the_prefill_pods(group: Group) -> None:
    assert group.config["pools"]["prefill"]["dataParallelLocal"] == RANKS
    assert "dataParallelLocal" not in group.config["pools"]["decode"]


async def test_pd_by_rank_answers_what_aggregated_vllm_answers(
    group: Group, route: GatewayUnderTest, reference: AsyncOpenAI
) -> None:
    transfers = engine_counts(group.decode).get("kv_transfers", 0.0)
    before = per_rank(group.prefill, PROMPT_TOKENS)
    bodies = [request(CHAT_CASES[case]) for case in ("reasoning", "tools-auto", "length")]
    expected = [chat_answer(await reference.chat.completions.create(**b)) for b in bodies]
    got = await asyncio.gather(*(route.client.chat.completions.create(**b) for b in bodies))
    for answer, wanted in zip(got, expected, strict=True):
        assert chat_answer(answer) == wanted, f"P/D:\n{pretty(chat_answer(answer))}"
    after = per_rank(group.prefill, PROMPT_TOKENS)
    assert all(a > b for a, b in zip(after, before, strict=True)), (
        f"prompt tokens per prefill rank {before} -> {after}: both ranks should have prefilled"
    )
    assert engine_counts(group.decode).get("kv_transfers", 0.0) >= transfers + len(bodies)


async def test_the_rank_the_gateway_picks_is_the_rank_that_prefills(
    group: Group, route: GatewayUnderTest
) -> None:
    # Rank 0 looks busy to the gateway: every request goes to rank 1, where vLLM's own balancer
    # (idle ranks, ties rotating) would have sent some to rank 0.
    route.gateway.endpoints.pools["prefill"][0].running = 50
    await route.pushed()
    before = per_rank(group.prefill, PROMPT_TOKENS)
    for city in ("Lima", "Quito", "Bogota"):
        body = request({"messages": [{"role": "user", "content": f"Weather in {city}?"}]})
        await route.client.chat.completions.create(**body)
    after = per_rank(group.prefill, PROMPT_TOKENS)
    assert after[0] == before[0], f"prompt tokens per rank {before} -> {after}"
    assert after[1] > before[1]


# Longer than a KV block (128 tokens on the CPU backend): a hit is at least one whole block.
SYSTEM = " ".join(["You answer questions about the weather in a city, briefly and politely."] * 12)


async def test_a_repeated_prompt_goes_back_to_the_rank_that_cached_it(
    group: Group, route: GatewayUnderTest
) -> None:
    body = request({"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "And in Oslo?"}]})  # fmt: skip
    cold_start = per_rank(group.prefill, PROMPT_TOKENS)
    await route.client.chat.completions.create(**body)
    hits = per_rank(group.prefill, PREFIX_CACHE_HITS)
    tokens = per_rank(group.prefill, PROMPT_TOKENS)
    # Make the warm rank the busier one, within the slack: load alone would move the request.
    targets = route.gateway.endpoints.pools["prefill"]
    served = [rank for rank in range(RANKS) if tokens[rank] > cold_start[rank]]
    assert len(served) == 1, (cold_start, tokens)
    targets[served[0]].running = 2
    await route.pushed()
    await route.client.chat.completions.create(**body)
    after_tokens = per_rank(group.prefill, PROMPT_TOKENS)
    warm, cold = served[0], 1 - served[0]
    assert after_tokens[cold] == tokens[cold], (
        f"the other rank prefilled the repeated prompt: prompt tokens per rank {tokens} -> "
        f"{after_tokens}"
    )
    # The API server counts a rank's prefix cache hits from the scheduler stats its engine core
    # sends, which can come after the answer: polled, with a deadline.
    deadline = time.monotonic() + 10
    while (after_hits := per_rank(group.prefill, PREFIX_CACHE_HITS))[warm] < hits[warm] + 128:
        assert time.monotonic() < deadline, f"prefix cache hits per rank {hits} -> {after_hits}"
        await asyncio.sleep(0.1)  # polling another process's counters, with a deadline
