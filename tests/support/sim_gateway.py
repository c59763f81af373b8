"""The gateway over simulated render servers and engines on loopback ports: the requests the
tests send, engine and routing configs, a stack of simulators plus gateways, and the pollers and
metric readers the gateway suites share."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.app import Gateway
from pdserve.gateway.dataplane import build_binary
from pdserve.gateway.fairqueue import FairQueueSettings, QueueState
from pdserve.gateway.server import GatewayRunner
from pdserve.gateway.settings import GatewaySettings
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig, RenderServer
from tests.support.serving import listening_socket, serving, serving_engine

MODEL = "qwen"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": "auto",
    "max_tokens": 200,
}

PLAIN: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 200,
}

PEER_KEY = "the-replicas-peer-key"
"""What gateway_replicas' replicas present to each other."""

LONG = {**PLAIN, "messages": [{"role": "user", "content": " ".join(["hello world"] * 400)}],
        "max_tokens": 20}  # fmt: skip

RENDER = RenderConfig(
    model="Qwen/Qwen3-8B",
    served_model_name=MODEL,
    reasoning_parser="qwen3",
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
)


def engine(role: str, *, api: str = "tokens", policy: str = "fail") -> EngineConfig:
    return EngineConfig(
        model="Qwen/Qwen3-8B",
        served_model_name=MODEL,
        role=role,
        api=api,
        scheduler=SchedulerConfig(time_scale=0.01),
        transfer=TransferConfig(load_failure_policy=policy),
        behaviour=ModelBehaviour(reasoning=True),
        render=RENDER,
    )


class Stack:
    """Simulators plus a gateway, all on loopback ports; `data_plane`: the request path of the
    gateways it starts unless one is named."""

    def __init__(self, exits: AsyncExitStack, *, data_plane: bool = False) -> None:
        self.exits = exits
        self.data_plane = data_plane
        self.engines: dict[str, EngineServer] = {}
        self.renders: list[RenderServer] = []

    async def start(
        self, server: Any, port: int | None = None, sock: socket.socket | None = None
    ) -> str:
        runner = GatewayRunner if isinstance(server, Gateway) else web.AppRunner
        return await self.exits.enter_async_context(
            serving(server.app(), port=port, runner_class=runner, sock=sock)
        )

    async def engine(self, name: str, config: EngineConfig) -> str:
        """The engine on a port listening before it is built (serving_engine)."""
        server, url = await self.exits.enter_async_context(serving_engine(config))
        self.engines[name] = server
        return url

    async def render(self, config: RenderConfig = RENDER) -> str:
        server = RenderServer(config)
        self.renders.append(server)
        return await self.start(server)

    async def gateway(
        self, config: dict[str, Any], *, data_plane: bool | None = None, **settings: Any
    ) -> httpx.AsyncClient:
        """A gateway over `config`; with `data_plane` (None: the stack's), behind the compiled
        data plane (as `pdserve gateway --data-plane` runs it): the client is the data
        plane's."""
        gateway = Gateway(GatewayConfig.model_validate(config), GatewaySettings(**settings))
        self.gateway_server = gateway
        if self.data_plane if data_plane is None else data_plane:
            # Listening before the data plane is told where the Python gateway is.
            sock = listening_socket()
            python_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            gateway.use_data_plane(build_binary(), "127.0.0.1:0", python_url)
            await self.start(gateway, sock=sock)
            assert gateway.data_plane is not None
            assert gateway.data_plane.address is not None
            url = f"http://{gateway.data_plane.address}"
        else:
            url = await self.start(gateway)
        return await self.exits.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))

    async def data_plane_stats(self) -> dict[str, Any]:
        """The data plane's `GET /stats` (its counters: what it served, handed over, ...)."""
        front = self.gateway_server.data_plane
        assert front is not None
        assert front.control is not None
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{front.control}/stats", headers=front.control_headers)
        return dict(answer.json())

    async def admission(self) -> QueueState:
        """The gateway's long-prefill queue now, wherever it runs (behind the data plane, read
        from the data plane afresh)."""
        return await self.gateway_server.admission.fresh_state()

    async def admission_until(
        self, condition: Callable[[QueueState], bool], deadline_seconds: float = 20
    ) -> QueueState:
        """The queue once `condition` holds of it (requests in flight change it)."""

        async def poll() -> QueueState:
            while not condition(state := await self.admission()):  # noqa: ASYNC110 - another
                # task's (or the data plane's) state, polled with a deadline
                await asyncio.sleep(0.01)
            return state

        return await asyncio.wait_for(poll(), deadline_seconds)

    async def at_its_limit(self) -> bool:
        """Whether the gateway serves as many completions as `max_inflight` allows (behind the
        data plane, which admits them, by the data plane's count)."""
        gateway = self.gateway_server
        if gateway.data_plane is not None:
            inflight = int((await self.data_plane_stats())["inflight"])
            return inflight >= gateway.settings.max_inflight
        return gateway._slots.locked()

    async def push_table(self) -> None:
        """Behind the data plane, the routing table as the gateway's state is now (as its
        scrapes and discovery push it); without one, nothing to do."""
        if (front := self.gateway_server.data_plane) is not None:
            await front.push(self.gateway_server.upstream.session)

    async def fold_stats(self) -> None:
        """Behind the data plane, what it served and learned folded into the gateway's metrics,
        /status and Auto mode's model now (its poll does so each second), and the table that
        follows pushed; without one, nothing to do."""
        if (front := self.gateway_server.data_plane) is not None:
            await front.fold_stats(self.gateway_server.upstream.session)
            await front.push(self.gateway_server.upstream.session)


