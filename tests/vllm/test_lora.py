"""LoRA adapters (spec.model.adapters) served through the gateway over real vLLM, prefill and
decode disaggregated: a client that names an adapter in `model` gets, token for token, what
aggregated vLLM answers for that adapter (not the base model's answer, not another adapter's),
with the prompt's KV made on prefill and moved to decode over NIXL; the base
model over the same engines still answers as vLLM does; an unknown name is a 404 naming it; and
/v1/models lists the adapters under the model as vLLM lists them. The gateway's data plane
serves every one of these requests itself.

Two adapters are made here (tests/support/lora_adapter.py, different seeds) in a directory that
stands for their PersistentVolumeClaim. The render server, the prefill/decode pair and the
aggregated reference engine run the command lines the operator builds for them
(tests/support/operator_commands.py maps the claim's mounts to that directory).

Requests go one at a time: vLLM's CPU LoRA kernels apply an adapter to base-model requests
batched with LoRA ones (the torch ops index slot -1, the last adapter), so only serialized
answers are vLLM's real ones."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, NotFoundError
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.api import DisaggregatedModel
from pdserve.gateway.dataplane import build_binary
from tests.support.lora_adapter import RANK, make_lora_adapter
from tests.support.operator_commands import pod_commands, routing_config
from tests.support.real_stack import (
    GatewayUnderTest,
    chat_answer,
    chat_stream_answer,
    completion_answer,
    completion_stream_answer,
    data_plane_stats,
    gateway_over,
    pretty,
    table_routes,
)
from tests.support.real_vllm import (
    SERVED_NAME,
    VllmProcesses,
    VllmServer,
    engine_counts,
    tiny_cpu_engine,
    tiny_cpu_model,
)

ADAPTERS = {"lora-a": 0, "lora-b": 1}  # name -> seed of its random weights
CLAIM = "lora-adapters"
APIS = ["chat", "completions"]
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the answer?"}]
PROMPT = "The weather in the city"
MAX_TOKENS = 16
WITH_USAGE: ChatCompletionStreamOptionsParam = {"include_usage": True}


# The text side as a user sets it for this model's chat template (the gateway's replica check
# renders a conversation with a tool: a render server without a tool parser refuses it).
SERVING = {"reasoningParser": "qwen3", "toolCallParser": "hermes", "enableAutoToolChoice": True}


def model_with_adapters() -> dict[str, Any]:
    """spec.model: both adapters from one claim, each in its own directory."""
    return {
        "maxModelLen": 2048,
        "adapters": [{"name": name, "rank": RANK, "pvc": {"claimName": CLAIM, "path": name}}
                     for name in ADAPTERS],
    }  # fmt: skip


def tiny_lora_pd_model(model: Path) -> DisaggregatedModel:
    """The render pool, and prefill and decode pools moving KV over NIXL in CPU memory."""
    engine = tiny_cpu_engine()
    return tiny_cpu_model("tiny-lora", model, {
        "model": model_with_adapters(),
        "serving": SERVING,
        "prefill": engine,
        "decode": engine,
        "kvTransfer": {"kvBufferDevice": "cpu"},
        "gateway": {"routing": {"mode": "Disaggregated"}},
    })  # fmt: skip


def tiny_lora_aggregated_model(model: Path) -> DisaggregatedModel:
    """The same model and adapters served by one engine speaking OpenAI: the reference."""
    return tiny_cpu_model("tiny-lora-aggregated", model, {
        "model": model_with_adapters(),
        "serving": SERVING,
        "decode": tiny_cpu_engine(),
        "render": {"enabled": False},
    })  # fmt: skip


@dataclass
class LoraStack:
    config: dict[str, Any]  # the routing config the operator writes for tiny_lora_pd_model
    render: VllmServer
    prefill: VllmServer
    decode: VllmServer
    aggregated: VllmServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    """Only the processes this module needs (not the package's render and engine)."""
    env = ensure_vllm_cpu()
    model = ensure_tiny_model(env)
    claim = tmp_path_factory.mktemp("lora-claim")
    for name, seed in ADAPTERS.items():
        make_lora_adapter(claim / name, model, seed=seed)
    pd = tiny_lora_pd_model(model)
    pods = {
        **pod_commands(pd, {CLAIM: claim}),
        "aggregated": pod_commands(tiny_lora_aggregated_model(model), {CLAIM: claim})["decode"],
    }
    procs = VllmProcesses(env, model, tmp_path_factory.mktemp("vllm-lora-logs"))
    with procs.serving_pods(pods) as servers:
        yield LoraStack(
            routing_config(pd), servers["render"], servers["prefill"], servers["decode"],
            servers["aggregated"],
        )  # fmt: skip


@pytest.fixture
async def gateway(stack: LoraStack) -> AsyncIterator[GatewayUnderTest]:
    """The gateway over the pair through its compiled data plane, which must have served or
    refused every request itself, never handed one to the Python gateway."""
    async with gateway_over(
        render=stack.render.url, prefill=[stack.prefill.url], decode=[stack.decode.url],
        operator_config=stack.config, data_plane=build_binary(),
    ) as gateway:  # fmt: skip
        await table_routes(gateway, "pd")
        yield gateway
        stats = await data_plane_stats(gateway)
        assert stats["fallbacks"] == {}, stats


@pytest.fixture
async def aggregated(stack: LoraStack) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=f"{stack.aggregated.url}/v1", api_key="none", max_retries=0
    ) as client:
        yield client


