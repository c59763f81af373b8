"""The simulator follows real vLLM: the same requests go to real vLLM (`vllm launch render` and
`vllm serve --enable-scale-out`) and to pdserve's simulated render server and engine, and the
answers must have the same shape, field by field (keys, value types, SSE framing, error status
and body, the metric names pdserve reads). Values differ (a simulated model is not the tiny
one); what the gateway and clients read must not. A difference the simulator keeps on purpose
is listed in KNOWN with its reason, so a new one fails here and a fixed one too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig, RenderServer
from pdserve.vllm import metrics
from pdserve.vllm.protocol import GENERATE_PATH, derender_body, derender_path, render_path
from tests.support.chat_cases import ANSWER, TOOLS, WEATHER
from tests.support.real_vllm import SERVED_NAME, VllmServer
from tests.support.serving import serving
from tests.support.wire_shape import differences, shape, sse_events, stream_parts


@dataclass
class Stack:
    render: httpx.AsyncClient
    engine: httpx.AsyncClient


@pytest.fixture
async def real(render: VllmServer, engine: VllmServer) -> AsyncIterator[Stack]:
    async with (
        httpx.AsyncClient(base_url=render.url, timeout=60) as to_render,
        httpx.AsyncClient(base_url=engine.url, timeout=60) as to_engine,
    ):
        yield Stack(to_render, to_engine)


@pytest.fixture
async def sim() -> AsyncIterator[Stack]:
    """The simulator as the operator's sim example runs it: the same parsers as the real
    render server, an engine with the scale-out API."""
    text = RenderConfig(served_model_name=SERVED_NAME, max_model_len=2048,
                        reasoning_parser="qwen3", tool_call_parser="hermes",
                        enable_auto_tool_choice=True)  # fmt: skip
    engine = EngineConfig(served_model_name=SERVED_NAME, api="scale_out", max_model_len=2048,
                          scheduler=SchedulerConfig(time_scale=0.01), render=text,
                          behaviour=ModelBehaviour(reasoning=True))  # fmt: skip
    async with AsyncExitStack() as stack:
        render_url = await stack.enter_async_context(serving(RenderServer(text).app()))
        engine_url = await stack.enter_async_context(serving(EngineServer(engine).app()))
        to_render = await stack.enter_async_context(httpx.AsyncClient(base_url=render_url))
        to_engine = await stack.enter_async_context(httpx.AsyncClient(base_url=engine_url))
        yield Stack(to_render, to_engine)


CHAT = {"model": SERVED_NAME, "messages": ANSWER, "max_tokens": 30, "temperature": 0}
TOOL_CHAT = {**CHAT, "messages": WEATHER, "tools": TOOLS, "tool_choice": "auto"}
COMPLETION = {"model": SERVED_NAME, "prompt": "The weather in", "max_tokens": 8,
              "temperature": 0}  # fmt: skip


Answer = tuple[dict[str, Any], Any]  # (facts compared by value, a body compared by shape)


async def chat_render(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    answer = await stack.render.post(render_path(True), json=body)
    assert answer.status_code == 200, answer.text
    generate: dict[str, Any] = answer.json()
    generate["request_id"] = "contract-1"
    return generate


def whole(answer: httpx.Response) -> Answer:
    return {"status": answer.status_code}, answer.json()


def streamed(answer: httpx.Response) -> Answer:
    framing, chunks = stream_parts(sse_events(answer.text))
    return {"status": answer.status_code, **framing}, chunks


async def render_answer(stack: Stack) -> Answer:
    return whole(await stack.render.post(render_path(True), json=TOOL_CHAT))


async def completion_render_answer(stack: Stack) -> Answer:
    return whole(await stack.render.post(render_path(False), json=COMPLETION))


async def generate_answer(stack: Stack) -> Answer:
    generate = await chat_render(stack, CHAT)
    return whole(await stack.engine.post(GENERATE_PATH, json=generate))


async def generate_stream(stack: Stack) -> Answer:
    generate = await chat_render(stack, CHAT)
    body = {**generate, "stream": True, "stream_options": {"include_usage": True}}
    return streamed(await stack.engine.post(GENERATE_PATH, json=body))


async def chat_derender_answer(stack: Stack) -> Answer:
    generate = await chat_render(stack, TOOL_CHAT)
    answer = (await stack.engine.post(GENERATE_PATH, json=generate)).json()
    body = derender_body(SERVED_NAME, answer, generate["token_ids"], TOOL_CHAT, chat=True)
    return whole(await stack.render.post(derender_path(True), json=body))


async def completion_derender_answer(stack: Stack) -> Answer:
    rendered = (await stack.render.post(render_path(False), json=COMPLETION)).json()
    generate = {**rendered[0], "request_id": "contract-2"}
    answer = (await stack.engine.post(GENERATE_PATH, json=generate)).json()
    body = derender_body(SERVED_NAME, answer, generate["token_ids"], COMPLETION, chat=False)
    return whole(await stack.render.post(derender_path(False), json=body))


async def engine_chat(stack: Stack) -> Answer:
    return whole(await stack.engine.post("/v1/chat/completions", json=TOOL_CHAT))


async def engine_chat_stream(stack: Stack) -> Answer:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    return streamed(await stack.engine.post("/v1/chat/completions", json=body))


async def engine_completion(stack: Stack) -> Answer:
    return whole(await stack.engine.post("/v1/completions", json=COMPLETION))


async def models(stack: Stack) -> Answer:
    render, engine = await stack.render.get("/v1/models"), await stack.engine.get("/v1/models")
    return ({"status": (render.status_code, engine.status_code)},
            {"render": render.json(), "engine": engine.json()})  # fmt: skip


def error(target: str, path: str, body: dict[str, Any]) -> Callable[[Stack], Awaitable[Answer]]:
    async def send(stack: Stack) -> Answer:
        return whole(await getattr(stack, target).post(path, json=body))

    return send


EXCHANGES: dict[str, Callable[[Stack], Awaitable[Answer]]] = {
    "chat render": render_answer,
    "completions render": completion_render_answer,
    "generate": generate_answer,
    "generate, streamed": generate_stream,
    "chat derender": chat_derender_answer,
    "completions derender": completion_derender_answer,
    "engine chat": engine_chat,
    "engine chat, streamed": engine_chat_stream,
    "engine completions": engine_completion,
    "models": models,
    "error: unknown model (render)": error("render", render_path(True),
                                           {**CHAT, "model": "no-such-model"}),
    "error: unknown model (engine)": error("engine", "/v1/chat/completions",
                                           {**CHAT, "model": "no-such-model"}),
    "error: negative max_tokens (render)": error("render", render_path(True),
                                                 {**CHAT, "max_tokens": -1}),
    "error: generate without token ids": error("engine", GENERATE_PATH,
                                               {"model": SERVED_NAME, "sampling_params": {}}),
}  # fmt: skip

# What the simulator leaves out or adds on purpose, per exchange: path -> why. The gateway
# forwards render's sampling_params to the engines untouched and reads none of these fields.
_SIM_SAMPLING = "the simulator's render writes every sampling parameter; vLLM leaves defaults out"
_VLLM_SAMPLING = "vLLM's engine-internal sampling fields; the simulated engine needs none"
_RENDER_DIFFERENCES = {
    **{f"only in sim: sampling_params.{key}": _SIM_SAMPLING
       for key in ("ignore_eos", "include_stop_str_in_output", "min_p", "min_tokens", "n",
                   "top_k", "top_p")},
    **{f"only in vLLM: sampling_params.{key}": _VLLM_SAMPLING
       for key in ("output_kind", "skip_clone", "skip_reading_prefix_cache")},
    "only in vLLM: output_mode": "the simulated engine answers tokens whatever it is asked",
}  # fmt: skip
_FINGERPRINT = "vLLM's build id; no client reads it"
_REASONING_TOKENS = (
    "vLLM counts reasoning tokens in usage; the gateway passes usage through as the engine or "
    "derender gives it"
)
KNOWN: dict[str, dict[str, str]] = {
    "chat render": {
        **_RENDER_DIFFERENCES,
        "only in vLLM: reasoning_ended": "vLLM's parser state for the engine; not read",
        "only in vLLM: reasoning_parser_kwargs": "vLLM's parser state for the engine; not read",
    },
    "completions render": {
        **{path.replace(": ", ": [].", 1): why for path, why in _RENDER_DIFFERENCES.items()},
        "only in sim: [].sampling_params.skip_special_tokens": _SIM_SAMPLING,
    },
    "generate": {"only in vLLM: choices[].weight_versions": "vLLM's weight-update bookkeeping"},
    "engine chat": {
        "only in vLLM: system_fingerprint": _FINGERPRINT,
        "only in vLLM: usage.completion_tokens_details": _REASONING_TOKENS,
    },
    "engine chat, streamed": {
        "only in vLLM: [].system_fingerprint": _FINGERPRINT,
        "only in vLLM: [].usage.completion_tokens_details": _REASONING_TOKENS,
        # A value, not a shape: 30 tokens of the sim's reasoning never reach the answer.
        "only in vLLM: [].choices[].delta.content": "the simulated answer is all reasoning",
    },
    "engine completions": {"only in vLLM: system_fingerprint": _FINGERPRINT},
    "models": {
        "only in vLLM: engine.data[].permission": "OpenAI's legacy permission list; not read",
        "only in vLLM: render.data[].permission": "OpenAI's legacy permission list; not read",
    },
}


@pytest.mark.parametrize("exchange", EXCHANGES)
async def test_the_simulator_answers_in_vllms_shape(exchange: str, real: Stack, sim: Stack) -> None:
    send = EXCHANGES[exchange]
    (real_facts, real_body), (sim_facts, sim_body) = await send(real), await send(sim)
    assert sim_facts == real_facts, f"{exchange}: vLLM {real_facts}, sim {sim_facts}"
    found = differences(shape(real_body), shape(sim_body))
    known = KNOWN.get(exchange, {})
    assert sorted(found) == sorted(known), (
        f"{exchange}: the simulator's answer differs from vLLM's\n"
        f"new: {sorted(set(found) - set(known))}\ngone: {sorted(set(known) - set(found))}\n"
        f"vLLM: {json.dumps(real_body)}\nsim: {json.dumps(sim_body)}"
    )


def metric_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


READ_BY_PDSERVE = {
    value for key, value in vars(metrics).items() if key.isupper() and isinstance(value, str)
}
# NIXL's metrics exist only on an engine with a KV connector (tests/vllm/test_pd_route.py).
NIXL = {name for name in READ_BY_PDSERVE if name.startswith("vllm:nixl_")}


async def test_the_simulator_exposes_the_metrics_pdserve_reads_as_vllm_names_them(
    real: Stack, sim: Stack
) -> None:
    for stack in (real, sim):  # labelled counters appear with their first request
        await generate_answer(stack)
    real_names = metric_names((await real.engine.get("/metrics")).text)
    sim_names = metric_names((await sim.engine.get("/metrics")).text)

    def exposed(names: set[str], metric: str) -> bool:
        samples = {metric, *metrics.counter_samples(metric), metrics.count(metric)}
        return bool(samples & names)

    missing_real = sorted(m for m in READ_BY_PDSERVE - NIXL if not exposed(real_names, m))
    missing_sim = sorted(m for m in READ_BY_PDSERVE - NIXL if not exposed(sim_names, m))
    assert missing_real == [], f"pdserve reads metrics vLLM 0.32 does not expose: {missing_real}"
    assert missing_sim == [], f"the simulator does not expose: {missing_sim}"
