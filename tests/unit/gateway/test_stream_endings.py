"""How a stream ends when the engine misbehaves (fake upstream, no sockets): `[DONE]` before a
finish_reason, a malformed event, an engine that goes quiet. Each ends the client's stream with
an error event then `[DONE]`, stops decode (a tokens engine is told to abort, an OpenAI engine's
stream is closed), counts as failed, and leaves no task."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.support.gateway_fakes import Rig, pending_tasks, rig, written

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
HANG = 10  # seconds: far past every configured bound, only a hang detector


def line(event: Any) -> bytes:
    return f"data: {json.dumps(event)}\n".encode()


def token(ids: list[int], finish: str | None = None) -> bytes:
    return line({"choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}]})


def openai_chunk(text: str, finish: str | None = None) -> bytes:
    return line({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


def tokens_rig(**settings: Any) -> Rig:
    r = rig("tokens", mode="Aggregated", **settings)
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    r.upstream.script = {
        "render": [{"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}}],
        "derender": [{"chunk": chunk}] * 10,
    }
    return r


async def serve(r: Rig) -> list[Any]:
    exchange = r.exchange(CHAT)
    await asyncio.wait_for(r.route.serve(exchange), HANG)
    assert pending_tasks() == []  # no derender pipeline or reader left behind
    assert exchange.stream_error is not None  # app.py counts it as failed, not ok
    if exchange.tokens_api:
        assert r.upstream.aborted == [("http://decode", ["generate-tokens-req-1"])]
    else:
        # No abort endpoint on a plain `vllm serve`: closing its stream is the abort.
        assert r.upstream.aborted == []
        assert [s.closed for s in r.upstream.streams] == [True]
    return written(exchange)


def ends_in_error(events: list[Any], status: int, says: str) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == status
    assert says in error["message"]


UPSTREAM_ENDINGS = [
    pytest.param([token([7]), b"data: [DONE]\n"], "[DONE] before a finish_reason", id="done"),
    pytest.param([token([7]), b"data: {not json\n"], "malformed event", id="malformed"),
    pytest.param([token([7]), line({"choices": [7]})], "malformed event", id="bad-choice"),
    pytest.param([token([7])], "closed it", id="dropped"),
]


@pytest.mark.parametrize(("lines", "says"), UPSTREAM_ENDINGS)
async def test_a_tokens_stream_the_engine_ends_badly_ends_in_an_error(
    lines: list[bytes], says: str
) -> None:
    r = tokens_rig()
    r.upstream.stream_lines = lines
    ends_in_error(await serve(r), 502, says)


async def test_a_tokens_stream_that_goes_quiet_ends_after_the_idle_timeout() -> None:
    r = tokens_rig(idle_timeout=0.05)
    r.upstream.stream_lines, r.upstream.stream_stalls = [token([7])], True
    events = await serve(r)
    ends_in_error(events, 504, "no event for 0.05 s")
    assert any(e != "[DONE]" and "choices" in e for e in events)  # what came was relayed


async def test_a_tokens_stream_with_no_first_event_ends_after_the_first_byte_timeout() -> None:
    r = tokens_rig(first_byte_timeout=0.05)
    r.upstream.stream_lines, r.upstream.stream_stalls = [], True
    ends_in_error(await serve(r), 504, "no first event")


async def test_a_tokens_stream_ends_at_the_request_deadline() -> None:
    r = tokens_rig(request_timeout=0.2)
    r.upstream.stream_lines, r.upstream.stream_stalls = [token([7])], True
    ends_in_error(await serve(r), 504, "deadline")


def openai_rig(**settings: Any) -> Rig:
    return rig("openai", mode="Aggregated", **settings)


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        pytest.param([openai_chunk("a"), b"data: [DONE]\n"], "before a finish_reason", id="done"),
        pytest.param([openai_chunk("a"), b"data: {oops\n"], "malformed event", id="malformed"),
        pytest.param([openai_chunk("a")], "closed it", id="dropped"),
    ],
)
async def test_an_openai_stream_the_engine_ends_badly_ends_in_an_error(
    lines: list[bytes], says: str
) -> None:
    r = openai_rig()
    r.upstream.stream_lines = lines
    ends_in_error(await serve(r), 502, says)


async def test_an_openai_stream_that_goes_quiet_ends_after_the_idle_timeout() -> None:
    r = openai_rig(idle_timeout=0.05)
    r.upstream.stream_lines, r.upstream.stream_stalls = [openai_chunk("a")], True
    events = await serve(r)
    ends_in_error(events, 504, "no event for 0.05 s")
    assert events[0]["choices"][0]["delta"]["content"] == "a"


async def test_a_finished_openai_stream_ends_with_its_finish_reason_and_no_error() -> None:
    r = openai_rig()
    r.upstream.stream_lines = [openai_chunk("a"), openai_chunk("", "stop"), b"data: [DONE]\n"]
    exchange = r.exchange(CHAT)
    await asyncio.wait_for(r.route.serve(exchange), HANG)
    events = written(exchange)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert exchange.stream_error is None
    assert r.upstream.aborted == []
    assert [s.closed for s in r.upstream.streams] == [False]


async def test_an_engines_own_error_event_reaches_the_client_without_its_addresses() -> None:
    r = openai_rig()
    failure = {"message": "KV pull from http://10.0.3.7:5600 failed (host 10.0.3.7)", "code": 500}
    r.upstream.stream_lines = [openai_chunk("a"), line({"error": failure}), b"data: [DONE]\n"]
    exchange = r.exchange(CHAT)
    await asyncio.wait_for(r.route.serve(exchange), HANG)
    events = written(exchange)
    [error] = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert "10.0.3.7" not in error["message"]
    assert error["message"].startswith("KV pull from a replica failed")
    assert error["code"] == 500  # the engine's event, passed on, not replaced
    assert events[-1] == "[DONE]"
