"""Who may call the gateway and how a request is named: every endpoint but the probes behind the
keys (the peers' key for the operational and admission ones), bounded and expiring admission
holds, no engine address in a client's error, and the gateway's own request ids (a client's
X-Request-Id is logged and echoed, never an engine's id)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.localplane import free_port
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import (
    LONG,
    PLAIN,
    Stack,
    engine,
    ep,
    gateway_replicas,
    pd_stack,
    python_gateways_only,
    routing,
    until,
)

API = {"Authorization": "Bearer client-key"}
PEER = {"Authorization": "Bearer peer-key"}
KEYS: dict[str, Any] = {"api_keys": ("client-key",), "peer_keys": ("peer-key",)}

CLIENT_ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
]
PEER_ROUTES = [("GET", "/status"), ("GET", "/admission")]
# Open like the probes: Prometheus and the operator's transport monitor scrape it without a key.
OPEN_ROUTES = [("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")]


async def aggregated(stack: Stack, **settings: Any) -> httpx.AsyncClient:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    endpoints = {"render": [ep(render)], "decode": [ep(decode)]}
    return await stack.gateway(routing(prefill=False, endpoints=endpoints), **settings)


async def call(
    client: httpx.AsyncClient, method: str, path: str, headers: dict[str, Any] | None = None
) -> httpx.Response:
    body = {**PLAIN, "max_tokens": 5}
    if path == "/v1/completions":
        body = {"model": PLAIN["model"], "prompt": "hi", "max_tokens": 5}
    if path == "/admission/hold":
        body = {"replicas": ["http://p0"]}
    if method == "GET":
        return await client.get(path, headers=headers)
    return await client.post(path, json=body, headers=headers)


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("AuthenticationError", 401)
    assert "Authorization: Bearer" in error["message"]


async def test_every_endpoint_but_the_probes_needs_a_key(stack: Stack) -> None:
    client = await aggregated(stack, **KEYS)
    for method, path in OPEN_ROUTES:
        assert (await call(client, method, path)).status_code == 200, path
    metrics = (await client.get("/metrics")).text
    assert "127.0.0.1" not in metrics  # counts by route, stage and pod name: no address
    for method, path in [*CLIENT_ROUTES, *PEER_ROUTES, ("POST", "/admission/hold")]:
        assert_unauthorized(await call(client, method, path))
        assert_unauthorized(await call(client, method, path, {"Authorization": "Bearer nope"}))
        assert_unauthorized(await call(client, method, path, {"Authorization": "client-key"}))
    for method, path in [*CLIENT_ROUTES, *PEER_ROUTES]:
        assert (await call(client, method, path, API)).status_code == 200, path
    # The peers' key opens the operational and admission endpoints, not the model.
    for method, path in PEER_ROUTES:
        assert (await call(client, method, path, PEER)).status_code == 200, path
    for method, path in CLIENT_ROUTES:
        assert_unauthorized(await call(client, method, path, PEER))
    # An unknown path is refused as unauthorized too: it says nothing without a key.
    assert_unauthorized(await client.get("/v1/unknown"))
    assert (await client.get("/v1/unknown", headers=API)).status_code == 404


async def test_a_non_utf8_authorization_header_is_refused_as_unauthorized(stack: Stack) -> None:
    client = await aggregated(stack, **KEYS)
    for method, path in [*CLIENT_ROUTES, *PEER_ROUTES]:
        garbled = await call(client, method, path, {"Authorization": b"Bearer \xff\xfe\x80key"})
        assert_unauthorized(garbled)


async def test_a_peer_key_alone_guards_the_hold_only(stack: Stack) -> None:
    """Without API keys the model and the read-only operational endpoints stay open; holding a
    prefill slot takes the peer key."""
    client = await aggregated(stack, peer_keys=("peer-key",))
    assert (await call(client, "POST", "/v1/chat/completions")).status_code == 200
    for method, path in PEER_ROUTES:
        assert (await call(client, method, path)).status_code == 200
    assert_unauthorized(await call(client, "POST", "/admission/hold"))
    assert_unauthorized(await call(client, "POST", "/admission/hold", API))
    async with client.stream(
        "POST", "/admission/hold", json={"replicas": ["http://p0"]}, headers=PEER
    ) as held:
        assert held.status_code == 200


@python_gateways_only
async def test_keyed_replicas_find_each_other_and_admit_through_the_leader(stack: Stack) -> None:
    """With keys set the replicas' polls and holds carry the peer key: they still elect one
    leader, and a follower's document holds its slot there."""
    replicas = await gateway_replicas(stack, hang=1, **KEYS)
    for client in replicas.clients:
        client.headers.update(API)
    leader = replicas.gateways[replicas.leader]
    follower = replicas.gateways[replicas.follower]
    assert follower.peers.leader() == replicas.urls[replicas.leader]
    document = asyncio.create_task(
        replicas.clients[replicas.follower].post("/v1/chat/completions", json=LONG)
    )
    await until(lambda: replicas.reached_prefill(1) == 1)
    assert leader.admission.long_in_flight == 1
    assert follower.admission.long_in_flight == 0
    assert follower.peers.leader_errors == 0
    document.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await document
    await until(lambda: leader.admission.long_in_flight == 0)


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_one_peer_holds_a_bounded_number_of_slots(stack: Stack, request_path: str) -> None:
    """A peer has at most max_inflight holds open (queued or granted): more would be admitted
    anyway once they age, overrunning the limit for every replica's documents."""
    client = await pd_stack(
        stack, max_inflight=2, peer_keys=("peer-key",), data_plane=request_path == "dataplane"
    )
    client.headers.update(PEER)
    gateway = stack.gateway_server
    async with contextlib.AsyncExitStack() as holds:
        lines = []  # each hold's line iterator, kept open with its connection
        for replica in ("http://p0", "http://p1"):
            granted = await holds.enter_async_context(
                client.stream("POST", "/admission/hold", json={"replicas": [replica]})
            )
            assert granted.status_code == 200
            lines.append(granted.aiter_lines())
            assert await lines[-1].__anext__() == f"granted {replica}"
        refused = await client.post("/admission/hold", json={"replicas": ["http://p2"]})
        assert refused.status_code == 429
        assert "admission holds open" in refused.json()["error"]["message"]
        assert (await stack.admission()).replicas == {"http://p0": 1, "http://p1": 1}
    await stack.admission_until(lambda queue: not queue.replicas)
    await until(lambda: not gateway.admission_handlers.holds)
    async with client.stream("POST", "/admission/hold", json={"replicas": ["http://p2"]}) as again:
        assert again.status_code == 200  # the peer may hold slots again


