"""Faults injected into the simulated engine through /sim/faults: a 5xx once, a stream dropped
before [DONE], a request that never gets an answer; unknown faults are refused."""

from __future__ import annotations

import httpx
import pytest

from tests.support.sim_engine import Engines, engine_config, generate_body


async def test_injected_5xx_happens_once(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"http_5xx": 1})
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 500
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 200
    unknown = await client.post("/sim/faults", json={"melt": True})
    assert unknown.status_code == 400


async def test_dropped_stream_ends_without_done(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"drop_stream_after": 3})
    body = generate_body(stream=True, sampling_params={"max_tokens": 50, "ignore_eos": True})
    lines: list[str] = []
    with pytest.raises(httpx.HTTPError):
        async with client.stream("POST", "/inference/v1/generate", json=body) as response:
            lines.extend([line async for line in response.aiter_lines() if line])
    assert "data: [DONE]" not in lines
    assert len(lines) <= 3


async def test_hung_engine_never_answers(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"hang": 1})
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/inference/v1/generate", json=generate_body(), timeout=0.5)
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 200
