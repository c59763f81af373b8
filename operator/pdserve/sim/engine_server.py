"""Simulated `vllm serve [--tokens-only | --enable-scale-out]`: /inference/v1/generate and
/inference/v1/abort_requests (the scale-out API), the OpenAI routes, vLLM's metrics, and the
prefill -> decode KV handoff with kv_transfer_params.

The KV "transfer" is an HTTP pull from the producer (our stand-in for NIXL): the producer holds
a finished prefill's blocks for the lease, the consumer pulls them (unknown or expired blocks are
refused), waits bytes / bandwidth + overhead, and on failure applies kv_load_failure_policy
(fail -> error, recompute -> prefill locally). Faults can be injected through /sim/faults.

One server runs the data-parallel ranks vLLM would run on its node (EngineConfig's
data_parallel_size_local, from global rank data_parallel_start_rank), each an EngineRank with
its own scheduler, prefix cache, KV blocks and metric labels, behind this one HTTP server (as
vLLM's API server in front of its local engine cores in hybrid or single-node DP).

This module puts the engine together and serves it; the pieces: engine_config (configuration,
faults, clock), engine_metrics (the registry), engine_rank and engine_ranks (the DP ranks and
which one serves a request), kv_transfer (the handoff), engine_requests (a request's way into
a rank's scheduler), engine_tokens and engine_openai (the two APIs)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import httpx
from aiohttp import web

from pdserve.sim.engine_config import EngineConfig, Faults, SimClock
from pdserve.sim.engine_core import EngineCore
from pdserve.sim.engine_metrics import EngineMetrics
from pdserve.sim.engine_openai import OpenAIApi
from pdserve.sim.engine_rank import EngineRank
from pdserve.sim.engine_ranks import EngineRanks
from pdserve.sim.engine_requests import EngineRequests
from pdserve.sim.engine_tokens import TokensApi
from pdserve.sim.http import (
    HttpError,
    error_response,
    health,
    metrics_response,
    read_json,
    version,
)
from pdserve.sim.kv_transfer import HeldBlocks, KvTransfer
from pdserve.sim.render_server import RenderConfig, RenderServer
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import ABORT_PATH, GENERATE_PATH


class EngineServer:
    def __init__(self, config: EngineConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or SimTokenizer()
        self.clock = SimClock(config.scheduler)
        self.metrics = EngineMetrics(config.name)
        """The one registry: every rank's series, labelled engine="<global rank>"."""
        self.faults = Faults()  # shared: a fault is the server's, whichever rank it hits
        self.render = RenderServer(
            config.render
            or RenderConfig(
                model=config.model,
                served_model_name=config.served_model_name,
                max_model_len=config.max_model_len,
            ),
            self.tokenizer,
        )
        self._client = httpx.AsyncClient(timeout=30.0)
        self._emitted_total = 0
        self._shutting_down = asyncio.Event()
        self.ranks = EngineRanks(
            [
                EngineRank(
                    index,
                    config,
                    tokenizer=self.tokenizer,
                    metrics=self.metrics,
                    faults=self.faults,
                    client=self._client,
                    shutting_down=self._shutting_down,
                    on_token=self._on_token,
                )
                for index in range(config.data_parallel_size_local)
            ]
        )
        self.tokens_api = TokensApi(config, self.ranks, self.faults)
        self.openai_api = OpenAIApi(config, self.ranks, self.render)

    # ---- local index 0's pieces (what a single-rank engine's tests read) -----------------------
    @property
    def core(self) -> EngineCore:
        """Local rank 0's scheduler (the only one without data parallelism)."""
        return self.ranks[0].core

    @property
    def kv(self) -> KvTransfer:
        """Local rank 0's KV handoff."""
        return self.ranks[0].kv

    @property
    def requests(self) -> EngineRequests:
        """Local rank 0's request intake."""
        return self.ranks[0].requests

    @property
    def held(self) -> dict[str, HeldBlocks]:
        """KV blocks local rank 0 holds for peers, by request id."""
        return self.ranks[0].kv.held

    # ---- time ----------------------------------------------------------------------------------
    def sim_seconds(self, real: float) -> float:
        """Real elapsed seconds -> simulated seconds (what a real engine would report)."""
        return self.clock.sim_seconds(real)

    async def sim_sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)

    # ---- fault hook ----------------------------------------------------------------------------
    def _on_token(self) -> None:
        """Any rank emitted a token: exit_after counts the server's tokens."""
        self._emitted_total += 1
        limit = self.faults.exit_after
        if limit is not None and self._emitted_total >= limit:
            os._exit(1)  # fault injection: the engine process dies mid-generation

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024**2)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        # As vLLM registers them: the scale-out API with --tokens-only or --enable-scale-out
        # (the legacy unauthenticated /abort_requests only with --tokens-only), the OpenAI
        # routes wherever a tokenizer is loaded; plain `vllm serve` has no abort endpoint.
        if self.config.generate_api:
            app.router.add_post(GENERATE_PATH, self.tokens_api.generate)
            app.router.add_post(ABORT_PATH, self.tokens_api.abort_requests)
        if self.config.api == "tokens":
            app.router.add_post("/abort_requests", self.tokens_api.abort_requests)
        if self.config.detokenizes:
            app.router.add_post("/v1/chat/completions", self.openai_api.openai_chat)
            app.router.add_post("/v1/completions", self.openai_api.openai_completions)
        app.router.add_post("/sim/kv/pull", self.kv_pull)
        app.router.add_post("/sim/faults", self.set_faults)
        app.router.add_get("/health", health)
        app.router.add_get("/version", version)
        app.router.add_get("/v1/models", self.render.models)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    async def _start(self, _: web.Application) -> None:
        for rank in self.ranks:
            rank.start()

    async def _shutdown(self, _: web.Application) -> None:
        self._shutting_down.set()  # releases hung requests so shutdown does not wait on them

    async def _stop(self, _: web.Application) -> None:
        for rank in self.ranks:
            rank.stop()
        await self._client.aclose()

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        for rank in self.ranks:
            rank.metrics.refresh(rank.core)
        return metrics_response(self.metrics.registry)

    async def kv_pull(self, request: web.Request) -> web.Response:
        """POST /sim/kv/pull: a peer takes the blocks a rank holds for a request. The body's
        remote_engine_id (from the kv_transfer_params that rank returned) names the rank, as a
        NIXL peer reaches one rank's agent; this server has none of another's."""
        try:
            body = await read_json(request)
        except HttpError as error:
            return error_response(error.status, error.message)
        engine_id = body.get("remote_engine_id")
        rank = self.ranks.by_engine_id(engine_id)
        if rank is None:
            return error_response(404, f"no engine {engine_id!r} on this server")
        return rank.kv.give(body)

    def set_faults_from(self, faults: Mapping[str, Any]) -> None:
        """Apply faults by name; ValueError names unknown ones."""
        self.faults.set(faults)

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            self.set_faults_from(await read_json(request))
        except (HttpError, ValueError) as error:
            return error_response(400, str(error))
        return web.json_response(self.faults.__dict__)
