"""A pdserve gateway in-process over real vLLM servers (tests/vllm), and what an OpenAI answer
says once ids and timestamps are set aside: the shape two servers must agree on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from openai import AsyncOpenAI

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.app import Gateway
from pdserve.gateway.dataplane import build_binary
from pdserve.gateway.server import GatewayRunner
from pdserve.gateway.settings import GatewaySettings
from tests.support.chat_cases import LONG_ANSWER_TOKENS
from tests.support.real_vllm import SERVED_NAME, VllmServer, engine_counts
from tests.support.serving import listening_socket, serving

PARITY = "p1"


@dataclass
class GatewayUnderTest:
    gateway: Gateway
    url: str
    client: AsyncOpenAI

    async def folded(self) -> None:
        """Behind the data plane, what it served folded into the gateway's metrics now (its
        poll does so each second); without one, nothing to do."""
        if (front := self.gateway.data_plane) is not None:
            await front.fold_stats(self.gateway.upstream.session)

    async def pushed(self) -> None:
        """Behind the data plane, the routing table pushed now (its loop does so four times a
        second), so that what a test set on the gateway's endpoints (their load) routes the
        next request; without one, nothing to do."""
        if (front := self.gateway.data_plane) is not None:
            await front.push(self.gateway.upstream.session)


@asynccontextmanager
async def gateway_over(
    *,
    decode: Sequence[str],
    render: str | None = None,
    prefill: Sequence[str] = (),
    engine_api: str = "tokens",
    tokens_engines: str = "scale_out",
    kv_transfer: Mapping[str, Any] | None = None,
    operator_config: Mapping[str, Any] | None = None,
    data_plane: Path | Literal["built"] | None = "built",
    **settings: Any,
) -> AsyncIterator[GatewayUnderTest]:
    """A gateway with static endpoints: render -> (prefill ->) decode, or the OpenAI route
    (engine_api="openai", no render) when `render` is None. With `operator_config` (the
    routing config the operator writes for a model), that config with these endpoints.
    Clients reach it through its compiled data plane (`built`: this checkout's, or a binary),
    as a gateway pod's clients do by default; `data_plane=None`: the Python gateway's own
    request path."""
    if data_plane == "built":
        data_plane = build_binary()
    pool = {"service": "static", "port": 8000}
    parity = operator_config["parityHash"] if operator_config else PARITY

    def endpoints(urls: Sequence[str]) -> list[dict[str, Any]]:
        return [{"url": url, "parityHash": parity, "name": url} for url in urls]

    config: dict[str, Any] = {
        "model": SERVED_NAME,
        "engineApi": engine_api,
        "tokensEngines": tokens_engines,
        "parityHash": PARITY,
        "blockSize": 128,
        "routing": {"mode": "Disaggregated" if prefill else "Aggregated"},
        "pools": {
            "render": pool if render else None,
            "prefill": pool if prefill else None,
            "decode": pool,
        },
        "endpoints": {
            "render": endpoints([render] if render else []),
            "prefill": endpoints(prefill),
            "decode": endpoints(decode),
        },
    }
    if kv_transfer is not None:
        config["kvTransfer"] = dict(kv_transfer)
    if operator_config is not None:
        # The pods' ranks as the operator describes its pools' pods (dataParallelLocal).
        for name, listed in config["endpoints"].items():
            ranks = (operator_config["pools"].get(name) or {}).get("dataParallelLocal", 1)
            for endpoint in listed if ranks > 1 else []:
                endpoint["dataParallelLocal"] = ranks
        config = {**operator_config, "endpoints": config["endpoints"]}
        if engine_api == "openai":  # the same engines' OpenAI API, no render pool
            config |= {"engineApi": "openai", "pools": {**config["pools"], "render": None}}
    gateway = Gateway(GatewayConfig.model_validate(config), GatewaySettings(**settings))
    # Listening before the data plane is told where the Python gateway is; the data plane binds
    # its own client port and says which.
    sock = listening_socket()
    if data_plane is not None:
        python_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        gateway.use_data_plane(data_plane, "127.0.0.1:0", python_url)
    async with serving(gateway.app(), sock=sock, runner_class=GatewayRunner) as url:
        if (front := gateway.data_plane) is not None:
            url = f"http://{front.address}"
            # As a Service sends a gateway pod clients once its readiness probe passes: until
            # then (its replicas checked) the data plane hands every request to the Python
            # gateway, whose picks the data plane does not learn from (a prompt's cached rank).
            await until_ready(url)
            await front.push(gateway.upstream.session)
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            yield GatewayUnderTest(gateway, url, client)


async def until_ready(url: str) -> None:
    """Return once the gateway at `url` says it is ready (GET /ready, the pod's readiness probe),
    polled with a deadline."""
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while (answer := await client.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline, f"the gateway never got ready: {answer.text}"
            await asyncio.sleep(0.05)  # polling the gateway's readiness, with a deadline


async def data_plane_stats(gateway: GatewayUnderTest) -> dict[str, Any]:
    """What the gateway's data plane counts: requests served by route (`routes`), hand-overs
    by reason (`fallbacks`)."""
    front = gateway.gateway.data_plane
    assert front is not None
    assert front.control is not None
    async with httpx.AsyncClient() as client:
        answer = await client.get(f"{front.control}/stats", headers=front.control_headers)
    stats: dict[str, Any] = answer.json()
    return stats


def chat_answer(response: Any) -> dict[str, Any]:
    """A chat completion as a client reads it: per choice the content, reasoning, tool calls
    (name and arguments; ids are random) and finish reason, and the token counts."""
    body = as_dict(response)
    choices = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        message = choice["message"]
        choices.append(
            {
                "content": message.get("content"),
                "reasoning": message.get("reasoning"),
                "tool_calls": [
                    (call["function"]["name"], call["function"]["arguments"])
                    for call in message.get("tool_calls") or []
                ],
                "finish_reason": choice["finish_reason"],
                "logprobs": _logprob_tokens(choice.get("logprobs")),
            }
        )
    return {"choices": choices, "usage": _token_counts(body.get("usage"))}


def chat_stream_answer(chunks: Sequence[Any]) -> dict[str, Any]:
    """The same, put together from a stream's chunks."""
    choices: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    usage = None
    for chunk in chunks:
        body = as_dict(chunk)
        usage = body.get("usage") or usage
        for choice in body.get("choices") or []:
            into = choices.setdefault(
                choice["index"],
                {"content": None, "reasoning": None, "tool_calls": [], "finish_reason": None,
                 "logprobs": None},
            )  # fmt: skip
            delta = choice.get("delta") or {}
            for field in ("content", "reasoning"):
                if delta.get(field):
                    into[field] = (into[field] or "") + delta[field]
            for call in delta.get("tool_calls") or []:
                parts = calls.setdefault(choice["index"], {}).setdefault(call["index"], ["", ""])
                function = call.get("function") or {}
                parts[0] += function.get("name") or ""
                parts[1] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
    for index, by_call in calls.items():
        choices[index]["tool_calls"] = [tuple(by_call[i]) for i in sorted(by_call)]
    return {
        "choices": [choices[i] for i in sorted(choices)],
        "usage": _token_counts(usage),
    }


def completion_answer(response: Any) -> dict[str, Any]:
    body = as_dict(response)
    choices = [
        {"text": c["text"], "finish_reason": c["finish_reason"]}
        for c in sorted(body["choices"], key=lambda c: c["index"])
    ]
    return {"choices": choices, "usage": _token_counts(body.get("usage"))}


def completion_stream_answer(chunks: Sequence[Any]) -> dict[str, Any]:
    texts: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        body = as_dict(chunk)
        usage = body.get("usage") or usage
        for choice in body.get("choices") or []:
            into = texts.setdefault(choice["index"], {"text": "", "finish_reason": None})
            into["text"] += choice.get("text") or ""
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
    return {"choices": [texts[i] for i in sorted(texts)], "usage": _token_counts(usage)}


def as_dict(answer: Any) -> dict[str, Any]:
    """An SDK object (or a dict already) as the JSON it came as."""
    return answer.model_dump() if hasattr(answer, "model_dump") else dict(answer)


def _token_counts(usage: Mapping[str, Any] | None) -> tuple[int, int] | None:
    if not usage:
        return None
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


def _logprob_tokens(logprobs: Mapping[str, Any] | None) -> list[tuple[str, int]] | None:
    """The chosen tokens and how many alternatives each lists (values differ in the last
    digits between processes, so they are not compared)."""
    if not logprobs or not logprobs.get("content"):
        return None
    return [(item["token"], len(item.get("top_logprobs") or [])) for item in logprobs["content"]]


def pretty(answer: Mapping[str, Any]) -> str:
    return json.dumps(answer, indent=1, default=str)


async def assert_left_work_is_aborted(
    route: GatewayUnderTest, body: Mapping[str, Any], *, stream: bool, engine: VllmServer
) -> None:
    """Send `body` (a long answer) through `route`, streamed or not, and leave once the gateway
    has it in flight on a decode engine (by the gateway's own count: a client-side clock, the
    engine's /metrics and even a stream's first events can all lag past the whole answer on a
    loaded machine, when the tiny model has generated every token). Then the engine must stop
    the request within a deadline, without finishing it, having generated fewer tokens than
    asked. A try whose request finished anyway is repeated, up to LEAVE_ATTEMPTS."""
    outcomes = []
    for _ in range(LEAVE_ATTEMPTS):
        outcome = await leave_once(route, body, stream=stream, engine=engine)
        if outcome is None:
            return
        outcomes.append(outcome)
    raise AssertionError(
        f"in {LEAVE_ATTEMPTS} tries the request finished instead of stopping: {outcomes}"
    )


# On a loaded 2-core machine the tiny model can generate a whole long answer before the
# client's leaving reaches the gateway (CI saw it in 2 of 4 tries): a finished request is
# tried again. An abort that never works finishes every try, so the test still fails then.
LEAVE_ATTEMPTS = 4


async def leave_once(
    route: GatewayUnderTest, body: Mapping[str, Any], *, stream: bool, engine: VllmServer
) -> str | None:
    """One try of assert_left_work_is_aborted: None when the engine stopped the request
    early, else what it did instead."""
    before = await counts_of(engine)
    payload = {key: value for key, value in body.items() if key != "extra_body"}
    payload |= dict(body.get("extra_body") or {})
    async with httpx.AsyncClient(base_url=route.url, timeout=60) as client:
        if stream:
            payload["stream"] = True
            sent = asyncio.create_task(read_stream(client, payload))
        else:
            sent = asyncio.create_task(client.post("/v1/chat/completions", json=payload))
        try:
            answered_first = await until_decoding(route, sent)
        finally:
            sent.cancel()  # the client leaves: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await sent
    if answered_first is not None:
        return answered_first
    # vLLM counts an aborted request in no finished_reason: it is aborted when it leaves the
    # running batch without finishing.
    deadline = time.monotonic() + 20
    while True:
        after = await counts_of(engine)
        if after.get("running") == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)  # polling another process's counters, with a deadline
    finished = {
        key: after[key] - before.get(key, 0.0) for key in after if key.startswith("finished:")
    }
    generated = after.get("generated", 0.0) - before.get("generated", 0.0)
    assert after.get("running") == 0, f"still running after 20 s: {after}"
    if any(finished.values()) or generated >= LONG_ANSWER_TOKENS:
        return f"finished {finished} after {generated} tokens"
    return None


async def counts_of(engine: VllmServer) -> dict[str, float]:
    """engine_counts off the event loop, which may be serving an in-process gateway."""
    return dict(await asyncio.to_thread(engine_counts, engine))


async def read_stream(client: httpx.AsyncClient, payload: Mapping[str, Any]) -> httpx.Response:
    """A streamed chat read to its end (unless the caller leaves first)."""
    async with client.stream("POST", "/v1/chat/completions", json=payload) as answer:
        await answer.aread()
        return answer


async def until_decoding(route: GatewayUnderTest, sent: asyncio.Task[httpx.Response]) -> str | None:
    """Return None once the gateway has the request in flight on a decode engine (polled, with
    a deadline), or what the client got when the request was answered first: the whole answer
    can come back between two polls of the data plane's /stats on a loaded machine."""
    decode = route.gateway.endpoints.pools["decode"]
    deadline = time.monotonic() + 30

    async def decoding() -> bool:
        if route.gateway.data_plane is None:
            return any(endpoint.inflight for endpoint in decode)
        inflight = (await data_plane_stats(route)).get("engineInflight") or {}
        return any(inflight.get(endpoint.key) for endpoint in decode)

    while not await decoding():
        if sent.done():
            answer = sent.result()
            return f"answered before the client left: {answer.status_code} {answer.text[:300]}"
        assert time.monotonic() < deadline, "the gateway never sent the request to decode"
        await asyncio.sleep(0.005)  # polling the gateway's count, with a deadline
    return None


async def table_routes(gateway: GatewayUnderTest, route: str) -> None:
    """Until the data plane's routing table routes the model so (the engines checked)."""
    front = gateway.gateway.data_plane
    assert front is not None
    deadline = time.monotonic() + 60
    while front.status().get("route") != route:
        assert time.monotonic() < deadline, front.status()
        await asyncio.sleep(0.05)  # another process's state, polled with a deadline
