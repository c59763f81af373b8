"""Clients' connections that sit idle, on both request paths: one never used, one left idle
after an answer, and one whose request head never completes are all closed once the keep-alive
timeout (GatewaySettings.keepalive_timeout, `--keepalive-timeout-seconds`) has passed, while a
connection reused at once is served."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.sim_gateway import PLAIN, Stack, pd_stack

KEEPALIVE = 1.0
HANG = KEEPALIVE + 5  # the bound plus a busy machine's slack: later is no bound at all
BODY = json.dumps(PLAIN).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
    + BODY
)


async def answered(reader: asyncio.StreamReader) -> int:
    """One whole answer's status, read off the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def closed_within(reader: asyncio.StreamReader) -> float:
    """Seconds until the gateway closes the connection, having sent nothing more."""
    began = time.monotonic()
    rest = await asyncio.wait_for(reader.read(), HANG)
    assert rest == b"", rest[:200]
    return time.monotonic() - began


@pytest.mark.parametrize("shape", ["never used", "idle after an answer", "head never ends"])
async def test_idle_connections_are_closed_after_the_keepalive_timeout(
    stack: Stack, request_path: str, shape: str
) -> None:
    client = await pd_stack(
        stack, data_plane=behind_data_plane(request_path), keepalive_timeout=KEEPALIVE
    )
    host, port = client.base_url.host, client.base_url.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if shape == "idle after an answer":
            for _ in range(2):  # the second at once, on the same connection: kept alive
                writer.write(REQUEST)
                assert await answered(reader) == 200
        elif shape == "head never ends":
            writer.write(REQUEST[:60])  # ... and the rest of the head never comes
        await writer.drain()
        waited = await closed_within(reader)
    finally:
        writer.close()
    assert waited >= KEEPALIVE / 2, f"closed after {waited:.2f} s, before the timeout"
