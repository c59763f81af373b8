"""Engines that break HTTP/1.1 on the connections the gateway keeps alive to them, on both
request paths: no client is ever given an answer that was not written for its own request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.hostile_engine import FORGED, HostileEngine
from tests.support.outcomes import TALLY, Outcome, Verdict, judge_json
from tests.support.sim_gateway import MODEL, Stack, ep, routing, until


@pytest.fixture
async def hostile() -> AsyncIterator[HostileEngine]:
    engine = HostileEngine()
    yield engine
    await engine.stop()


async def test_bytes_an_engine_sends_past_its_answer_never_answer_the_next_request(
    stack: Stack, hostile: HostileEngine, request_path: str
) -> None:
    """An exact Content-Length answer, then 50 ms later a complete second (forged) answer on
    the same kept-alive connection: the connection is dropped, the next request is answered by
    what the engine writes for it."""
    url = await hostile.start()
    config = routing("openai", prefill=False, render=False, endpoints={"decode": [ep(url)]})
    client = await stack.gateway(
        config, data_plane=behind_data_plane(request_path), load_scrape_seconds=None
    )
    for number in range(5):
        words = f"request {number}"
        body = {"model": MODEL, "messages": [{"role": "user", "content": words}]}
        response = await client.post("/v1/chat/completions", json=body)
        verdict: Verdict = judge_json(
            response.status_code,
            response.headers.get("content-type", "").split(";")[0],
            response.content,
            chat=True,
        )
        content = (
            response.json()["choices"][0]["message"]["content"] if verdict.status == 200 else None
        )
        if content is not None and content != f"echo: {words}":
            verdict = Verdict(Outcome.CORRUPTED, verdict.status, f"another answer: {content!r}")
        TALLY.add(f"engine writes past its answer ({request_path})", verdict)
        assert verdict.outcome is Outcome.ANSWERED, verdict
        assert FORGED not in response.text
        # The forged answer is on the wire before the next request goes out.
        sent = number + 1
        await until(lambda: hostile.forged_sent >= sent)  # noqa: B023 - awaited here
    # Each forged answer cost its connection: none was reused after it.
    assert hostile.connections == 5
