"""The gateway's replica check against real vLLM: a real render server and a real engine pass
it (every check route served, answers of the expected shape), and the simulator's render server
splits the canary completion as real vLLM does, so the check means the same on both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import ensure_vllm_cpu
from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.endpoints import Endpoints
from pdserve.gateway.replica_contract import (
    ReplicaCheck,
    ReplicaContract,
    Verdict,
    session_fetch,
)
from pdserve.sim.render_server import RenderConfig, RenderServer
from tests.support.real_vllm import SERVED_NAME, VllmProcesses, VllmServer
from tests.support.serving import serving

DERENDERED = ("derender content", "derender reasoning", "derender tool_calls")


async def answers_of(urls: dict[str, str]) -> dict[str, ReplicaCheck]:
    """Each pool's settled check of one replica at `urls` (pool -> URL)."""
    pool = {"service": "static", "port": 8000}
    config = GatewayConfig.model_validate({
        "model": SERVED_NAME,
        "pools": {"render": pool, "decode": pool},
        "replicaCheck": "Enforce",
        "endpoints": {name: [{"url": url, "parityHash": "p", "name": name}]
                      for name, url in urls.items()},
    })  # fmt: skip
    async with aiohttp.ClientSession() as session:
        contract = ReplicaContract(
            Endpoints(config), SERVED_NAME, session_fetch(lambda: session), retry_seconds=0.2
        )
        contract.start()

        async def settled() -> None:
            while any(c.verdict is Verdict.pending for c in contract.checks.values()):  # noqa: ASYNC110 - polled with a deadline
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(settled(), 120)
        finally:
            contract.stop()
        return {c.pool: c for c in contract.checks.values()}


async def test_real_render_and_engine_pass_the_check_as_the_simulator_does(
    render: VllmServer, engine: VllmServer
) -> None:
    real = await answers_of({"render": render.url, "decode": engine.url})
    for pool, check in real.items():
        assert check.verdict is Verdict.verified, (pool, check.verdict, check.reason)
    render_answers: dict[str, Any] = real["render"].answers or {}
    assert render_answers["derender reasoning"], render_answers  # qwen3's parser split it
    assert render_answers["derender tool_calls"] == [
        ("pdserve_canary_lookup", '{"word": "parity"}')
    ], render_answers
    engine_answers: dict[str, Any] = real["decode"].answers or {}
    assert str(engine_answers["vLLM version"]).startswith("0.32"), engine_answers
    assert isinstance(engine_answers["served model"]["max_model_len"], int), engine_answers

    sim = RenderServer(RenderConfig(
        model="sim", served_model_name=SERVED_NAME, reasoning_parser="qwen3",
        tool_call_parser="hermes", enable_auto_tool_choice=True,
    ))  # fmt: skip
    async with serving(sim.app()) as sim_url:
        simulated = await answers_of({"render": sim_url, "decode": engine.url})
    sim_answers: dict[str, Any] = simulated["render"].answers or {}
    assert split(sim_answers) == split(render_answers)


def split(answers: dict[str, Any]) -> dict[str, Any]:
    """How a render server split the canary: content, reasoning and tool calls, whitespace
    included (vLLM 0.32 keeps the newlines around both texts: '\\nThe user wants a
    lookup.\\n' and '\\n\\nLooking it up.\\n')."""
    return {f: v for f, v in answers.items() if f in DERENDERED}


@pytest.fixture(scope="module")
def render_without_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """`vllm launch render` for a model served without tool calling (no tool parser, no
    --enable-auto-tool-choice): it refuses tool_choice auto."""
    env = ensure_vllm_cpu()
    logs: Path = tmp_path_factory.mktemp("render-without-tools")
    procs = VllmProcesses(env, ensure_tiny_model(env), logs)
    try:
        server = procs.start("render-without-tools", ["launch", "render"],
                             ["--reasoning-parser", "qwen3"])  # fmt: skip
        procs.wait_ready()
        yield server
    finally:
        procs.stop()


async def test_a_real_render_without_a_tool_parser_is_checked_with_tool_choice_none(
    render_without_tools: VllmServer, engine: VllmServer
) -> None:
    """Not left Unchecked after the retries: it refuses the canary's tool_choice auto (400),
    and the same conversation with none is what it runs; the tool call stays in the content."""
    checked = await answers_of({"render": render_without_tools.url, "decode": engine.url})
    render = checked["render"]
    assert render.verdict is Verdict.verified, (render.verdict, render.reason)
    answers: dict[str, Any] = render.answers or {}
    assert answers["tool choice"] == "none", answers
    assert answers["derender tool_calls"] == [], answers
    assert "pdserve_canary_lookup" in str(answers["derender content"]), answers
