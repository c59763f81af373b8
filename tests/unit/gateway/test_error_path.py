"""The gateway's one error path: whatever a request raises, the client gets an OpenAI-shaped
error with the right status (after its stream started: an error event and [DONE]), never a
bare 500, a stack trace or an engine's address."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from pdserve.gateway.app import Gateway
from pdserve.gateway.endpoints import NoEndpoints
from pdserve.gateway.errors import GatewayError, UpstreamFailed
from pdserve.gateway.streaming import DerenderPipeline
from tests.support.gateway_fakes import FakeUpstream, fake_gateway

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
PROMPT_IDS = list(range(1, 9))
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
ANSWER = {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]}
DERENDERED = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]}
Served = tuple[TestClient[Any, Any], Gateway, FakeUpstream]


def rendered() -> dict[str, Any]:
    return {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 5}, "stream": False}


def render_down(stage: str = "render") -> UpstreamFailed:
    return UpstreamFailed(stage, f"{stage} at http://10.1.2.3:8000: HTTP 500: engine exploded")


@pytest.fixture
async def pd() -> AsyncIterator[Served]:
    gateway, upstream = fake_gateway("tokens", "Disaggregated", api_keys=("key",))
    async with TestClient(TestServer(gateway.app())) as client:
        yield client, gateway, upstream


async def post(client: TestClient[Any, Any], body: Any, **kwargs: Any) -> ClientResponse:
    headers = {"Authorization": "Bearer key", "X-Request-Id": "req-7"}
    headers.update(kwargs.pop("headers", {}))
    if "data" not in kwargs:
        kwargs["json"] = body
    return await client.post("/v1/chat/completions", headers=headers, **kwargs)


async def openai_error(response: ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert "10.1.2.3" not in error["message"]
    assert "Traceback" not in error["message"]
    return error  # type: ignore[no-any-return]


def requests_counted(gateway: Gateway, outcome: str) -> float:
    return sum(
        s.value
        for m in gateway.metrics.registry.collect()
        for s in m.samples
        if s.name == "pdserve_gateway_requests_total" and s.labels.get("outcome") == outcome
    )


async def test_render_failing_on_every_replica_is_a_502(pd: Served) -> None:
    client, gateway, upstream = pd
    upstream.script = {"render": [render_down()]}
    error = await openai_error(await post(client, CHAT), 502)
    assert error["type"] == "UpstreamError"
    assert error["message"] == "render at a replica: HTTP 500: engine exploded"
    assert requests_counted(gateway, "error_502") == 1


async def test_an_upstream_timeout_is_a_504(pd: Served) -> None:
    client, _, upstream = pd
    upstream.script = {"render": [UpstreamFailed("render", "render timed out", timed_out=True)]}
    await openai_error(await post(client, CHAT), 504)


async def test_derender_failing_is_a_502(pd: Served) -> None:
    client, _, upstream = pd
    upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [ANSWER],
        "derender": [render_down("derender")],
    }
    await openai_error(await post(client, CHAT), 502)
    assert upstream.stages() == ["render", "prefill", "decode", "derender"]


async def test_the_local_prefill_retry_on_decode_failing_too_is_a_502(pd: Served) -> None:
    client, _, upstream = pd
    upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [
            UpstreamFailed("decode", "decode at http://10.1.2.3:8000: HTTP 500: KV transfer"),
            render_down("decode"),
        ],
    }
    error = await openai_error(await post(client, CHAT), 502)
    assert error["message"].startswith("decode at a replica")
    assert upstream.stages() == ["render", "prefill", "decode", "decode"]


async def test_an_unexpected_failure_is_a_generic_500_logged_with_its_stack(
    pd: Served, caplog: pytest.LogCaptureFixture
) -> None:
    client, gateway, upstream = pd
    upstream.script = {"render": [KeyError("secret internal detail")]}
    with caplog.at_level(logging.ERROR, logger="pdserve.gateway"):
        response = await post(client, CHAT)
        error = await openai_error(response, 500)
    own = response.headers["X-PDServe-Request-Id"]  # the gateway's id, not the client's req-7
    assert error["message"] == f"the gateway failed to serve the request (request id {own})"
    assert error["type"] == "InternalServerError"
    assert "secret" not in error["message"]
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.request_id == own  # type: ignore[attr-defined]
    assert record.exc_info is not None
    assert record.exc_info[0] is KeyError
    assert requests_counted(gateway, "error_500") == 1


async def test_no_endpoints_is_still_a_503(pd: Served) -> None:
    client, gateway, upstream = pd
    upstream.script = {"render": [NoEndpoints("no healthy decode endpoint")]}
    error = await openai_error(await post(client, CHAT), 503)
    assert error["message"] == "no healthy decode endpoint"
    assert requests_counted(gateway, "no_endpoints") == 1


async def test_a_gateway_error_with_an_address_loses_it(pd: Served) -> None:
    client, _, upstream = pd
    upstream.script = {
        "render": [GatewayError(502, "render at http://10.1.2.3:8000 answered non-JSON")]
    }
    error = await openai_error(await post(client, CHAT), 502)
    assert error["message"] == "render at a replica answered non-JSON"


@pytest.mark.parametrize(
    ("data", "content_type", "message"),
    [
        (b'{"messages": "\xff\xfe"}', "application/json", "request body is not valid utf-8"),
        (b"{}", "application/json; charset=no-such-charset", "request body's charset"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "request body is nested too deeply"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "application/json", "request body is nested"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "application/json", "request body has a number"),
    ],
)
async def test_bodies_that_cannot_be_read_are_400s(
    pd: Served, data: bytes, content_type: str, message: str
) -> None:
    client, _, upstream = pd
    response = await post(client, None, data=data, headers={"Content-Type": content_type})
    error = await openai_error(response, 400)
    assert error["message"].startswith(message)
    assert upstream.calls == []


async def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_400(pd: Served) -> None:
    client, _, upstream = pd
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    response = await post(client, None, data=b"not gzip", headers=headers)
    error = await openai_error(response, 400)
    assert error["message"].startswith(
        "request body does not decode as its Content-Encoding: gzip says"
    )
    assert upstream.calls == []


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress"])
async def test_a_content_encoding_the_gateway_does_not_decode_is_a_415(
    pd: Served, encoding: str
) -> None:
    client, gateway, upstream = pd
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    response = await post(client, None, data=json.dumps(CHAT).encode(), headers=headers)
    error = await openai_error(response, 415)
    assert error["message"] == (
        f"Content-Encoding: {encoding} is not supported; send the body as gzip, deflate or "
        "identity (uncompressed)"
    )
    assert upstream.calls == []
    assert requests_counted(gateway, "error_415") == 1


async def test_a_compressed_body_is_served(pd: Served) -> None:
    client, _, upstream = pd
    upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [ANSWER],
        "derender": [DERENDERED],
    }
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    data = gzip.compress(json.dumps(CHAT).encode())
    response = await post(client, None, data=data, headers=headers)
    assert response.status == 200, await response.text()
    [render] = upstream.sent("render")
    assert render["messages"] == CHAT["messages"]


async def test_an_unknown_expectation_is_a_417_in_the_openai_shape(pd: Served) -> None:
    client, _, upstream = pd
    response = await post(client, CHAT, headers={"Expect": "0"})
    error = await openai_error(response, 417)
    assert error["message"].startswith("unknown Expect: 0")
    assert upstream.calls == []


async def test_a_failure_after_the_stream_started_ends_it_with_an_error_event_and_done(
    pd: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, gateway, upstream = pd

    def broken(*_: object) -> None:
        raise RuntimeError("a bug in the gateway")

    # Not an upstream fault (the routes report those themselves): a failure of the gateway's
    # own code mid-stream, which only the one error path can report.
    monkeypatch.setattr(DerenderPipeline, "push", broken)
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "derender": [{"chunk": chunk}] * 4,
    }
    event = {"choices": [{"index": 0, "token_ids": [10], "finish_reason": None}]}
    upstream.stream_lines = [f"data: {json.dumps(event)}\n".encode()]
    response = await post(client, {**CHAT, "stream": True})
    assert response.status == 200
    text = await response.text()
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500
    own = response.headers["X-PDServe-Request-Id"]
    assert error["message"] == f"the gateway failed to serve the request (request id {own})"
    assert requests_counted(gateway, "error_500") == 1
    assert upstream.aborted == [("http://decode", [f"generate-tokens-{own}"])]  # it stops


async def test_other_endpoints_answer_openai_errors_too(pd: Served) -> None:
    client, _, _ = pd
    error = await openai_error(await client.get("/v1/models"), 401)
    assert error["type"] == "AuthenticationError"
    key = {"Authorization": "Bearer key"}  # without one, every path but the probes is a 401
    error = await openai_error(await client.get("/v1/nothing-here", headers=key), 404)
    assert error["message"] == "Not Found"
    response = await client.get("/v1/chat/completions", headers=key)
    assert (await openai_error(response, 405))["type"] == "APIError"
    assert "POST" in response.headers["Allow"]


async def test_a_stream_broken_by_its_derender_does_not_name_the_render_server(
    pd: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pdserve.gateway")
    client, _, upstream = pd
    upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "derender": [render_down("derender")],
    }
    event = {"choices": [{"index": 0, "token_ids": [10], "finish_reason": "stop"}]}
    upstream.stream_lines = [f"data: {json.dumps(event)}\n".encode(), b"data: [DONE]\n"]
    response = await post(client, {**CHAT, "stream": True})
    text = await response.text()
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"].startswith("derender failed: derender at a replica")
    assert "10.1.2.3" not in text
    assert "derender at http://10.1.2.3:8000" in caplog.text  # the log keeps it
