"""Prefill's KV lease on the gateway's own clock. vLLM's prefill engine answers with
remote_blocks_expiry_time null (and a decode engine's is on its own monotonic clock), so the
gateway times the routing config's lease from prefill's answer and checks it right before each
decode it sends to pull the KV: past the lease less the margin, decode prefills locally and
prefill is told to let the blocks go (fake upstream; one loopback pair for the retries)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.endpoints import Endpoints
from pdserve.gateway.errors import LeaseExpiring
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.settings import GatewaySettings
from pdserve.gateway.upstream import UpstreamClient
from tests.support.gateway_fakes import Rig, rig
from tests.support.serving import serving

# What vLLM's NixlConnector prefill answers: no expiry time at all (null).
KV = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [3, 4],
    "remote_request_id": "req-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_blocks_expiry_time": None,
}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
DONE = b"data: [DONE]\n"


def line(event: Any) -> bytes:
    return f"data: {json.dumps(event)}\n".encode()


def scripted(engine_api: str, stream: bool, **kv_transfer: Any) -> Rig:
    """A P/D route whose prefill answers KV; decode answers a whole reply, or a stream."""
    r = rig(engine_api, kv_transfer=kv_transfer)
    reply = {"index": 0, "message": {"role": "assistant", "content": "hello"}}
    answer = {"choices": [reply], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    r.upstream.script = {
        "render": [{"token_ids": list(range(1, 9)), "sampling_params": {"max_tokens": 5}}],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [
            {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]}
            if engine_api == "tokens"
            else answer
        ],
        "derender": [answer] if not stream else [{"chunk": chunk}] * 4,
    }
    if engine_api == "tokens":
        r.upstream.stream_lines = [
            line({"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]}),
            DONE,
        ]
    else:
        delta = {"index": 0, "delta": {"content": "hello"}, "finish_reason": "stop"}
        r.upstream.stream_lines = [line({"choices": [delta]}), DONE]
    return r


def answered_ago(r: Rig, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode is sent `seconds` after prefill answered, as after a wait or retries: the time is
    taken off prefill's answer rather than waited for."""
    hops = r.route.hops
    prefill = hops.prefill

    async def late_prefill(exchange: Exchange, *args: Any, **kwargs: Any) -> Any:
        result = await prefill(exchange, *args, **kwargs)
        if exchange.prefill_done_at is not None:
            exchange.prefill_done_at -= seconds
        return result

    monkeypatch.setattr(hops, "prefill", late_prefill)


def decode_bodies(r: Rig) -> list[dict[str, Any]]:
    return [c.body for c in r.upstream.calls if c.stage in ("decode", "decode_stream")]


ROUTES = [
    pytest.param("tokens", False, id="tokens"),
    pytest.param("tokens", True, id="tokens-stream"),
    pytest.param("openai", False, id="openai"),
    pytest.param("openai", True, id="openai-stream"),
]


@pytest.mark.parametrize(("engine_api", "stream"), ROUTES)
async def test_a_decode_sent_within_the_lease_pulls_prefills_kv(
    engine_api: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 30 s lease, 1 s margin: 28 s after prefill answered there is time left.
    r = scripted(engine_api, stream)
    answered_ago(r, 28, monkeypatch)
    response = await r.route.serve(r.exchange({**CHAT, "stream": stream}))
    assert response.status == 200
    [decode] = decode_bodies(r)
    assert decode["kv_transfer_params"] == KV
    assert r.fallbacks("lease_expiring") == 0
    assert r.upstream.aborted == []


@pytest.mark.parametrize(("engine_api", "stream"), ROUTES)
async def test_a_decode_sent_past_the_lease_less_the_margin_prefills_locally(
    engine_api: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = scripted(engine_api, stream)
    answered_ago(r, 29.5, monkeypatch)  # 0.5 s of the 30 s lease left: less than the margin
    response = await r.route.serve(r.exchange({**CHAT, "stream": stream}))
    assert response.status == 200
    [decode] = decode_bodies(r)  # one decode, sent without the KV: it prefills itself
    assert "kv_transfer_params" not in decode
    assert r.fallbacks("lease_expiring") == 1
    # The tokens API frees prefill's blocks at once (vLLM names the request generate-tokens-<id>);
    # plain `vllm serve` has no abort endpoint: its blocks go when the lease runs out.
    expected = [("http://prefill", ["generate-tokens-req-1"])] if engine_api == "tokens" else []
    assert r.upstream.aborted == expected
    assert r.fallbacks("kv_load_failed") == 0


async def test_the_lease_is_the_routing_configs_not_the_engines_expiry_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An expiry time on some other process's clock (here far ahead of the gateway's clocks,
    wall and monotonic) does not stretch the lease; a longer lease in the routing config does."""
    far = {**KV, "remote_blocks_expiry_time": time.time() + 10_000}
    short = scripted("tokens", False)
    short.upstream.script["prefill"] = [{"kv_transfer_params": far}]
    answered_ago(short, 40, monkeypatch)
    assert (await short.route.serve(short.exchange(CHAT))).status == 200
    assert "kv_transfer_params" not in decode_bodies(short)[0]
    assert short.fallbacks("lease_expiring") == 1

    long = scripted("tokens", False, prefillLeaseSeconds=120)
    answered_ago(long, 40, monkeypatch)
    assert (await long.route.serve(long.exchange(CHAT))).status == 200
    assert decode_bodies(long)[0]["kv_transfer_params"] == KV
    assert long.fallbacks("lease_expiring") == 0


@asynccontextmanager
async def failing_decodes(count: int, until: float) -> AsyncIterator[list[str]]:
    """Decode replicas on loopback that answer 503, each only once `until` (monotonic) passed:
    the lease runs out while the first one is being tried."""

    async def generate(request: web.Request) -> web.Response:
        await asyncio.sleep(max(0.0, until - time.monotonic()) + 0.05)
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(count):
            app = web.Application()
            app.router.add_post("/inference/v1/generate", generate)
            urls.append(await stack.enter_async_context(serving(app)))
        yield urls


async def test_no_decode_replica_is_sent_the_kv_once_the_lease_runs_out_during_retries() -> None:
    start_by = time.monotonic() + 1.0
    async with failing_decodes(2, until=start_by) as urls:
        config = GatewayConfig.model_validate({
            "model": "qwen",
            "pools": {"decode": {"service": "x", "port": 8000}},
            "endpoints": {"decode": [{"url": url} for url in urls]},
        })  # fmt: skip
        endpoints = Endpoints(config)
        upstream = UpstreamClient(endpoints, GatewayMetrics(), GatewaySettings())
        tried: list[Any] = []
        try:
            with pytest.raises(LeaseExpiring):
                await upstream.post_json(
                    "decode",
                    endpoints.pools["decode"],
                    "/inference/v1/generate",
                    {"kv_transfer_params": KV},
                    {},
                    30,
                    tried=tried,
                    start_by=start_by,
                )
        finally:
            await upstream.close()
    assert len(tried) == 1  # the second replica was never sent the KV
    with pytest.raises(LeaseExpiring):  # nor is any, once the lease is past
        await UpstreamClient(endpoints, GatewayMetrics(), GatewaySettings()).post_json(
            "decode", endpoints.pools["decode"], "/x", {}, {}, 30, start_by=time.monotonic()
        )
