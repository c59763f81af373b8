"""Engines that break HTTP/1.1 on the connections the gateway keeps alive to them, on both
request paths: no client is ever given an answer that was not written for its own request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.hostile_engine import FORGED, OTHER_REQUEST, HostileEngine
from tests.support.outcomes import TALLY, Outcome, Verdict, exchange, judge_json
from tests.support.sim_gateway import MODEL, Stack, ep, routing, until

BOUND = 60.0
"""The request's every timeout: far above what a broken answer may take to end."""
HANG = 10.0
"""An answer later than this waited for a timeout: hung."""
MESSAGES = [{"role": "user", "content": "hello"}]


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


async def hostile_gateway(
    stack: Stack, hostile: HostileEngine, request_path: str
) -> httpx.AsyncClient:
    """A gateway over the hostile engine alone (decode, OpenAI API), with bounds far above what
    a broken answer may take to end: an answer that waits for them has hung."""
    url = await hostile.start()
    config = routing("openai", prefill=False, render=False, endpoints={"decode": [ep(url)]})
    return await stack.gateway(
        config,
        data_plane=behind_data_plane(request_path),
        load_scrape_seconds=None,
        first_byte_timeout=BOUND,
        idle_timeout=BOUND,
        request_timeout=BOUND,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_answer_whose_chunked_framing_breaks_ends_at_once_in_a_clear_error(
    stack: Stack, request_path: str, stream: bool
) -> None:
    """A chunk size that is not a number after the answer began, then the engine's close: a
    502 (a stream: an error event, then [DONE]) at once, not when the request's time is up."""
    hostile = HostileEngine("bad_chunk")
    client = await hostile_gateway(stack, hostile, request_path)
    try:
        async with aiohttp.ClientSession() as session:
            verdict = await exchange(
                session,
                f"{client.base_url}".rstrip("/") + "/v1/chat/completions",
                json.dumps({"model": MODEL, "messages": MESSAGES, "stream": stream}).encode(),
                {"Content-Type": "application/json"},
                chat=True,
                deadline=HANG,
            )
    finally:
        await hostile.stop()
    TALLY.add(f"engine's chunked framing breaks ({request_path})", verdict)
    assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
    assert verdict.status == 502, verdict
    assert "zz" not in json.dumps(verdict.error)  # the engine's bytes stay in the log


async def test_an_engine_error_answer_is_never_quoted_to_the_client(
    stack: Stack, request_path: str
) -> None:
    """A 500 whose body is another request's answer: the client's 502 says the engine failed,
    and nothing of what it sent."""
    hostile = HostileEngine("junk_error")
    client = await hostile_gateway(stack, hostile, request_path)
    try:
        response = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
        )
    finally:
        await hostile.stop()
    verdict = judge_json(
        response.status_code,
        response.headers.get("content-type", "").split(";")[0],
        response.content,
        chat=True,
    )
    TALLY.add(f"engine answers an error with another's answer ({request_path})", verdict)
    assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
    assert verdict.status == 502, verdict
    assert OTHER_REQUEST not in response.text
    assert FORGED not in response.text
