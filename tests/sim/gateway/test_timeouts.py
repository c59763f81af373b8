"""Every wait of a request is bounded, on simulated engines: a hung prefill or decode (the sim's
`hang` fault), a stream that breaks, a client that sends its body slowly. Each answer, or clear
error, comes within the configured bound; the retry never goes back to the replica that failed;
a failed stream is not counted as ok. The bounds are small; `asyncio.wait_for` only detects a
hang (the old fixed 300 s timeouts)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import (
    PLAIN,
    Stack,
    engine,
    ep,
    finished,
    pd_stack,
    routing,
    sse_events,
)

HANG = 15  # seconds: far past every bound configured here


async def fault(stack: Stack, name: str, **faults: Any) -> None:
    async with httpx.AsyncClient() as admin:
        port = stack.engines[name].config.port
        response = await admin.post(f"http://127.0.0.1:{port}/sim/faults", json=faults)
        response.raise_for_status()


async def outcomes(stack: Stack, client: httpx.AsyncClient) -> dict[str, float]:
    """pdserve_gateway_requests_total by outcome (behind the data plane, what it served
    folded in first)."""
    await stack.fold_stats()
    text = (await client.get("/metrics")).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_gateway_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = counts.get(outcome, 0) + float(value)
    return counts


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_hung_prefill_falls_back_to_local_prefill_after_the_first_byte_timeout(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, first_byte_timeout=0.5, data_plane=request_path == "dataplane")
    await fault(stack, "prefill", hang=1)
    response = await asyncio.wait_for(client.post("/v1/chat/completions", json=PLAIN), HANG)
    assert response.status_code == 200, response.text
    assert stack.engines["prefill"].faults.hang == 0  # it was sent there, and hung
    await stack.fold_stats()
    assert 'reason="prefill_failed"' in (await client.get("/metrics")).text


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_decode_is_a_504_never_a_retry_on_it(
    stack: Stack, stream: bool, request_path: str
) -> None:
    """One decode replica, hung for one request: the local-prefill retry must not go back to
    it (it would answer now), so the client gets a clean 504."""
    client = await pd_stack(
        stack, first_byte_timeout=0.5, request_timeout=1.0, data_plane=request_path == "dataplane"
    )
    await fault(stack, "decode", hang=1)
    response = await asyncio.wait_for(
        client.post("/v1/chat/completions", json={**PLAIN, "stream": stream}), HANG
    )
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (504, "GatewayTimeout")
    assert finished(stack.engines["decode"]) == 0  # no retry was served by the hung replica
    assert (await outcomes(stack, client)).get("error_504") == 1


async def two_decodes(stack: Stack, **settings: Any) -> tuple[httpx.AsyncClient, list[str]]:
    """P/D over two decode replicas; the second looks busy (no scraping), so the first is
    always picked first."""
    render = await stack.render()
    prefill = await stack.engine("prefill", engine("prefill"))
    decodes = [await stack.engine(name, engine("decode")) for name in ("d0", "d1")]
    endpoints = {
        "render": [ep(render)],
        "prefill": [ep(prefill)],
        "decode": [ep(url) for url in decodes],
    }
    client = await stack.gateway(routing(endpoints=endpoints), load_scrape_seconds=None, **settings)
    stack.gateway_server.endpoints.pools["decode"][1].running = 3
    await stack.push_table()
    return client, decodes


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_streamed_decode_that_hangs_is_retried_on_the_other_replica(
    stack: Stack, request_path: str
) -> None:
    """The hung replica may have pulled prefill's KV before it hung: then the other one cannot,
    and prefills the request itself."""
    client, _ = await two_decodes(
        stack, first_byte_timeout=0.5, data_plane=request_path == "dataplane"
    )
    await fault(stack, "d0", hang=1)
    events = await asyncio.wait_for(sse_events(client, PLAIN), HANG)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert stack.engines["d0"].faults.hang == 0  # tried first, and hung
    assert (finished(stack.engines["d0"]), finished(stack.engines["d1"])) == (0, 1)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_local_prefill_retry_after_a_kv_load_failure_uses_another_decode(
    stack: Stack, stream: bool, request_path: str
) -> None:
    client, _ = await two_decodes(stack, data_plane=request_path == "dataplane")
    await fault(stack, "d0", fail_transfers=1)
    response = await asyncio.wait_for(
        client.post("/v1/chat/completions", json={**PLAIN, "stream": stream}), HANG
    )
    assert response.status_code == 200, response.text
    assert (finished(stack.engines["d0"]), finished(stack.engines["d1"])) == (0, 1)
    await stack.fold_stats()
    assert (
        'pdserve_gateway_fallbacks_total{reason="kv_load_failed"} 1.0'
        in (await client.get("/metrics")).text
    )


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_stream_decode_drops_is_counted_as_failed_not_ok(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=request_path == "dataplane")
    await fault(stack, "decode", drop_stream_after=3)
    events = await asyncio.wait_for(sse_events(client, {**PLAIN, "max_tokens": 100}), HANG)
    assert events[-1] == "[DONE]"
    assert "ended before the answer was complete" in events[-2]["error"]["message"]
    assert await outcomes(stack, client) == {"error_502": 1}


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_slow_body_gets_408_and_holds_no_in_flight_slot(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(
        stack, max_inflight=1, body_timeout=0.5, data_plane=request_path == "dataplane"
    )
    host, port = client.base_url.host, client.base_url.port
    assert port is not None
    body = json.dumps(PLAIN).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]  # ... and the rest never comes
        )
        await writer.drain()
        # Another client is served meanwhile: the slow body holds no slot.
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=PLAIN), HANG)
        assert response.status_code == 200, response.text
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
        assert head.startswith(b"HTTP/1.1 408"), head
        [length] = [
            int(h.split(b":", 1)[1])
            for h in head.split(b"\r\n")
            if h.lower().startswith(b"content-length:")
        ]
        payload = await reader.readexactly(length)
    finally:
        writer.close()
    error = json.loads(payload)["error"]
    assert (error["code"], error["type"]) == (408, "RequestTimeout")
    assert "did not arrive within 0.5 s" in error["message"]
