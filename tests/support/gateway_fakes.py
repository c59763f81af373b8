"""A route with everything real but the network: a fake upstream client answers each stage
from a script, so routes run without sockets."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import aiohttp
from aiohttp.test_utils import make_mocked_request

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.affinity import Conversations, DecodeKv, PrefixIndex
from pdserve.gateway.app import Gateway
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.errors import LeaseExpiring
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.fairqueue import PrefillAdmission
from pdserve.gateway.hops import Hops
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_route import OpenAIRoute
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.placement import Placement
from pdserve.gateway.planner import RoutePlanner
from pdserve.gateway.policy import AutoPolicy
from pdserve.gateway.settings import GatewaySettings
from pdserve.gateway.tokens_route import TokensRoute
from pdserve.gateway.upstream import UpstreamClient
from pdserve.vllm.protocol import AbortRequest

MODEL = "qwen"


def config(
    engine_api: str = "tokens",
    mode: str = "Disaggregated",
    kv_transfer: dict[str, Any] | None = None,
    tokens_engines: str = "scale_out",
    urls: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """`urls`: each pool's one endpoint (fake addresses unless given)."""
    pool = {"service": "x", "port": 8000}
    urls = urls or {
        "render": "http://render",
        "prefill": "http://prefill",
        "decode": "http://decode",
    }
    return GatewayConfig.model_validate(
        {
            "model": MODEL,
            "engineApi": engine_api,
            "tokensEngines": tokens_engines,
            "parityHash": "p1",
            "routing": {"mode": mode, "slo": {}},
            "pools": {"render": pool if engine_api == "tokens" else None, "prefill": pool,
                      "decode": pool},
            "endpoints": {
                pool_name: [{"url": url, "parityHash": "p1"}]
                for pool_name, url in urls.items()
                if engine_api == "tokens" or pool_name != "render"
            },
            "kvTransfer": kv_transfer or {},
        }
    )  # fmt: skip


@dataclass
class Call:
    stage: str
    path: str
    body: dict[str, Any]
    url: str = ""


class FakeStream:
    """The part of aiohttp's response a decode stream reads; `stall`: after its lines the
    engine goes quiet instead of closing the stream."""

    def __init__(self, lines: list[bytes], *, stall: bool = False) -> None:
        self.status = 200
        self.lines, self.stall = lines, stall
        self.closed = False
        """Closed before its end (an OpenAI engine then aborts the request)."""

    @property
    def content(self) -> AsyncIterator[bytes]:
        async def lines() -> AsyncIterator[bytes]:
            for line in self.lines:
                yield line
            if self.stall:
                await asyncio.Event().wait()  # a hung engine: nothing more, ever

        return lines()

    def release(self) -> None: ...

    def close(self) -> None:
        self.closed = True


HANG = object()
"""A scripted outcome: the call never answers (until the caller is cancelled)."""