async def answer(client: AsyncOpenAI, api: str, model: str, *, stream: bool) -> dict[str, Any]:
    """A greedy answer as a client reads it, with the `model` it names (each chunk's)."""
    return await (chat if api == "chat" else completion)(client, model, stream=stream)


async def chat(client: AsyncOpenAI, model: str, *, stream: bool) -> dict[str, Any]:
    create = client.chat.completions.create
    if stream:
        chunks = [chunk async for chunk in await create(
            model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            stream_options=WITH_USAGE)]  # fmt: skip
        return {**chat_stream_answer(chunks), "model": sorted({c.model for c in chunks})}
    whole = await create(model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
    return {**chat_answer(whole), "model": [whole.model]}


async def completion(client: AsyncOpenAI, model: str, *, stream: bool) -> dict[str, Any]:
    create = client.completions.create
    if stream:
        chunks = [chunk async for chunk in await create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            stream_options=WITH_USAGE)]  # fmt: skip
        return {**completion_stream_answer(chunks), "model": sorted({c.model for c in chunks})}
    whole = await create(model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    return {**completion_answer(whole), "model": [whole.model]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_an_adapter_over_pd_answers_what_aggregated_vllm_answers(
    adapter: str, api: str, stream: bool, stack: LoraStack, gateway: GatewayUnderTest,
    aggregated: AsyncOpenAI,
) -> None:  # fmt: skip
    """The adapters change v_proj, so the prompt's KV decode pulls is the adapter's own only if
    prefill ran under it too."""
    expected = await answer(aggregated, api, adapter, stream=stream)
    others = {name: await answer(aggregated, api, name, stream=stream)
              for name in (SERVED_NAME, *ADAPTERS) if name != adapter}  # fmt: skip
    transfers = engine_counts(stack.decode).get("kv_transfers", 0.0)
    routed = (await data_plane_stats(gateway))["routes"].get("render_pd", 0)
    got = await answer(gateway.client, api, adapter, stream=stream)
    assert got == expected, f"P/D:\n{pretty(got)}\naggregated vLLM:\n{pretty(expected)}"
    assert expected["model"] == [adapter], pretty(expected)
    for name, other in others.items():
        assert other["choices"] != expected["choices"], f"{adapter} answers as {name}: {other}"
    assert engine_counts(stack.decode).get("kv_transfers", 0.0) > transfers, (
        "decode pulled no KV from prefill: the answer was not disaggregated"
    )
    assert (await data_plane_stats(gateway))["routes"].get("render_pd", 0) == routed + 1


@pytest.mark.parametrize("api", APIS)
async def test_the_base_model_beside_the_adapters_answers_what_aggregated_vllm_answers(
    api: str, stack: LoraStack, gateway: GatewayUnderTest, aggregated: AsyncOpenAI
) -> None:
    expected = await answer(aggregated, api, SERVED_NAME, stream=False)
    transfers = engine_counts(stack.decode).get("kv_transfers", 0.0)
    got = await answer(gateway.client, api, SERVED_NAME, stream=False)
    assert got == expected, f"P/D:\n{pretty(got)}\naggregated vLLM:\n{pretty(expected)}"
    assert engine_counts(stack.decode).get("kv_transfers", 0.0) > transfers


async def test_an_unknown_model_is_a_404_naming_it(gateway: GatewayUnderTest) -> None:
    with pytest.raises(NotFoundError) as caught:
        await gateway.client.chat.completions.create(
            model="lora-c", messages=QUESTION, max_tokens=5
        )
    assert "lora-c" in caught.value.message
    assert caught.value.param == "model"


async def test_models_lists_the_adapters_under_the_model_as_vllm_does(
    gateway: GatewayUnderTest, aggregated: AsyncOpenAI
) -> None:
    listed = {m.id: m.model_dump().get("parent") async for m in gateway.client.models.list()}
    by_vllm = {m.id: m.model_dump().get("parent") async for m in aggregated.models.list()}
    assert listed == {SERVED_NAME: None, **dict.fromkeys(ADAPTERS, SERVED_NAME)}
    assert listed == by_vllm
