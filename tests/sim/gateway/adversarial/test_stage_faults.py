"""Every stage (render, prefill, decode, derender) x every fault (tests/support/fault_proxy.py,
plus a connection refused) x streamed or not, on loopback simulators behind fault proxies,
with small bounds. Each request ends within them, with a correct answer (a failed prefill
falls back to local prefill on decode) or a clear error (a JSON error; in a stream, an error
event then `[DONE]`); nothing is left running on the gateway or the engines; a stream cut
short stops decode (a tokens engine is told to abort, an OpenAI engine's connection closed);
pdserve_gateway_requests_total counts it honestly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from devtools.localplane import free_port
from pdserve.gateway.app import Gateway
from pdserve.vllm.protocol import generate_request_id
from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.fault_proxy import FAULTS, INJECTED_MESSAGE, FaultProxy
from tests.support.outcomes import TALLY, Outcome, counted_as, exchange, settled
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, routing, until

# Small bounds (a sim answers in milliseconds on loopback), yet wide enough that a busy 2-core
# CI machine never makes a healthy stage look hung; the slow fault stays far within.
BOUNDS: dict[str, Any] = {
    "connect_timeout": 1.5,
    "first_byte_timeout": 2.0,
    "idle_timeout": 1.0,
    "render_timeout": 2.0,
    "request_timeout": 4.0,
    "endpoint_wait_seconds": 0,
}
# Seconds: the request's own bound plus generous slack (a busy machine): an answer later than
# this did not keep to its bounds.
HANG = BOUNDS["request_timeout"] + 3
LEAKS = ("http://", "10.9.8.7", "decode-7")  # what the injected errors say of the cluster

TOKENS_PATHS = {
    "render": "/render",
    "prefill": "/inference/v1/generate",
    "decode": "/inference/v1/generate",
    "derender": "/derender",
}
OPENAI_PATHS = {"prefill": "/v1/chat/completions", "decode": "/v1/chat/completions"}
KINDS = (*FAULTS, "refused")


def cases() -> list[Any]:
    found = []
    for api, paths in (("tokens", TOKENS_PATHS), ("openai", OPENAI_PATHS)):
        for stage in paths:
            for kind in KINDS:
                if kind == "refused" and stage == "derender":
                    continue  # the render server's: render is refused first
                for stream in (False, True):
                    mode = "stream" if stream else "json"
                    found.append(
                        pytest.param(api, stage, kind, stream, id=f"{api}-{stage}-{kind}-{mode}")
                    )
    return found


@dataclass
class Faulty:
    gateway: Gateway
    url: str
    proxies: dict[str, FaultProxy]
    """By pool: render, prefill, decode."""


async def faulty_stack(
    stack: Stack, api: str, stage: str, kind: str, request_path: str = "python"
) -> Faulty:
    """Simulators behind fault proxies (one per pool), a gateway over the proxies; the fault
    armed on `stage` (refused: its pool's address has nothing listening)."""
    pools = ("render", "prefill", "decode") if api == "tokens" else ("prefill", "decode")
    proxies: dict[str, FaultProxy] = {}
    endpoints: dict[str, Any] = {}
    for pool in pools:
        if pool == "render":
            target = await stack.render()
        else:
            target = await stack.engine(pool, engine(pool, api=api))
        proxy = proxies[pool] = FaultProxy(target, slow_seconds=0.1)
        url = await stack.start(proxy)
        if kind == "refused" and stage == pool:
            url = f"http://127.0.0.1:{free_port()}"
        endpoints[pool] = [ep(url)]
    pool = "render" if stage == "derender" else stage
    if kind != "refused":
        paths = TOKENS_PATHS if api == "tokens" else OPENAI_PATHS
        proxies[pool].inject(kind, paths[stage])
    config = routing(api, render=api == "tokens", endpoints=endpoints)
    client = await stack.gateway(
        config, data_plane=behind_data_plane(request_path), load_scrape_seconds=None, **BOUNDS
    )
    return Faulty(stack.gateway_server, str(client.base_url).rstrip("/"), proxies)


def expected(stage: str, kind: str) -> tuple[Outcome, int | None]:
    """What an honest gateway answers: prefill falls back, slow is no failure; else an error,
    504 where the gateway's own wait ran out."""
    if kind == "slow" or stage == "prefill":
        return Outcome.ANSWERED, 200
    return Outcome.CLEAR_ERROR, 504 if kind in ("hang", "stall") else 502


def fallbacks(gateway: Gateway) -> float:
    return sum(
        sample.value
        for metric in gateway.metrics.fallbacks.collect()
        for sample in metric.samples
        if sample.name == "pdserve_gateway_fallbacks_total"
    )


@pytest.mark.parametrize(("api", "stage", "kind", "stream"), cases())
async def test_a_stage_fault_ends_in_an_answer_or_a_clear_error(
    stack: Stack, api: str, stage: str, kind: str, stream: bool, request_path: str
) -> None:
    faulty = await faulty_stack(stack, api, stage, kind, request_path)
    body = {**PLAIN, "max_tokens": 20, "stream": stream}
    async with aiohttp.ClientSession() as session:
        verdict = await exchange(
            session,
            f"{faulty.url}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
            chat=True,
            deadline=HANG,
            leaks=LEAKS,
        )
    mode = "streamed" if stream else "not streamed"
    TALLY.add(f"fault ({api} route): {stage}, {mode} ({request_path})", verdict)
    want, status = expected(stage, kind)
    assert verdict.outcome is want, verdict
    assert verdict.status == status, verdict
    if kind != "refused":
        pool = "render" if stage == "derender" else stage
        assert faulty.proxies[pool].injected == 1  # the fault was met
    await until(lambda: settled(stack, faulty.gateway), HANG)
    # Counted once (the data plane's counts are folded in within a second).
    await counted_as(faulty.gateway, {verdict.metrics_outcome: 1}, HANG)
    if stage == "prefill" and kind != "slow":
        await until(lambda: fallbacks(faulty.gateway) == 1, HANG)  # local prefill, counted
    if stage == "decode" and verdict.streamed and verdict.outcome is Outcome.CLEAR_ERROR:
        decode = faulty.proxies["decode"]
        sent = [rid for path, rid in decode.calls if path.endswith(OPENAI_PATHS["decode"])]
        sent += [rid for path, rid in decode.calls if path.endswith(TOKENS_PATHS["decode"])]
        assert sent
        assert sent[-1] is not None  # the gateway names every engine call
        # The cut stream's engine work stops (settled, above): a tokens engine is told by its
        # name for the request; a plain `vllm serve` has no abort endpoint, its closed
        # connection is the abort.
        assert decode.aborted == ([generate_request_id(sent[-1])] if api == "tokens" else [])
    assert INJECTED_MESSAGE not in str(verdict.error)
