"""Simulated `vllm serve [--tokens-only | --enable-scale-out]`: /inference/v1/generate and
/inference/v1/abort_requests (the scale-out API), the OpenAI routes, vLLM's metrics, and the
prefill -> decode KV handoff with kv_transfer_params.

The KV "transfer" is an HTTP pull from the producer (our stand-in for NIXL): the producer holds
a finished prefill's blocks for the lease, the consumer pulls them (unknown or expired blocks are
refused), waits bytes / bandwidth + overhead, and on failure applies kv_load_failure_policy
(fail -> error, recompute -> prefill locally). Faults can be injected through /sim/faults.

This module puts the engine together and serves it; the pieces: engine_config (configuration,
faults, clock), engine_metrics (the registry), kv_transfer (the handoff), engine_requests (a
request's way into the scheduler), engine_tokens and engine_openai (the two APIs)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import httpx
from aiohttp import web

from pdserve.sim.engine_config import EngineConfig, Faults, SimClock
from pdserve.sim.engine_core import EngineCore, Sequence
from pdserve.sim.engine_metrics import EngineMetrics
from pdserve.sim.engine_openai import OpenAIApi
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
        self.metrics = EngineMetrics(config.name, config.engine_id[:8])
        self.core = EngineCore(config.scheduler, on_token=self._on_token, on_finish=self._on_finish)
        self.faults = Faults()
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
        self._loop_task: asyncio.Task[None] | None = None
        self._emitted_total = 0
        self._shutting_down = asyncio.Event()
        self.kv = KvTransfer(config, self.core, self.metrics, self.faults, self._client)
        self.requests = EngineRequests(
            config, self.tokenizer, self.core, self.faults, self.kv, self._shutting_down
        )
        self.tokens_api = TokensApi(self.requests)
        self.openai_api = OpenAIApi(self.requests, self.render)

    @property
    def held(self) -> dict[str, HeldBlocks]:
        """KV blocks held for peers, by request id."""
        return self.kv.held

    # ---- time ----------------------------------------------------------------------------------
    def sim_seconds(self, real: float) -> float:
        """Real elapsed seconds -> simulated seconds (what a real engine would report)."""
        return self.clock.sim_seconds(real)

    async def sim_sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)

    # ---- metrics hooks ---------------------------------------------------------------------------
    def _on_token(self, seq: Sequence, now: float) -> None:
        self.metrics.on_token(seq, now, self.clock.sim_seconds)
        self._emitted_total += 1
        limit = self.faults.exit_after
        if limit is not None and self._emitted_total >= limit:
            os._exit(1)  # fault injection: the engine process dies mid-generation

    def _on_finish(self, seq: Sequence) -> None:
        self.metrics.on_finish(seq, self.clock.sim_seconds)

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
        app.router.add_post("/sim/kv/pull", self.kv.kv_pull)
        app.router.add_post("/sim/faults", self.set_faults)
        app.router.add_get("/health", health)
        app.router.add_get("/version", version)
        app.router.add_get("/v1/models", self.render.models)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    async def _start(self, _: web.Application) -> None:
        self._loop_task = asyncio.create_task(self.core.run(), name="engine-loop")

    async def _shutdown(self, _: web.Application) -> None:
        self._shutting_down.set()  # releases hung requests so shutdown does not wait on them

    async def _stop(self, _: web.Application) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self._client.aclose()

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        self.metrics.refresh(self.core)
        return metrics_response(self.metrics.registry)

    def set_faults_from(self, faults: Mapping[str, Any]) -> None:
        """Apply faults by name; ValueError names unknown ones."""
        self.faults.set(faults)

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            self.set_faults_from(await read_json(request))
        except (HttpError, ValueError) as error:
            return error_response(400, str(error))
        return web.json_response(self.faults.__dict__)