def routing(
    engine_api: str = "tokens",
    *,
    prefill: bool = True,
    render: bool = True,
    mode: str = "Disaggregated",
    slo: dict[str, int] | None = None,
    endpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    pool = {"service": "x", "port": 8000}
    return {
        "model": MODEL,
        "engineApi": engine_api,
        "parityHash": "p1",
        "routing": {"mode": mode, "slo": slo or {}},
        "pools": {
            "render": pool if render else None,
            "prefill": pool if prefill else None,
            "decode": pool,
        },
        "endpoints": endpoints or {},
    }


def ep(url: str, parity: str | None = "p1") -> dict[str, Any]:
    return {"url": url, "parityHash": parity}


async def pd_stack(
    stack: Stack,
    *,
    prefill_config: EngineConfig | None = None,
    decode_config: EngineConfig | None = None,
    mode: str = "Disaggregated",
    slo: dict[str, int] | None = None,
    policy: str = "fail",
    kv_transfer: dict[str, Any] | None = None,
    **gateway_settings: Any,
) -> httpx.AsyncClient:
    """A render server, a prefill and a decode engine, and a gateway over them."""
    render = await stack.render()
    prefill = await stack.engine("prefill", prefill_config or engine("prefill"))
    decode = await stack.engine("decode", decode_config or engine("decode", policy=policy))
    endpoints = {"render": [ep(render)], "prefill": [ep(prefill)], "decode": [ep(decode)]}
    config = routing(mode=mode, slo=slo, endpoints=endpoints)
    if kv_transfer is not None:
        config["kvTransfer"] = kv_transfer
    return await stack.gateway(config, **gateway_settings)


async def sse_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return [
        line.removeprefix("data: ")
        if line == "data: [DONE]"
        else json.loads(line.removeprefix("data: "))
        for line in lines
    ]


async def busy_decode(stack: Stack) -> None:
    """Streams of other clients on the decode replica, as its scraped metrics would say (and
    the routing table the data plane decides by)."""
    for endpoint in stack.gateway_server.endpoints.pools["decode"]:
        endpoint.running = 3
    await stack.push_table()


def finished(server: Any) -> float:
    """Requests an engine finished (its vllm:request_success counter)."""
    return sum(
        float(sample.value)
        for metric in server.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "vllm:request_success_total"
    )


async def until(condition: Callable[[], bool], deadline_seconds: float = 20) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - the gateways' tasks change the state
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), deadline_seconds)


@dataclass
class Replicas:
    gateways: list[Gateway]
    clients: list[httpx.AsyncClient]
    urls: list[str]
    prefill: EngineServer

    @property
    def leader(self) -> int:
        return self.urls.index(min(self.urls))

    @property
    def follower(self) -> int:
        return 1 - self.leader

    def reached_prefill(self, hung: int) -> int:
        """How many of the `hung` requests the prefill engine was told to hang it received."""
        return hung - self.prefill.faults.hang


def local_listener(above: str = "", below: str | None = None) -> tuple[socket.socket, str]:
    """A loopback socket already listening, and its URL, sorting after `above` and before
    `below` (the leader is the lowest URL). The sockets passed over stay open until one fits,
    so the kernel never hands the same port back."""
    passed: list[socket.socket] = []
    try:
        while True:
            sock = listening_socket()
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            if url > above and (below is None or url < below):
                return sock, url
            passed.append(sock)
    finally:
        for each in passed:
            each.close()


python_gateways_only = pytest.mark.parametrize("stack", ["python"], indirect=True)
"""For a test on `gateway_replicas`, which reads the Python gateways' own admission state: its
data-plane variant runs gateway processes behind their data planes, as pods run them
(test_dataplane.py)."""


async def gateway_replicas(
    stack: Stack,
    hang: int,
    extra_peers: tuple[str, ...] = (),
    max_wait: float = 30,
    **settings: Any,
) -> Replicas:
    """Two gateway replicas over one prefill replica with a long-prefill limit of 1, each
    knowing the other (and its own URL), the prefill engine hanging the next `hang` requests;
    `settings`: more GatewaySettings of both (keys; a peer key, PEER_KEY, unless they name
    one: a hold takes one)."""
    settings.setdefault("peer_keys", (PEER_KEY,))
    peer_auth = {} if settings.get("api_keys") else {"Authorization": f"Bearer {PEER_KEY}"}
    render = await stack.render()
    prefill = await stack.engine("prefill", engine("prefill"))
    decode = await stack.engine("decode", engine("decode"))
    endpoints: dict[str, Any] = {
        "render": [ep(render)],
        "prefill": [ep(prefill)],
        "decode": [ep(decode)],
    }
    listeners = [local_listener(min(extra_peers, default="")) for _ in range(2)]
    urls = [url for _, url in listeners]
    fair = FairQueueSettings(
        long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=max_wait
    )
    gateways, clients = [], []
    for (sock, mine), theirs in zip(listeners, urls[::-1], strict=True):
        config = routing(endpoints={**endpoints, "peers": [theirs, *extra_peers], "selfUrl": mine})
        gateway = Gateway(
            GatewayConfig.model_validate(config), GatewaySettings(fair_queue=fair, **settings)
        )
        await stack.start(gateway, sock=sock)
        gateways.append(gateway)
        clients.append(
            await stack.exits.enter_async_context(
                # Without API keys the peer key reads /status and /admission (and /v1 is open).
                httpx.AsyncClient(base_url=mine, timeout=60, headers=peer_auth)
            )
        )
    async with httpx.AsyncClient() as admin:
        await admin.post(f"{prefill}/sim/faults", json={"hang": hang})
    await until(lambda: all(len(g.peers.live) >= 1 for g in gateways))  # they see each other
    return Replicas(gateways, clients, urls, stack.engines["prefill"])