async def test_a_hold_ends_at_its_deadline(stack: Stack) -> None:
    """A holder that never closes its connection loses the slot after the hold's deadline (its
    prefill call's own timeout), which the grant names."""
    client = await pd_stack(stack, first_byte_timeout=0.5, peer_keys=("peer-key",))
    client.headers.update(PEER)
    gateway = stack.gateway_server
    async with client.stream("POST", "/admission/hold", json={"replicas": ["http://p0"]}) as held:
        assert held.headers["X-PDServe-Hold-Seconds"] == "0.5"
        lines = [line async for line in held.aiter_lines()]  # ends by itself
    assert lines == ["granted http://p0"]
    assert gateway.admission.in_flight == {}


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_client_errors_do_not_name_engine_addresses(
    stack: Stack,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    request_path: str,
) -> None:
    render = await stack.render()
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    endpoints = {"render": [ep(render)], "decode": [ep(gone)]}
    client = await stack.gateway(
        routing(prefill=False, endpoints=endpoints),
        load_scrape_seconds=None,
        data_plane=request_path == "dataplane",
    )
    caplog.set_level(logging.WARNING, "pdserve.gateway")
    for stream in (False, True):
        stack.gateway_server.endpoints.pools["decode"][0].down_until = 0.0  # try it again
        failed = await client.post("/v1/chat/completions", json={**PLAIN, "stream": stream})
        assert failed.status_code == 502, failed.text
        message = failed.json()["error"]["message"]
        assert "127.0.0.1" not in message, message
        assert message.startswith("decode at a replica")
    # The log keeps where it failed: the Python gateway's, or the data plane's (its stderr,
    # the gateway container's log beside the Python gateway's).
    assert gone in (caplog.text if request_path == "python" else capfd.readouterr().err)


# ---- request ids -------------------------------------------------------------------------------
async def first_token(lines: AsyncIterator[str]) -> str:
    """Read up to the first chunk; `lines` stays open (a dropped iterator closes the stream)."""
    async for line in lines:
        if line.startswith("data: {"):
            return line
    raise AssertionError("the stream ended before its first chunk")


async def test_clients_reusing_one_request_id_do_not_touch_each_others_work(
    stack: Stack,
) -> None:
    """Two clients send the same X-Request-Id; the second leaves mid-stream. Its abort ends its
    own work on the engine: the first still gets its whole answer."""
    client = await pd_stack(stack)
    decode = stack.engines["decode"]
    headers = {"X-Request-Id": "shared"}
    body = {
        **PLAIN,
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as first:
        assert first.headers["X-Request-Id"] == "shared"
        first_lines = first.aiter_lines()
        lines = [await first_token(first_lines)]
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as second:
            second_lines = second.aiter_lines()
            await first_token(second_lines)
            assert len(decode.core.running) == 2
        # The second client left: its work is aborted, the first's goes on.
        await until(lambda: len(decode.core.running) <= 1)
        lines += [line async for line in first_lines if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not [e for e in events if "error" in e]
    assert events[-1]["usage"]["completion_tokens"] == 3000
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_the_response_echoes_the_client_id_and_names_the_gateway_id(
    stack: Stack, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    client = await pd_stack(stack, request_log=log, **KEYS)
    headers = {**API, "X-Request-Id": "mine-1"}
    answer = await client.post("/v1/chat/completions", json=PLAIN, headers=headers)
    assert answer.status_code == 200
    assert answer.headers["X-Request-Id"] == "mine-1"
    own = answer.headers["X-PDServe-Request-Id"]
    assert own.startswith("pdserve-")
    assert answer.json()["id"] == own
    streamed = await client.post(
        "/v1/chat/completions", json={**PLAIN, "stream": True}, headers=headers
    )
    assert streamed.headers["X-Request-Id"] == "mine-1"
    assert streamed.headers["X-PDServe-Request-Id"] not in ("mine-1", own)
    refused = await client.get("/v1/models", headers={"X-Request-Id": "mine-2"})
    assert (refused.status_code, refused.headers["X-Request-Id"]) == (401, "mine-2")
    # An id that is no printable ASCII (or too long) is neither echoed nor logged.
    odd = await client.post(
        "/v1/chat/completions", json=PLAIN, headers={**API, "X-Request-Id": "x" * 300}
    )
    assert odd.status_code == 200
    assert "X-Request-Id" not in odd.headers

    def entries() -> list[dict[str, Any]]:
        text = log.read_text() if log.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    await until(lambda: len(entries()) == 3)
    first, second, third = entries()
    assert (first["request_id"], first["client_request_id"]) == (own, "mine-1")
    assert second["client_request_id"] == "mine-1"
    assert second["request_id"] == streamed.headers["X-PDServe-Request-Id"]
    assert third["client_request_id"] is None
    assert third["request_id"].startswith("pdserve-")
