"""Clients that misbehave on the wire, on loopback simulators: bodies sent slowly (stalled,
trickled, chunked and stalled) get a 408 within the body timeout while other clients are
served; a client that goes away mid-stream or mid-answer has its engine work aborted and frees
its in-flight slot; framing aiohttp's HTTP parser refuses, and a Content-Encoding the gateway
does not read or a compressed body cut short, are answered in the OpenAI shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.app import Gateway
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.vllm.protocol import ABORT_PATH, generate_request_id
from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.fault_proxy import ABORT_PATHS, FaultProxy
from tests.support.outcomes import (
    TALLY,
    Outcome,
    Verdict,
    counted_as,
    judge_json,
    requests_by_outcome,
    settled,
)
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, pd_stack, routing, until

HANG = 15.0  # seconds: only a hang detector
BODY = json.dumps(PLAIN).encode()
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


async def read_answer(reader: asyncio.StreamReader) -> Verdict:
    """One HTTP/1.1 answer with a Content-Length, judged."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    fields = dict(
        line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line
    )  # fmt: skip
    headers = {k.strip().lower(): v.strip() for k, v in fields.items()}
    payload = await reader.readexactly(int(headers[b"content-length"]))
    content_type = headers.get(b"content-type", b"").split(b";")[0].decode()
    return judge_json(status, content_type, payload, chat=True)


async def stalled(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
    await writer.drain()  # ... and the rest never comes


async def trickled(writer: asyncio.StreamWriter) -> None:
    """The whole body, one byte at a time, far slower than the body timeout allows."""
    writer.write(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode())
    for byte in BODY:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.05)  # pacing the client, not waiting for the gateway


async def chunked_and_stalled(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"a\r\n" + BODY[:10] + b"\r\n")
    await writer.drain()  # ... no more chunks, no last one


SLOW: list[Callable[[asyncio.StreamWriter], Coroutine[Any, Any, None]]] = [
    stalled,
    trickled,
    chunked_and_stalled,
]