class FakeUpstream(UpstreamClient):
    """Answers each stage with the next scripted outcome: a JSON answer, or an exception to
    raise; or, when a stage's script is a function, what it answers for the call's body (every
    call). Streams answer with `stream_lines` (a function: of the body), then go quiet with
    `stream_stalls`."""

    def __init__(
        self, endpoints: Endpoints, metrics: GatewayMetrics, settings: GatewaySettings
    ) -> None:
        super().__init__(endpoints, metrics, settings)
        self.script: dict[str, list[Any] | Callable[[dict[str, Any]], Any]] = {}
        self.stream_lines: list[bytes] | Callable[[dict[str, Any]], list[bytes]] = []
        self.stream_stalls = False
        self.calls: list[Call] = []
        self.aborted: list[tuple[str, list[str]]] = []
        """(URL, request_ids) of every abort posted."""
        self.streams: list[FakeStream] = []
        self.hanging = asyncio.Event()
        """Set when a call scripted to HANG is under way."""

    def stages(self) -> list[str]:
        return [c.stage for c in self.calls]

    def sent(self, stage: str) -> list[dict[str, Any]]:
        return [c.body for c in self.calls if c.stage == stage]

    async def post_json(
        self,
        stage: str,
        candidates: list[Endpoint],
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout: float,  # noqa: ASYNC109 - the real client's signature
        *,
        retry: bool = True,
        affinity: Mapping[str, int] | None = None,
        prefill_tokens: int = 0,
        deadline: float | None = None,
        tried: list[Endpoint] | None = None,
        start_by: float | None = None,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        if start_by is not None and time.monotonic() >= start_by:
            raise LeaseExpiring(stage, f"prefill's KV lease runs out before {stage} could pull it")
        self.calls.append(Call(stage, path, copy.deepcopy(dict(body)), candidates[0].url))
        if tried is not None:
            tried.append(candidates[0])
        script = self.script[stage]
        outcome = script(copy.deepcopy(dict(body))) if callable(script) else script.pop(0)
        if outcome is HANG:
            self.hanging.set()
            await asyncio.Event().wait()  # until the caller is cancelled
        if isinstance(outcome, Exception):
            raise outcome
        return candidates[0], copy.deepcopy(outcome)

    async def post_stream(
        self,
        endpoint: Endpoint,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        deadline: float | None = None,
    ) -> aiohttp.ClientResponse:
        self.calls.append(Call("decode_stream", path, copy.deepcopy(dict(body)), endpoint.url))
        lines = self.stream_lines
        lines = lines(copy.deepcopy(dict(body))) if callable(lines) else lines
        stream = FakeStream(lines, stall=self.stream_stalls)
        self.streams.append(stream)
        return cast(aiohttp.ClientResponse, stream)

    async def post_abort(
        self, endpoint: Endpoint, body: AbortRequest, headers: Mapping[str, str]
    ) -> None:
        self.aborted.append((endpoint.url, body["request_ids"]))


@dataclass
class Rig:
    route: TokensRoute | OpenAIRoute
    upstream: FakeUpstream
    planner: RoutePlanner
    metrics: GatewayMetrics

    def exchange(self, body: dict[str, Any], *, chat: bool = True) -> Exchange:
        selection = self.planner.endpoints.select(self.planner.needed_pools(), ["prefill"])
        plan = self.planner.settle(selection)
        request = make_mocked_request("POST", "/v1/chat/completions")
        return Exchange(
            request=request,
            body={"model": MODEL, **body},
            chat=chat,
            request_id="req-1",
            selection=selection,
            pd=plan.pd,
            started=time.monotonic(),
            tokens_api=isinstance(self.route, TokensRoute),
            headers={"X-Request-Id": "req-1"},
        )

    def fallbacks(self, reason: str) -> float:
        return float(self.metrics.fallbacks.labels(reason)._value.get())


def rig(
    engine_api: str = "tokens",
    mode: str = "Disaggregated",
    kv_transfer: dict[str, Any] | None = None,
    **settings_: Any,
) -> Rig:
    """A route wired as app.py wires it, on the fake upstream (GatewaySettings: `settings_`;
    `kv_transfer`: the routing config's kvTransfer)."""
    cfg, settings = config(engine_api, mode, kv_transfer), GatewaySettings(**settings_)
    endpoints, metrics = Endpoints(cfg), GatewayMetrics()
    upstream = FakeUpstream(endpoints, metrics, settings)
    admission = PrefillAdmission(settings.fair_queue)
    peers = PeerAdmission(admission, lambda: upstream.session)
    planner = RoutePlanner(
        cfg, endpoints, AutoPolicy(settings.policy), admission, peers, metrics,
        endpoint_wait_seconds=0, engine_seconds_scale=1, step_window_seconds=2,
    )  # fmt: skip
    placement = Placement(cfg.block_size, PrefixIndex(), Conversations())
    hops = Hops(upstream, planner, placement, admission, peers, settings)
    route: TokensRoute | OpenAIRoute
    if engine_api == "tokens":
        decode_kv = DecodeKv(ttl=cfg.kv_transfer.decode_blocks_ttl_seconds)
        route = TokensRoute(cfg, settings, upstream, hops, planner, placement, decode_kv, metrics)
    else:
        route = OpenAIRoute(upstream, hops, planner, placement, metrics)
    return Rig(route, upstream, planner, metrics)


def fake_gateway(
    engine_api: str = "tokens",
    mode: str = "Disaggregated",
    tokens_engines: str = "scale_out",
    **settings: Any,
) -> tuple[Gateway, FakeUpstream]:
    """The whole gateway (intake, error path, routes) on the fake upstream: serve its app()
    with aiohttp's test client."""
    with mock.patch(
        "pdserve.gateway.app.UpstreamClient",
        lambda endpoints, metrics, settings: FakeUpstream(endpoints, metrics, settings),
    ):
        gateway = Gateway(
            config(engine_api, mode, tokens_engines=tokens_engines),
            GatewaySettings(load_scrape_seconds=None, **settings),
        )
    assert isinstance(gateway.upstream, FakeUpstream)
    return gateway, gateway.upstream


def written(exchange: Exchange) -> list[Any]:
    """The SSE events a streamed answer wrote to its (mocked) client, `[DONE]` as the string."""
    write = cast(mock.Mock, exchange.request._payload_writer.write)  # make_mocked_request's
    data = b"".join(call.args[0] for call in write.call_args_list).decode()
    events: list[Any] = []
    for line in data.splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def pending_tasks() -> list[asyncio.Task[Any]]:
    """Tasks still running besides the caller's (what a finished request must not leave)."""
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
