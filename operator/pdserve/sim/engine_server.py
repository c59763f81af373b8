"""Simulated `vllm serve [--tokens-only]`: /inference/v1/generate, /abort_requests, the OpenAI
routes, vLLM's metrics, and the prefill -> decode KV handoff with kv_transfer_params.

The KV "transfer" is an HTTP pull from the producer (our stand-in for NIXL): the producer holds
a finished prefill's blocks for the lease, the consumer pulls them (unknown or expired blocks are
refused), waits bytes / bandwidth + overhead, and on failure applies kv_load_failure_policy
(fail -> error, recompute -> prefill locally). Faults can be injected through /sim/faults."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.sim.engine_core import EngineCore, SchedulerConfig, Sequence
from pdserve.sim.generation import ModelBehaviour, filler, model_output
from pdserve.sim.render_server import (
    HttpError,
    RenderConfig,
    RenderServer,
    error_response,
    read_json,
)
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm import metrics
from pdserve.vllm.protocol import usage

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


# vLLM's 1-2-5 buckets up to a long context.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


@dataclass
class TransferConfig:
    bytes_per_token: int = 56 * 1024  # Qwen2.5-7B bf16: 2 x 28 layers x 4 KV heads x 128 x 2 B
    bandwidth_gb_s: float = 0.4  # with the overhead: ~1.3 s for 8k tokens, as the article measured
    overhead_ms: float = 100.0
    poll_ms: float = 5.0  # the consumer notices finished transfers on its next poll
    lease_seconds: float = 30.0
    load_failure_policy: str = "fail"
    bidirectional: bool = False  # bidirectional_kv_xfer: decode's KV flows back for next turns
    decoder_kv_ttl_seconds: float = 480.0  # decoder_kv_blocks_ttl


@dataclass
class EngineConfig:
    model: str = "sim-model"
    served_model_name: str | None = None
    role: str = "both"  # prefill | decode | both
    api: str = "tokens"  # tokens (--tokens-only) | openai
    max_model_len: int = 32768
    advertise_host: str = "127.0.0.1"
    port: int = 8000
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    behaviour: ModelBehaviour = field(default_factory=ModelBehaviour)
    render: RenderConfig | None = None  # chat template/parsers for --api openai

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class Faults:
    fail_transfers: int = 0
    delay_transfers: int = 0
    delay_ms: float = 0.0
    expire_leases: bool = False
    http_5xx: int = 0
    hang: int = 0
    drop_stream_after: int | None = None
    exit_after: int | None = None


@dataclass
class HeldBlocks:
    num_tokens: int
    expires_at: float
    token_ids: list[int] | None = None  # decode-side (bidirectional) holds know their tokens


class EngineMetrics:
    def __init__(self, model: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model, "engine": engine}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge(metrics.NUM_REQUESTS_RUNNING, "Requests in the running batch")
        self.waiting = gauge(metrics.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled")
        self.kv_usage = gauge(metrics.KV_CACHE_USAGE, "KV cache usage, 0-1")
        self.prefix_queries = counter(metrics.PREFIX_CACHE_QUERIES, "Prompt tokens looked up")
        self.prefix_hits = counter(metrics.PREFIX_CACHE_HITS, "Prompt tokens found cached")
        self.preemptions = counter(metrics.NUM_PREEMPTIONS, "Preemptions")
        self.prompt_tokens = counter(metrics.PROMPT_TOKENS, "Prompt tokens processed")
        self.request_prompt_tokens = histogram(
            metrics.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed", TOKEN_BUCKETS
        )
        self.generation_tokens = counter(metrics.GENERATION_TOKENS, "Tokens generated")
        self.success = Counter(
            metrics.REQUEST_SUCCESS, "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.ttft = histogram(metrics.TIME_TO_FIRST_TOKEN, "Time to first token")
        self.itl = histogram(metrics.INTER_TOKEN_LATENCY, "Inter-token latency")
        self.tpot = histogram(metrics.TIME_PER_OUTPUT_TOKEN, "Time per output token")
        self.e2e = histogram(metrics.E2E_REQUEST_LATENCY, "End-to-end latency")
        self.queue = histogram(metrics.REQUEST_QUEUE_TIME, "Time waiting in queue")
        self.prefill = histogram(metrics.REQUEST_PREFILL_TIME, "Prefill time")
        self.decode = histogram(metrics.REQUEST_DECODE_TIME, "Decode time")
        self.xfer_time = histogram(metrics.NIXL_XFER_TIME, "KV transfer time")
        self.post_time = histogram(metrics.NIXL_POST_TIME, "KV transfer post time")
        self.xfer_bytes = histogram(
            metrics.NIXL_BYTES_TRANSFERRED,
            "KV bytes per transfer",
            tuple(float(2**i) for i in range(10, 36, 2)),
        )
        self.failed_transfers = counter(metrics.NIXL_FAILED_TRANSFERS, "Failed KV transfers")
        self.failed_notifications = counter(
            metrics.NIXL_FAILED_NOTIFICATIONS, "Failed transfer notifications"
        )
        self.expired = counter(metrics.NIXL_KV_EXPIRED_REQUESTS, "Requests whose KV lease expired")
        self.reused = counter(
            "pdserve_sim_bidirectional_reused_tokens",
            "Prompt tokens whose KV came back from decode (bidirectional)",
        )


class EngineServer:
    def __init__(self, config: EngineConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or SimTokenizer()
        self.metrics = EngineMetrics(config.name, config.engine_id[:8])
        self.core = EngineCore(config.scheduler, on_token=self._on_token, on_finish=self._on_finish)
        self.held: dict[str, HeldBlocks] = {}
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

    # ---- time ----------------------------------------------------------------------------------
    def sim_seconds(self, real: float) -> float:
        """Real elapsed seconds -> simulated seconds (what a real engine would report)."""
        return real / self.config.scheduler.time_scale

    async def sim_sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.config.scheduler.time_scale)

    # ---- metrics hooks ---------------------------------------------------------------------------
    def _on_token(self, seq: Sequence, now: float) -> None:
        m, labels = self.metrics, self.metrics.labels
        if seq.first_token_at == now and seq.emitted == 1:
            m.ttft.labels(**labels).observe(self.sim_seconds(now - seq.arrival))
            if seq.admitted_at is not None:
                m.prefill.labels(**labels).observe(self.sim_seconds(now - seq.admitted_at))
        elif seq.last_token_at is not None:
            m.itl.labels(**labels).observe(self.sim_seconds(now - seq.last_token_at))
        m.generation_tokens.labels(**labels).inc()
        self._emitted_total += 1
        limit = self.faults.exit_after
        if limit is not None and self._emitted_total >= limit:
            os._exit(1)  # fault injection: the engine process dies mid-generation

    def _on_finish(self, seq: Sequence) -> None:
        m, labels = self.metrics, self.metrics.labels
        now = seq.last_token_at or time.monotonic()
        m.e2e.labels(**labels).observe(self.sim_seconds(now - seq.arrival))
        if seq.admitted_at is not None:
            m.queue.labels(**labels).observe(self.sim_seconds(seq.admitted_at - seq.arrival))
        if seq.first_token_at is not None:
            m.decode.labels(**labels).observe(self.sim_seconds(now - seq.first_token_at))
            if seq.emitted > 1:
                m.tpot.labels(**labels).observe(
                    self.sim_seconds(now - seq.first_token_at) / (seq.emitted - 1)
                )
        m.prompt_tokens.labels(**labels).inc(len(seq.prompt_ids) - seq.cached_tokens)
        m.request_prompt_tokens.labels(**labels).observe(len(seq.prompt_ids))
        m.success.labels(**labels, finished_reason=seq.finish_reason).inc()

    def _refresh_gauges(self) -> None:
        m, labels = self.metrics, self.metrics.labels
        m.running.labels(**labels).set(len(self.core.running))
        m.waiting.labels(**labels).set(len(self.core.waiting))
        m.kv_usage.labels(**labels).set(self.core.kv_usage())
        query = m.prefix_queries.labels(**labels)
        query.inc(self.core.prefix_queries - query._value.get())
        hits = m.prefix_hits.labels(**labels)
        hits.inc(self.core.prefix_hits - hits._value.get())

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024**2)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/abort_requests", self.abort_requests)
        app.router.add_post("/sim/kv/pull", self.kv_pull)
        app.router.add_post("/sim/faults", self.set_faults)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.render.models)
        app.router.add_get("/metrics", self.metrics_endpoint)
        if self.config.api == "openai":
            app.router.add_post("/v1/chat/completions", self.openai_chat)
            app.router.add_post("/v1/completions", self.openai_completions)
        return app

    async def _start(self, _: web.Application) -> None:
        self._loop_task = asyncio.create_task(self.core.run(), name="engine-loop")

    async def _shutdown(self, _: web.Application) -> None:
        self._shutting_down.set()  # releases hung requests so shutdown does not wait on them

    async def _stop(self, _: web.Application) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self._client.aclose()

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        self._refresh_gauges()
        return web.Response(
            body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    def set_faults_from(self, faults: Mapping[str, Any]) -> None:
        """Apply faults by name; ValueError names unknown ones."""
        known = set(Faults.__dataclass_fields__)
        unknown = set(faults) - known
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in faults.items():
            setattr(self.faults, key, value)

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            self.set_faults_from(await read_json(request))
        except (HttpError, ValueError) as error:
            return error_response(400, str(error))
        return web.json_response(self.faults.__dict__)

    # ---- KV handoff ------------------------------------------------------------------------------
    def _expire_leases(self) -> None:
        now = time.monotonic()
        for request_id, held in list(self.held.items()):
            if held.expires_at <= now:
                self._release(request_id)
                self.metrics.expired.labels(**self.metrics.labels).inc()

    def _release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.core.held_blocks -= -(-held.num_tokens // self.config.scheduler.block_size)

    def _hold(
        self, request_id: str, num_tokens: int, *, token_ids: list[int] | None = None,
        lease: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Keep KV blocks for a peer to pull; returns the kv_transfer_params that point at them."""
        lease = self.config.transfer.lease_seconds if lease is None else lease
        self._release(request_id)
        self.held[request_id] = HeldBlocks(
            num_tokens, time.monotonic() + lease * self.config.scheduler.time_scale, token_ids
        )
        blocks = -(-num_tokens // self.config.scheduler.block_size)
        self.core.held_blocks += blocks
        return {
            "do_remote_prefill": token_ids is None,
            "do_remote_decode": False,
            "remote_block_ids": list(range(blocks)),
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.config.advertise_host,
            "remote_port": self.config.port,
            "tp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": time.time() + lease,
            "transfer_mode": "pull",
        }

    async def kv_pull(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self._expire_leases()
        request_id = str(body.get("remote_request_id"))
        if self.faults.expire_leases and request_id in self.held:
            self._release(request_id)
            self.metrics.expired.labels(**self.metrics.labels).inc()
            return error_response(410, f"KV blocks of {request_id} expired")
        held = self.held.get(request_id)
        if held is None:
            return error_response(404, f"no KV blocks held for request {request_id}")
        self._release(request_id)
        return web.json_response(
            {
                "num_tokens": held.num_tokens,
                "bytes": held.num_tokens * self.config.transfer.bytes_per_token,
                "token_ids": held.token_ids,
            }
        )

    async def pull_kv(
        self, params: Mapping[str, Any], prompt_ids: list[int], *, whole_prompt: bool
    ) -> tuple[int, str | None]:
        """Pull KV from a peer: (prompt tokens whose KV arrived, why it failed or None).
        whole_prompt: decode pulling prefill's KV (it must cover the prompt); otherwise prefill
        reusing decode's KV of an earlier turn (bidirectional), which only helps as far as the
        token ids agree: a template that strips <think> from history breaks the match early."""
        transfer = self.config.transfer
        labels = self.metrics.labels
        started = time.monotonic()
        try:
            if self.faults.fail_transfers > 0:
                self.faults.fail_transfers -= 1
                raise RuntimeError("injected transfer failure")
            url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/sim/kv/pull"
            response = await self._client.post(url, json={
                "remote_request_id": params.get("remote_request_id"),
                "remote_block_ids": params.get("remote_block_ids"),
            })  # fmt: skip
            if response.status_code != 200:
                message = response.json().get("error", {}).get("message", response.text)
                raise RuntimeError(f"peer refused: {message}")
            pulled = response.json()
            if whole_prompt:
                if pulled["num_tokens"] < len(prompt_ids) - 1:
                    raise RuntimeError("producer holds fewer tokens than the prompt")
                usable = len(prompt_ids)
            else:
                held = list(pulled.get("token_ids") or [])
                common = 0
                for mine, theirs in zip(prompt_ids, held, strict=False):
                    if mine != theirs:
                        break
                    common += 1
                block = self.config.scheduler.block_size
                usable = min(common - common % block, len(prompt_ids) - 1)
                self.metrics.reused.labels(**labels).inc(usable)
            seconds = usable * transfer.bytes_per_token / (transfer.bandwidth_gb_s * 1e9)
            seconds += transfer.overhead_ms / 1000 + transfer.poll_ms / 1000
            if self.faults.delay_transfers > 0:
                self.faults.delay_transfers -= 1
                seconds += self.faults.delay_ms / 1000
            await self.sim_sleep(seconds)
            self.metrics.xfer_time.labels(**labels).observe(
                self.sim_seconds(time.monotonic() - started)
            )
            self.metrics.xfer_bytes.labels(**labels).observe(usable * transfer.bytes_per_token)
            return usable, None
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as error:
            self.metrics.failed_transfers.labels(**labels).inc()
            peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
            return 0, f"KV transfer from {peer} failed: {error}"

    # ---- generate ------------------------------------------------------------------------------
    def _plan(
        self, prompt_ids: list[int], params: Mapping[str, Any], index: int
    ) -> tuple[list[int], str]:
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_ids)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HttpError(
                400, "sampling_params.max_tokens must be a positive integer", "max_tokens"
            )
        seed = params.get("seed")
        if index:
            seed = (seed or 0) + index
        natural = model_output(
            self.tokenizer, prompt_ids, seed=seed, behaviour=self.config.behaviour
        )
        if params.get("ignore_eos"):
            body = natural[:-1]
            if len(body) < max_tokens:
                body += filler(self.tokenizer, prompt_ids, seed, max_tokens - len(body))
            return body[:max_tokens], "length"
        minimum = int(params.get("min_tokens") or 0)
        if len(natural) < minimum:
            natural = (
                natural[:-1]
                + filler(self.tokenizer, prompt_ids, seed, minimum - len(natural) + 1)
                + natural[-1:]
            )
        if len(natural) > max_tokens:
            return natural[:max_tokens], "length"
        return natural, "stop"

    def _validate_prompt(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list) or not token_ids:
            raise HttpError(400, "token_ids must be a non-empty list of token ids", "token_ids")
        vocab = self.tokenizer.vocab_size
        for position, token in enumerate(token_ids):
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise HttpError(
                    400,
                    f"token_ids[{position}] = {token!r} is not in the vocabulary (0..{vocab - 1})",
                    "token_ids",
                )
        if len(token_ids) >= self.config.max_model_len:
            raise HttpError(
                400,
                f"This model's maximum context length is "
                f"{self.config.max_model_len} tokens. However, your request has "
                f"{len(token_ids)} input tokens.",
                "token_ids",
            )
        return token_ids

    async def _start_sequences(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Mapping[str, Any],
        kv_params: Mapping[str, Any] | None,
    ) -> tuple[list[Sequence], bool]:
        """Create and schedule the request's sequences; returns (sequences, remote_decode)."""
        if self.faults.http_5xx > 0:
            self.faults.http_5xx -= 1
            raise HttpError(500, "injected engine failure")
        if self.faults.hang > 0:
            self.faults.hang -= 1
            await self._shutting_down.wait()  # fault injection: no answer until shutdown
            raise HttpError(503, "engine shutting down")
        n = int(params.get("n") or 1)
        if n < 1 or n > self.config.scheduler.max_num_seqs:
            raise HttpError(
                400,
                f"n must be between 1 and max_num_seqs ({self.config.scheduler.max_num_seqs})",
                "n",
            )
        remote_decode = bool(kv_params and kv_params.get("do_remote_decode"))
        remote_prefill = bool(kv_params and kv_params.get("do_remote_prefill"))
        if remote_decode and self.config.role == "decode":
            raise HttpError(
                400,
                "this engine is a KV consumer (role decode); do_remote_decode needs a producer",
                "kv_transfer_params",
            )
        if remote_prefill and self.config.role == "prefill":
            raise HttpError(
                400,
                "this engine is a KV producer (role prefill); do_remote_prefill needs a consumer",
                "kv_transfer_params",
            )
        computed = 0
        if remote_prefill:
            assert kv_params is not None
            computed, failure = await self.pull_kv(kv_params, prompt_ids, whole_prompt=True)
            if failure is not None and self.config.transfer.load_failure_policy == "fail":
                raise HttpError(500, failure + " (kv_load_failure_policy=fail)")
            # recompute: prefill locally, slower but it answers
        elif (
            remote_decode
            and self.config.transfer.bidirectional
            and kv_params is not None
            and kv_params.get("remote_request_id")
        ):
            # An earlier turn's KV held by decode: reuse what still matches, compute the rest.
            computed, _ = await self.pull_kv(kv_params, prompt_ids, whole_prompt=False)
        sequences = []
        for index in range(n):
            output, finish = self._plan(prompt_ids, params, index)
            if remote_decode:
                output, finish = output[:1], "length"
            seq = Sequence(
                request_id=request_id if n == 1 else f"{request_id}-{index}",
                prompt_ids=prompt_ids,
                output_ids=output,
                finish_reason=finish,
                arrival=time.monotonic(),
                computed=computed,
            )
            sequences.append(seq)
            self.core.add(seq)
        return sequences, remote_decode

    def _abort(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            self.core.abort(seq.request_id)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prompt_ids = self._validate_prompt(body.get("token_ids"))
            params = dict(body.get("sampling_params") or {})
            extra = params.get("extra_args") or {}
            kv_params = body.get("kv_transfer_params") or extra.get("kv_transfer_params")
            request_id = (
                request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
            )
            sequences, remote_decode = await self._start_sequences(
                request_id, prompt_ids, params, kv_params
            )
        except HttpError as error:
            return error_response(error.status, error.message, error.param)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await self._stream(
                request,
                request_id,
                sequences,
                prompt_ids,
                include_usage=bool(options.get("include_usage")),
            )
        try:
            choices, completion_tokens = [], 0
            for index, seq in enumerate(sequences):
                ids, finish = await self._collect(seq)
                completion_tokens += len(ids)
                choices.append(
                    {"index": index, "token_ids": ids, "finish_reason": finish, "logprobs": None}
                )
        except asyncio.CancelledError:
            self._abort(sequences)  # the client went away
            raise
        kv_out = None
        if remote_decode:
            kv_out = self._hold(request_id, len(prompt_ids))
        elif (
            self.config.transfer.bidirectional
            and self.config.role == "decode"
            and len(sequences) == 1
        ):
            # Keep this turn's KV (prompt + answer) for the next turn's prefill to pull back.
            tokens = [*prompt_ids, *sequences[0].output_ids[: sequences[0].emitted]]
            kv_out = self._hold(
                request_id,
                len(tokens),
                token_ids=tokens,
                lease=self.config.transfer.decoder_kv_ttl_seconds,
            )
        return web.json_response(
            {
                "request_id": request_id,
                "model": self.config.name,
                "created": int(time.time()),
                "choices": choices,
                "usage": usage(len(prompt_ids), completion_tokens),
                "kv_transfer_params": kv_out,
                "prompt_logprobs": None,
            }
        )

    @staticmethod
    async def _collect(seq: Sequence) -> tuple[list[int], str | None]:
        ids: list[int] = []
        while True:
            token, finish = await seq.queue.get()
            if token is not None:
                ids.append(token)
            if finish is not None:
                return ids, finish

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        sequences: list[Sequence],
        prompt_ids: list[int],
        *,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # Opt-in extension for benchmarks: each event carries the token's simulated time.
        timing = request.headers.get("X-PDServe-Sim-Timing") == "1"
        counts = [0] * len(sequences)
        drop_after = self.faults.drop_stream_after
        self.faults.drop_stream_after = None
        sent = 0
        pending = {
            asyncio.ensure_future(seq.queue.get()): index for index, seq in enumerate(sequences)
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    token, finish = future.result()
                    if token is not None or finish is not None:
                        event: dict[str, Any] = {
                            "request_id": request_id,
                            "choices": [
                                {
                                    "index": index,
                                    "token_ids": [] if token is None else [token],
                                    "finish_reason": None if finish == "abort" else finish,
                                    "logprobs": None,
                                }
                            ],
                        }
                        if token is not None and timing:
                            seq_times = sequences[index].sim_times
                            event["sim_time"] = seq_times[min(counts[index], len(seq_times) - 1)]
                            counts[index] += 1
                        if token is not None or finish not in (None, "abort"):
                            await response.write(f"data: {json.dumps(event)}\n\n".encode())
                            sent += 1
                    if drop_after is not None and sent >= drop_after:
                        self._abort(sequences)
                        request.transport and request.transport.close()  # type: ignore[func-returns-value]
                        return response
                    if finish is None:
                        pending[asyncio.ensure_future(sequences[index].queue.get())] = index
            if include_usage:
                completion = sum(s.emitted for s in sequences)
                final = {
                    "request_id": request_id,
                    "choices": [],
                    "usage": usage(len(prompt_ids), completion),
                }
                await response.write(f"data: {json.dumps(final)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self._abort(sequences)  # the client went away: stop generating for it
            for future in pending:
                future.cancel()
            raise
        return response

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        ids = body.get("request_ids")
        if not isinstance(ids, list):
            return error_response(400, "request_ids must be a list", "request_ids")
        for request_id in ids:
            request_id = str(request_id)
            self.core.abort(request_id)
            self._release(request_id)  # a producer's lease ends with the request
        return web.json_response({})

    # ---- OpenAI API (engines without a render pool) ----------------------------------------------
    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def openai_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await read_json(request)
            if chat:
                rendered = json.loads((await self.render.chat_render(body)).text or "{}")
            else:
                rendered = json.loads((await self.render.completion_render(body)).text or "[]")[0]
            prompt_ids = rendered["token_ids"]
            params = rendered["sampling_params"]
            kv_params = body.get("kv_transfer_params")
            request_id = request.headers.get("X-Request-Id") or rendered["request_id"]
            sequences, remote_decode = await self._start_sequences(
                request_id, prompt_ids, params, kv_params
            )
        except HttpError as error:
            return error_response(error.status, error.message, error.param)
        except Exception as error:  # ChatError and friends: the caller's input
            return error_response(400, str(error))
        derender_path = self.render.chat_derender if chat else self.render.completion_derender
        if body.get("stream"):
            return await self._openai_stream(request, body, sequences, prompt_ids, derender_path)
        choices = []
        for index, seq in enumerate(sequences):
            ids, finish = await self._collect(seq)
            choices.append({"index": index, "token_ids": ids, "finish_reason": finish})
        derendered = await derender_path(
            {
                "stream": False,
                "model": self.config.name,
                "prompt_tokens": len(prompt_ids),
                "prompt_token_ids": prompt_ids,
                "chat_request": body if chat else None,
                "generate_response": {"request_id": request_id, "choices": choices},
            }
        )
        answer = json.loads(derendered.text or "{}")
        if remote_decode:
            answer["kv_transfer_params"] = self._hold(request_id, len(prompt_ids))
        return web.json_response(answer)

    async def _openai_stream(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        sequences: list[Sequence],
        prompt_ids: list[int],
        derender: Any,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        try:
            for index, seq in enumerate(sequences):
                state = None
                while True:
                    token, finish = await seq.queue.get()
                    chunk = {
                        "request_id": seq.request_id,
                        "choices": [
                            {
                                "index": index,
                                "token_ids": [] if token is None else [token],
                                "finish_reason": finish,
                            }
                        ],
                    }
                    out = await derender(
                        {
                            "stream": True,
                            "model": self.config.name,
                            "generate_chunk": chunk,
                            "stream_state": state,
                            "prompt_tokens": len(prompt_ids),
                            "prompt_token_ids": prompt_ids,
                            "chat_request": body if chat else None,
                        }
                    )
                    result = json.loads(out.text or "{}")
                    state = result.get("stream_state")
                    await response.write(f"data: {json.dumps(result.get('chunk'))}\n\n".encode())
                    if finish is not None:
                        break
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self._abort(sequences)
            raise
        return response