async def test_slow_bodies_get_408_within_the_body_timeout_while_others_are_served(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(
        stack, data_plane=behind_data_plane(request_path), max_inflight=1, body_timeout=0.5
    )
    gateway = stack.gateway_server
    host, port = client.base_url.host, client.base_url.port
    assert port is not None
    connections = [await asyncio.open_connection(host, port) for _ in SLOW]
    senders = [asyncio.create_task(send(w)) for send, (_, w) in zip(SLOW, connections, strict=True)]
    try:
        # Meanwhile other clients are served: the slow bodies hold no in-flight slot.
        for _ in range(3):
            response = await asyncio.wait_for(client.post("/v1/chat/completions", json=PLAIN), HANG)
            TALLY.add(
                f"slow clients: others served meanwhile ({request_path})",
                _served(response.status_code),
            )
            assert response.status_code == 200, response.text
        for reader, _ in connections:
            verdict = await asyncio.wait_for(read_answer(reader), HANG)
            TALLY.add(f"slow clients: body sent slowly ({request_path})", verdict)
            assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
            assert verdict.status == 408, verdict
            assert verdict.error is not None
            assert verdict.error["type"] == "RequestTimeout"
    finally:
        for task in senders:
            task.cancel()
        for _, writer in connections:
            writer.close()
    await until(lambda: gateway.metrics.inflight._value.get() == 0, HANG)
    await counted_as(gateway, {"ok": 3, "error_408": 3}, HANG)


def _served(status: int) -> Verdict:
    return Verdict(Outcome.ANSWERED if status == 200 else Outcome.CORRUPTED, status)


ENGINES = ["tokens", "scale_out", "openai"]
"""What the engines run: --tokens-only or --enable-scale-out behind render servers (the tokens
route), plain `vllm serve` (the OpenAI route)."""


async def long_answer_stack(
    stack: Stack, api: str, request_path: str
) -> tuple[Gateway, str, FaultProxy]:
    """P/D whose decode engine takes seconds per answer (a long one with ignore_eos), behind a
    proxy that records the aborts it is sent. In front of a tokens engine the proxy keeps the
    engine's call going when the gateway leaves (so only an abort the engine understands stops
    the work); in front of a plain `vllm serve`, which has no abort endpoint, it passes the
    closed connection on, which is how that engine is stopped."""
    slow = engine("decode", api=api)
    slow.scheduler = SchedulerConfig(time_scale=0.5)  # ~10 ms a token
    tokens_route = api != "openai"
    decode = FaultProxy(await stack.engine("decode", slow), holds_upstream=tokens_route)
    endpoints: dict[str, Any] = {
        "prefill": [ep(await stack.engine("prefill", engine("prefill", api=api)))],
        "decode": [ep(await stack.start(decode))],
    }
    if tokens_route:
        endpoints["render"] = [ep(await stack.render())]
    route = "tokens" if tokens_route else "openai"
    config = routing(route, render=tokens_route, endpoints=endpoints)
    client = await stack.gateway(
        config, data_plane=behind_data_plane(request_path), load_scrape_seconds=None
    )
    return stack.gateway_server, str(client.base_url).rstrip("/"), decode


def told_to_stop(decode: FaultProxy, api: str) -> None:
    """A tokens engine was told to abort by its own name for the request (the X-Request-Id
    the gateway sent it, behind vLLM's prefix); a plain `vllm serve` was not posted to (it
    has no abort endpoint: the closed connection stopped it)."""
    [(_, request_id)] = [c for c in decode.calls if c[0] not in ABORT_PATHS]
    assert request_id is not None
    if api == "openai":
        assert decode.aborted == []
    else:
        assert decode.aborted == [generate_request_id(request_id)]
        assert [c[0] for c in decode.calls if c[0] in ABORT_PATHS] == [ABORT_PATH]


LONG_ANSWER = {**PLAIN, "max_tokens": 3000, "ignore_eos": True}


def decoding(stack: Stack) -> bool:
    return bool(stack.engines["decode"].core.running)


async def left(stack: Stack, gateway: Gateway, decode: FaultProxy) -> Verdict:
    """What the gateway did after its client left: its engine work stopped, its slot freed,
    counted as client_gone (answered); or work left running (hang)."""
    try:
        await until(lambda: settled(stack, gateway), HANG)
    except TimeoutError:
        return Verdict(Outcome.HANG, None, "engine work or the in-flight slot left behind")
    with suppress(TimeoutError):  # behind the data plane its counts come within a second
        await until(lambda: requests_by_outcome(gateway) == {"client_gone": 1}, HANG)
    counted = requests_by_outcome(gateway)
    if counted != {"client_gone": 1}:
        return Verdict(Outcome.CORRUPTED, None, f"a request its client left counted as {counted}")
    return Verdict(Outcome.ANSWERED, None)


@pytest.mark.parametrize("api", ENGINES)
async def test_a_client_leaving_mid_stream_has_its_engine_work_aborted(
    stack: Stack, api: str, request_path: str
) -> None:
    gateway, url, decode = await long_answer_stack(stack, api, request_path)
    async with aiohttp.ClientSession() as session:
        body = {**LONG_ANSWER, "stream": True}
        response = await session.post(f"{url}/v1/chat/completions", json=body)
        assert response.status == 200
        events = 0
        while events < 3:
            line = await asyncio.wait_for(response.content.readline(), HANG)
            events += line.startswith(b"data: ")
        assert decoding(stack)
        response.close()  # the client goes away mid-stream
    verdict = await left(stack, gateway, decode)
    TALLY.add(f"client leaves mid-stream ({api} engines, {request_path})", verdict)
    assert verdict.outcome is Outcome.ANSWERED, verdict
    told_to_stop(decode, api)


@pytest.mark.parametrize("api", ENGINES)
async def test_a_client_leaving_mid_answer_has_its_engine_work_aborted(
    stack: Stack, api: str, request_path: str
) -> None:
    gateway, url, decode = await long_answer_stack(stack, api, request_path)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{url}/v1/chat/completions", json=LONG_ANSWER))
        await until(lambda: decoding(stack), HANG)
        request.cancel()  # the client goes away while decode works on its answer
        with pytest.raises(asyncio.CancelledError):
            await request
    verdict = await left(stack, gateway, decode)
    TALLY.add(f"client leaves mid-answer ({api} engines, {request_path})", verdict)
    assert verdict.outcome is Outcome.ANSWERED, verdict
    told_to_stop(decode, api)


# Framing aiohttp's HTTP parser refuses before the application sees the request (the gateway's
# server answers it, server.py), and Content-Encoding the gateway undoes itself rather than the
# parser (content_encoding.py): each answered at once, in the OpenAI shape, naming the header.
FRAMING = [
    pytest.param(
        HEAD + b"Content-Encoding: br\r\n" + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY,
        415,
        "Content-Encoding: br is not supported",
        id="unsupported-content-encoding",
    ),
    pytest.param(
        HEAD + b"Content-Encoding: zstd\r\nContent-Length: 2\r\n\r\n{}",
        415,
        "Content-Encoding: zstd is not supported",
        id="unsupported-content-encoding-zstd",
    ),
    pytest.param(
        HEAD + b"Content-Encoding: deflate\r\nContent-Length: 4\r\n\r\nx\x9c\xabV",
        400,
        "Content-Encoding: deflate says (it is cut short)",
        id="compressed-body-cut-short",
    ),
    pytest.param(
        HEAD + b"Transfer-Encoding: chunked\r\n" + f"Content-Length: {len(BODY)}\r\n\r\n".encode(),
        400,
        "both Content-Length and Transfer-Encoding",
        id="length-and-chunked",
    ),
    pytest.param(
        HEAD + b"X-Big: " + b"x" * 10_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        431,
        "a request header (or the request line) is longer than 8190 bytes",
        id="header-over-8-kib",
    ),
]


@pytest.mark.parametrize(("request_bytes", "status", "message"), FRAMING)
async def test_framing_aiohttp_refuses_is_answered_in_the_openai_shape(
    stack: Stack, request_bytes: bytes, status: int, message: str, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=behind_data_plane(request_path))
    assert client.base_url.port is not None
    reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
    try:
        writer.write(request_bytes)
        await writer.drain()
        verdict = await asyncio.wait_for(read_answer(reader), HANG)
    finally:
        writer.close()
    TALLY.add(f"framing and encodings refused, in the OpenAI shape ({request_path})", verdict)
    assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
    assert verdict.status == status, verdict
    assert verdict.error is not None
    assert message in verdict.error["message"], verdict


HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
           "remote_block_ids": [1], "remote_host": "10.0.0.9", "remote_port": 5600}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"kv_transfer_params": HANDOFF}, "kv_transfer_params"),
     ({"vllm_xargs": {"kv_transfer_params": HANDOFF}}, "vllm_xargs.kv_transfer_params")],
)  # fmt: skip
async def test_a_client_cannot_hand_an_engine_kv_parameters(
    stack: Stack, extra: dict[str, Any], param: str, request_path: str
) -> None:
    """What only the gateway may send an engine (where to pull KV from: any host a client
    names) is refused before any engine sees the request, on the aggregated route too."""
    client = await pd_stack(stack, mode="Aggregated", data_plane=behind_data_plane(request_path))
    answer = await client.post("/v1/chat/completions", json={**PLAIN, **extra})
    verdict = judge_json(answer.status_code, answer.headers.get("content-type", "").split(";")[0],
                         answer.content, chat=True)  # fmt: skip
    TALLY.add(f"a client's KV handoff parameters refused ({request_path})", verdict)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, param)
    assert all(e.core.prefix_queries == 0 for e in stack.engines.values())
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
