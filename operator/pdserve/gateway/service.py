"""The OpenAI-compatible gateway: render -> prefill -> decode -> derender, streaming, failures.

Routes (chosen by the model's config):
1. render + P/D: render, prefill (max_tokens=1, do_remote_decode), decode with prefill's
   kv_transfer_params, derender.
2. P/D without render: the OpenAI-level handoff against engines that speak OpenAI.
3. render + one engine pool: render, generate, derender.
4. aggregated: straight to the decode pool; also the fallback when P/D cannot serve a request.
Every request ends in a correct answer or a clear OpenAI-style error, never a hang."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.affinity import Conversations, DecodeKv, PrefixIndex, block_hashes
from pdserve.gateway.discovery import PodDiscovery
from pdserve.gateway.endpoints import Endpoint, Endpoints, NoEndpoints, Selection
from pdserve.gateway.fairqueue import LONG, FairQueueSettings, PrefillAdmission
from pdserve.gateway.load import LoadScraper
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.peers import GRANTED, PeerAdmission
from pdserve.gateway.policy import AutoPolicy, Decision, PolicySettings, QueueState
from pdserve.gateway.request_log import RequestLog, p95
from pdserve.kube.client import Kube
from pdserve.vllm.protocol import prefill_handoff_params

log = logging.getLogger("pdserve.gateway")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class GatewaySettings:
    max_inflight: int = 256
    max_body_bytes: int = 16 * 1024**2
    max_tokens_cap: int | None = None
    api_keys: tuple[str, ...] = ()
    connect_timeout: float = 2.0
    # How long a request waits for a complete, parity-consistent set of endpoints (a pool's
    # only replica being replaced) before 503; 0: fail at once.
    endpoint_wait_seconds: float = 30.0
    render_timeout: float = 30.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    # vLLM closes idle connections after ~5 s: reuse only younger ones, or requests reset.
    keepalive_expiry: float = 4.0
    lease_margin_seconds: float = 1.0
    # Merge tokens that arrive during a derender call into the next one. False: one derender
    # call per engine event (what a naive proxy does; kept for the benchmark's comparison).
    derender_pipelining: bool = True
    policy: PolicySettings = dataclasses.field(default_factory=PolicySettings)
    fair_queue: FairQueueSettings = dataclasses.field(default_factory=FairQueueSettings)
    # Engines' own queue and KV metrics feed endpoint picking; None: in-flight counts only.
    load_scrape_seconds: float | None = 0.5
    # Engines' recent time between tokens is averaged over windows this long (Auto's ITL rule).
    step_window_seconds: float = 2.0
    # Engine-reported durations (KV transfer times) x this = seconds on the gateway's clock:
    # 1 for real engines; the benchmark's time-scaled simulators report simulated seconds.
    engine_seconds_scale: float = 1.0
    request_log: Path | None = None  # JSON Lines, one entry per finished request


class GatewayError(Exception):
    """Ends the request with an OpenAI-style error."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(status, "APIError")


class UpstreamFailed(Exception):
    """A hop failed in a way another replica (or local prefill) may fix."""

    def __init__(self, stage: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.stage, self.status = stage, status


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: GatewayError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    body = error_body(error.status, error.message, error.kind, error.param)
    return web.json_response(body, status=error.status, headers=headers)


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


class Gateway:
    def __init__(self, config: GatewayConfig, settings: GatewaySettings | None = None) -> None:
        self.config = config
        self.settings = settings or GatewaySettings()
        self.endpoints = Endpoints(config)
        self.metrics = GatewayMetrics()
        self._slots = asyncio.Semaphore(self.settings.max_inflight)
        self._discovery: PodDiscovery | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.policy = AutoPolicy(settings.policy if settings else None)
        self.prefixes = PrefixIndex()
        self.admission = PrefillAdmission(self.settings.fair_queue)
        keys = self.settings.api_keys
        self.peers = PeerAdmission(
            self.admission, lambda: self.client, api_key=keys[0] if keys else None
        )
        if config.endpoints is not None:
            own = config.endpoints.self_url
            self.peers.set_peers(
                [u.rstrip("/") for u in config.endpoints.peers],
                self_url=None if own is None else own.rstrip("/"),
            )
        self._peers_task: asyncio.Task[None] | None = None
        self.conversations = Conversations()
        self.decode_kv = DecodeKv()
        self.request_log = (
            RequestLog(self.settings.request_log) if self.settings.request_log else None
        )

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/status", self.status)
        app.router.add_get("/admission", self.admission_state)
        app.router.add_post("/admission/hold", self.admission_hold)
        app.on_startup.append(self._start_discovery)
        app.on_cleanup.append(self._close)
        return app

    def discover_pods(self, kube: Kube, own_pod: str | None = None) -> None:
        """Find endpoints (and peer gateways) by watching the model's pods (in a cluster)
        instead of a static list."""
        self._discovery = PodDiscovery(kube, self.config, self.endpoints, self.peers, own_pod)

    @property
    def client(self) -> aiohttp.ClientSession:
        """aiohttp, not httpx, upstream: per request it costs a fraction of the CPU."""
        if self._session is None:
            s = self.settings
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=s.keepalive_expiry),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout),
                json_serialize=json.dumps,
            )
        return self._session

    async def _start_discovery(self, _: web.Application) -> None:
        if self.request_log is not None:
            self.request_log.start()
        if self.settings.load_scrape_seconds is not None:
            scraper = LoadScraper(
                self.endpoints,
                self.client,
                self.settings.load_scrape_seconds,
                on_transfers=self.note_transfers,
            )
            self._scrape_task = asyncio.create_task(scraper.run(), name="load-scraper")
        if self._discovery is not None:
            self._discovery_task = asyncio.create_task(self._discovery.run(), name="discovery")
        if self._discovery is not None or self.peers.urls:
            self._peers_task = asyncio.create_task(self.peers.run(), name="peer-admission")

    async def _close(self, _: web.Application) -> None:
        for task in (self._scrape_task, self._peers_task):
            if task is not None:
                task.cancel()
        if self.request_log is not None:
            await self.request_log.stop()
        if self._discovery_task is not None:
            self._discovery_task.cancel()
        if self._discovery is not None:
            await self._discovery.kube.close()
        if self._session is not None:
            await self._session.close()

    @staticmethod
    @asynccontextmanager
    async def counted(
        endpoint: Endpoint, prefill_tokens: int = 0
    ) -> AsyncIterator[Callable[[], None]]:
        """Count a request on its engine from the moment it is sent (so the next pick sees it,
        without waiting for a scrape), with the prompt it still has to prefill until the
        yielded `prefilled()` is called."""
        endpoint.inflight += 1
        endpoint.prefill_backlog += prefill_tokens
        remaining = prefill_tokens

        def prefilled() -> None:
            nonlocal remaining
            endpoint.prefill_backlog -= remaining
            remaining = 0

        try:
            yield prefilled
        finally:
            endpoint.inflight -= 1
            prefilled()

    def stream_timeout(self) -> aiohttp.ClientTimeout:
        """No total limit for a stream; a read that stalls this long fails it."""
        s = self.settings
        return aiohttp.ClientTimeout(
            total=None, sock_connect=s.connect_timeout, sock_read=s.decode_timeout
        )

    async def post_stream(
        self, endpoint: Endpoint, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """Open a streamed POST; an engine that cannot be reached is marked down (the error
        propagates for the caller to retry or report)."""
        try:
            return await self.client.post(
                f"{endpoint.url}{path}", json=body, headers=dict(headers),
                timeout=self.stream_timeout(),
            )  # fmt: skip
        except (TimeoutError, aiohttp.ClientError):
            self.endpoints.mark_down(endpoint)
            raise

    async def admission_state(self, _: web.Request) -> web.Response:
        """What peers count against the shared long-prefill limit."""
        admission = self.admission
        return web.json_response(
            {
                "longInFlight": admission.long_in_flight,
                "queued": len(admission.queue),
                "replicas": dict(admission.in_flight),
                "heldAt": self.peers.holdings(),
            }
        )

    async def admission_hold(self, request: web.Request) -> web.StreamResponse:
        """A peer replica's long prefill waits in this replica's queue (it is the leader, see
        peers.py); `granted <replica>` answers when one of the prefill replicas it named has
        room, and the slot is held until the peer closes the connection (aiohttp then cancels
        this handler, which releases it)."""
        try:
            self.authorize(request)  # a slot held here blocks every replica's documents
        except GatewayError as error:
            return error_response(error)
        if (leader := self.peers.leader()) is not None:
            # Two replicas running queues at once would break the limit: the asking replica
            # admits on its own (counting this one's holdings) until their views agree.
            message = f"this replica is not the admission leader: {leader} is"
            return error_response(GatewayError(409, message, kind="ConflictError"))
        try:
            body = await request.json()
            replicas = body.get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, list) or not replicas:
                raise ValueError
            if not all(isinstance(r, str) and r for r in replicas):
                raise ValueError
        except (ValueError, TypeError):
            message = "replicas: expected the prefill replica URLs the request may use, best first"
            return error_response(GatewayError(400, message, param="replicas"))
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        async with self.admission.admit(LONG, replicas) as replica:
            try:
                await response.prepare(request)
                await response.write(f"{GRANTED} {replica}\n".encode())
            except ConnectionResetError:
                return response  # the peer left as it was granted: the slot goes back
            # Bounded like the peer's prefill call: a holder that vanished without closing its
            # connection cannot keep the slot for longer.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.settings.prefill_timeout):
                    await asyncio.Event().wait()
        return response

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(self, _: web.Request) -> web.Response:
        try:
            self.endpoints.select(self.needed_pools())
        except NoEndpoints as error:
            return web.json_response({"ready": False, "reason": str(error)}, status=503)
        return web.json_response({"ready": True})

    async def models(self, request: web.Request) -> web.Response:
        self.authorize(request)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve",
                    }
                ],
            }
        )

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        self.metrics.prefill_queue.set(len(self.admission.queue))
        self.metrics.prefill_oldest_wait.set(self.admission.oldest_wait())
        self.metrics.prefill_aged.set(self.admission.aged)
        self.metrics.admission_leader_errors.set(self.peers.leader_errors)
        return web.Response(
            body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    # ---- request intake --------------------------------------------------------------------------
    def authorize(self, request: web.Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        # Compare against every key so the time taken says nothing about which one is close.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(token.encode(), key.encode())
        if not matched:
            raise GatewayError(401, "missing or invalid API key: send Authorization: Bearer <key>")

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            raise GatewayError(400, f"request body is not valid JSON: {error}") from None
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413,
                f"request body exceeds {self.settings.max_body_bytes} bytes",
                kind="RequestTooLarge",
            ) from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model")
        body["model"] = self.config.model
        for field in ("max_tokens", "max_completion_tokens", "n"):
            value = body.get(field)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise GatewayError(400, f"{field} must be a positive integer", param=field)
        cap = self.settings.max_tokens_cap
        if cap is not None:
            for field in ("max_tokens", "max_completion_tokens"):
                if (body.get(field) or 0) > cap:
                    raise GatewayError(400, f"{field} may be at most {cap}", param=field)
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = cap
        if "stream" in body and not isinstance(body["stream"], bool):
            raise GatewayError(400, "stream must be true or false", param="stream")
        return body

    def needed_pools(self) -> list[str]:
        pools = ["decode"]
        if self.config.engine_api == "tokens":
            pools.insert(0, "render")
        return pools

    def fallback(self, reason: str) -> None:
        """P/D could not serve a request: count it, and let Auto mode learn from it."""
        self.metrics.fallbacks.labels(reason).inc()
        self.policy.health.failure()
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))

    def ttft_budget(self) -> float | None:
        ttft_ms = self.config.routing.slo.ttft_ms
        return None if ttft_ms is None else ttft_ms / 1000

    def itl_budget(self) -> float | None:
        itl_ms = self.config.routing.slo.itl_ms
        return None if itl_ms is None else itl_ms / 1000

    def note_transfers(self, decode: Endpoint, transfers: float, seconds: float) -> None:
        """KV transfers a decode engine finished since the last scrape: Auto mode learns the
        path from them for the prefill replicas of the engine's slice."""
        per_transfer = seconds / transfers * self.settings.engine_seconds_scale
        prefills = Endpoints.same_slice(self.endpoints.pools["prefill"], decode)
        self.policy.health.observe_transfers(
            per_transfer, self.ttft_budget(), [e.url for e in prefills]
        )
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))

    def note_step(self, endpoint: Endpoint, gap: float, now: float) -> None:
        """A stream's time between two tokens from this engine."""
        endpoint.steps.observe(gap, now, self.settings.step_window_seconds)

    def queue_state(self, selection: Selection) -> QueueState:
        """The least busy replica of each engine pool: queued plus running requests (the
        gateway's own in-flight count when it is ahead of the last scrape), and for prefill the
        long prompts held in the gateway's admission queue, shared among the replicas."""

        def active(endpoint: Endpoint) -> float:
            return endpoint.waiting + max(endpoint.running, endpoint.inflight)

        pools = selection.pools
        prefill = pools.get("prefill", [])
        queued = (len(self.admission.queue) + self.peers.queued()) / max(1, len(prefill))
        ahead_by = {e.url: active(e) + queued for e in prefill}
        calmest = min(pools.get("decode", []), key=active, default=None)
        return QueueState(
            decode_active=None if calmest is None else active(calmest),
            decode_step_seconds=None if calmest is None else calmest.steps.seconds,
            prefill_ahead=min(ahead_by.values(), default=None),
            prefill_ahead_by=ahead_by,
            prefill_backlog_by={e.url: float(e.prefill_backlog) for e in prefill},
        )

    def auto_decision(
        self, prompt_tokens: int | None, prefill_available: bool, selection: Selection
    ) -> Decision:
        """Routing mode Auto: P/D or local prefill for this request (see policy.py); P/D keeps
        only the prefill replicas whose KV path fits the TTFT budget."""
        prefill = selection.pools.get("prefill", [])
        self.policy.health.forget([e.url for e in self.endpoints.pools.get("prefill", [])])
        decision = self.policy.decide(
            prompt_tokens=prompt_tokens,
            prefill_available=prefill_available,
            ttft_budget=self.ttft_budget(),
            queues=self.queue_state(selection),
            prefill_replicas=[e.url for e in prefill],
            itl_budget=self.itl_budget(),
        )
        if decision.disaggregated and decision.prefill:
            selection.pools["prefill"] = [e for e in prefill if e.url in decision.prefill]
        self.metrics.auto_decisions.labels(decision.reason).inc()
        return decision

    async def status(self, _: web.Request) -> web.Response:
        health = self.policy.health
        return web.json_response(
            {
                "mode": self.config.routing.mode,
                "pdDegraded": health.degraded,
                "handoffSecondsPerToken": health.seconds_per_token,
                "handoffSecondsPerTokenByPrefill": {
                    url: estimate for url, (estimate, _) in health.by_prefill.items()
                },
                "recentFailures": len(health.failures),
                "admission": {
                    "leader": self.peers.leader() or "self",
                    "peers": sorted(self.peers.live),
                },
            }
        )

    def keep_verified_prefill(self, selection: Selection) -> bool:
        """kvTransfer.verify Required: only prefill replicas whose slice passed the transport
        preflight take P/D traffic; with none, requests prefill locally on decode. True when
        that left no prefill endpoint."""
        prefill = selection.pools.get("prefill")
        if self.config.kv_transfer.verify != "Required" or not prefill:
            return False
        selection.pools["prefill"] = [e for e in prefill if e.kv_transport == "Verified"]
        if selection.pools["prefill"]:
            return False
        self.metrics.fallbacks.labels("transport_unverified").inc()
        return True

    def wants_pd(self, selection: Selection) -> bool:
        mode = self.config.routing.mode
        if mode == "Aggregated" or self.config.pools.prefill is None:
            return False
        return bool(selection.pools.get("prefill"))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=False)

    async def handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        route = "unknown"
        if self._slots.locked():
            self.metrics.requests.labels(route, "rejected").inc()
            return error_response(
                GatewayError(
                    429,
                    f"the gateway is at its limit of {self.settings.max_inflight} requests in "
                    "flight; retry shortly",
                )
            )
        async with self._slots:
            self.metrics.inflight.inc()
            try:
                self.authorize(request)
                body = await self.read_body(request)
                request_id = request.headers.get("X-Request-Id") or f"pdserve-{uuid.uuid4().hex}"
                wait = self.settings.endpoint_wait_seconds
                selection = await self.endpoints.wait_select(
                    self.needed_pools(), ["prefill"], wait_seconds=wait
                )
                unverified = self.keep_verified_prefill(selection)
                pd = self.wants_pd(selection)
                if (
                    self.config.routing.mode == "Disaggregated"
                    and not pd
                    and self.config.pools.prefill
                    and not unverified
                ):
                    raise NoEndpoints("routing mode Disaggregated but no healthy prefill endpoint")
                context = Context(self, request, body, chat, request_id, selection, pd, started)
                route = context.route
                response = await context.run()
                route = context.route  # Auto mode decides P/D or local inside run()
                self.metrics.requests.labels(route, "ok").inc()
                self.metrics.e2e.labels(route).observe(time.monotonic() - started)
                context.log_finished()
                return response
            except GatewayError as error:
                self.metrics.requests.labels(route, f"error_{error.status}").inc()
                return error_response(error)
            except NoEndpoints as error:
                self.metrics.requests.labels(route, "no_endpoints").inc()
                return error_response(GatewayError(503, str(error)))
            finally:
                self.metrics.inflight.dec()

    # ---- upstream calls --------------------------------------------------------------------------
    def headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers and not self.settings.api_keys:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def post_json(
        self,
        stage: str,
        candidates: list[Endpoint],
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout: float,  # noqa: ASYNC109 - a per-hop client timeout, not a cancel scope
        *,
        retry: bool = True,
        affinity: Mapping[str, int] | None = None,
        prefill_tokens: int = 0,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        """POST to one replica of a pool; on connection errors or 5xx try the next one.
        `prefill_tokens`: the prompt the call prefills, counted on the replica meanwhile."""
        tried: list[Endpoint] = []
        last = "no endpoint"
        while (endpoint := self.endpoints.pick(candidates, tried, affinity)) is not None:
            tried.append(endpoint)
            begun = time.monotonic()
            on_render = stage in ("render", "derender")
            if on_render:
                self.metrics.render_inflight.labels(endpoint.label).inc()
            try:
                async with (
                    self.counted(endpoint, prefill_tokens),
                    self.client.post(
                        f"{endpoint.url}{path}",
                        json=body,
                        headers=dict(headers),
                        timeout=aiohttp.ClientTimeout(
                            total=timeout, sock_connect=self.settings.connect_timeout
                        ),
                    ) as response,
                ):
                    status = response.status
                    payload = await response.read()
            except (TimeoutError, aiohttp.ClientError) as error:
                last = f"{stage} at {endpoint.url}: {type(error).__name__}: {error}"
                self.endpoints.mark_down(endpoint)
            else:
                if status < 500:
                    self.metrics.stage.labels(stage).observe(time.monotonic() - begun)
                    if status >= 400:
                        raise GatewayError(status, upstream_message(payload), kind="UpstreamError")
                    try:
                        return endpoint, json.loads(payload)
                    except json.JSONDecodeError:
                        raise GatewayError(
                            502,
                            f"{stage} at {endpoint.url} answered non-JSON",
                            kind="UpstreamError",
                        ) from None
                message = upstream_message(payload)
                last = f"{stage} at {endpoint.url}: HTTP {status}: {message}"
                if "KV transfer" in last:
                    raise UpstreamFailed(stage, last, status)
            finally:
                if on_render:
                    self.metrics.render_inflight.labels(endpoint.label).dec()
                    spent = time.monotonic() - begun
                    self.metrics.render_call.labels(endpoint.label, stage).observe(spent)
            if not retry:
                break
            self.metrics.retries.labels(stage, "upstream_error").inc()
            log.warning(
                "%s; trying another replica",
                last,
                extra={"request_id": headers.get("X-Request-Id")},
            )
        raise UpstreamFailed(stage, last)

    async def abort(self, endpoint: Endpoint | None, request_ids: list[str]) -> None:
        if endpoint is None:
            return
        self.metrics.aborts.inc()
        with suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with self.client.post(
                f"{endpoint.url}/abort_requests",
                json={"request_ids": request_ids},
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as response:
                await response.read()


def upstream_message(payload: bytes) -> str:
    """The error message inside an upstream error body (vLLM's or ours), else the raw text."""
    text = payload.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return text[:500]


class Context:
    """One client request on its way through the pools."""

    def __init__(
        self,
        gateway: Gateway,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        request_id: str,
        selection: Selection,
        pd: bool,
        started: float,
    ) -> None:
        self.gw, self.request, self.body, self.chat = gateway, request, body, chat
        self.request_id, self.selection, self.pd, self.started = request_id, selection, pd, started
        self.stream = bool(body.get("stream"))
        tokens = gateway.config.engine_api == "tokens"
        self.tokens_api = tokens
        self.headers = gateway.headers(request, request_id)
        self.first_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.gaps: list[float] = []
        conversation = body.get("conversation_id") or request.headers.get("X-Conversation-Id")
        self.conversation = str(conversation) if conversation else None
        self.prefill_done_at: float | None = None
        self.prefilled_on: Endpoint | None = None
        self.local_anywhere = False  # Auto found the P/D path unusable (see policy.Decision)
        self.auto_reason: str | None = None
        self.served_by: dict[str, str] = {}
        """Stage (prefill, decode) -> the engine that ran it (pod name or URL), for the log."""
        self.sent_at_ms = int(time.time() * 1000)
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None

    def log_finished(self) -> None:
        """One JSON Lines entry (the chunked-prefill article's fields) if the log is on."""
        log_ = self.gw.request_log
        if log_ is None:
            return
        now = time.monotonic()

        def wall_ms(moment: float | None) -> int | None:
            return None if moment is None else self.sent_at_ms + int((moment - self.started) * 1000)

        gap_p95 = p95(self.gaps)
        log_.record(
            {
                "request_id": self.request_id,
                "class": self.request.headers.get(
                    "X-PDServe-Class", "chat" if self.chat else "completion"
                ),
                "route": self.route,
                "prompt_tokens": self.prompt_tokens,
                "requested_output_tokens": self.body.get(
                    "max_completion_tokens", self.body.get("max_tokens")
                ),
                "sent_at_ms": self.sent_at_ms,
                "first_token_at_ms": wall_ms(self.first_token_at or now),
                "finished_at_ms": wall_ms(now),
                "output_tokens": self.output_tokens,
                "inter_token_ms_p95": None if gap_p95 is None else round(gap_p95 * 1000, 2),
                "render_engine": self.served_by.get("render"),
                "prefill_engine": self.served_by.get("prefill"),
                "decode_engine": self.served_by.get("decode"),
                "parity_hash": self.selection.parity_hash,
                "auto_reason": self.auto_reason,
            }
        )

    @property
    def settings(self) -> GatewaySettings:
        return self.gw.settings

    def decide_auto(self, prompt_tokens: int) -> None:
        decision = self.gw.auto_decision(prompt_tokens, self.pd, self.selection)
        self.pd = decision.disaggregated
        self.local_anywhere = decision.anywhere
        self.auto_reason = decision.reason

    def note_handoff(self, first_token_at: float, prompt_tokens: int) -> None:
        """Prefill answered -> decode's first streamed token: the KV pull plus one decode step,
        what Auto mode predicts the next handoffs from."""
        if self.prefill_done_at is None:
            return
        gw = self.gw
        handoff = first_token_at - self.prefill_done_at
        self.prefill_done_at = None  # once per request
        gw.metrics.stage.labels("kv_handoff").observe(handoff)
        prefill = None if self.prefilled_on is None else self.prefilled_on.url
        gw.policy.health.observe(handoff, prompt_tokens, gw.ttft_budget(), prefill)
        gw.metrics.pd_degraded.set(int(gw.policy.health.degraded))

    def decode_candidates(self, with_kv: bool) -> list[Endpoint]:
        """Decode replicas for this request: with prefill's KV to pull, those in the prefill
        replica's slice first (same topology domain, the verified path). A request Auto mode
        prefills locally may also run whole on a prefill replica (engines serve a request
        without kv_transfer_params end to end)."""
        gw = self.gw
        pool = self.selection.pools["decode"]
        if with_kv:
            return gw.endpoints.same_slice(pool, self.prefilled_on)
        if self.local_anywhere and gw.policy.settings.local_on_prefill_pool:
            return pool + self.selection.pools.get("prefill", [])
        return pool

    def estimated_prompt_tokens(self) -> int:
        """Without a render pool there are no token ids: ~4 characters a token."""
        return len(json.dumps(self.body.get("messages") or self.body.get("prompt") or "")) // 4

    def affinity(self, stage: str, token_ids: list[int] | None) -> dict[str, int]:
        """Where this request's prefix is probably cached, and where its conversation ran."""
        gw = self.gw
        scores: dict[str, int] = {}
        if token_ids:
            hashes = block_hashes(token_ids, gw.config.block_size)
            for endpoint in self.selection.pools.get(stage, []):
                if blocks := gw.prefixes.cached_blocks(endpoint.url, hashes):
                    scores[endpoint.url] = blocks
        if self.conversation and (url := gw.conversations.endpoint(self.conversation, stage)):
            scores[url] = scores.get(url, 0) + 1_000_000  # stay on the conversation's engine
        return scores

    def remember(self, stage: str, endpoint: Endpoint, token_ids: list[int] | None) -> None:
        gw = self.gw
        self.served_by[stage] = endpoint.label
        if token_ids:
            gw.prefixes.record(endpoint.url, block_hashes(token_ids, gw.config.block_size))
        if self.conversation:
            gw.conversations.remember(self.conversation, stage, endpoint.url)

    @property
    def route(self) -> str:
        if self.tokens_api:
            return "render_pd" if self.pd else "render"
        return "openai_pd" if self.pd else "aggregated"

    async def run(self) -> web.StreamResponse:
        if self.gw.config.engine_api == "tokens":
            return await self.tokens_route()
        return await self.openai_route()

    # ---- prefill -> KV handoff (both APIs) -------------------------------------------------------
    async def prefill(
        self, path: str, body: dict[str, Any], token_ids: list[int] | None = None
    ) -> tuple[Endpoint, dict[str, Any]] | None:
        """Run prefill; None when no prefill replica could (the caller prefills on decode)."""
        gw = self.gw
        prompt_tokens = len(token_ids) if token_ids else self.estimated_prompt_tokens()
        request_class = gw.admission.request_class(
            prompt_tokens, self.request.headers.get("X-PDServe-Class")
        )
        pool = self.selection.pools["prefill"]
        affinity = self.affinity("prefill", token_ids)
        try:
            endpoint, answer = await self.call_prefill(
                path, body, pool, affinity, request_class, prompt_tokens
            )
            self.remember("prefill", endpoint, token_ids)
        except UpstreamFailed as error:
            log.warning(
                "%s: prefill failed (%s); prefilling on decode",
                self.request_id,
                error,
                extra={"request_id": self.request_id},
            )
            self.gw.fallback("prefill_failed")
            return None
        assert isinstance(answer, dict)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            self.gw.fallback("no_kv_params")
            return None
        expiry = params.get("remote_blocks_expiry_time")
        if (
            isinstance(expiry, int | float)
            and expiry - time.time() < self.settings.lease_margin_seconds
        ):
            # The lease would run out before decode starts pulling: recompute instead.
            self.gw.fallback("lease_expiring")
            await self.gw.abort(endpoint, [self.request_id])
            return None
        self.prefill_done_at = time.monotonic()
        self.prefilled_on = endpoint
        gw.policy.health.note_pd_prompt(prompt_tokens)
        return endpoint, params

    async def call_prefill(
        self,
        path: str,
        body: dict[str, Any],
        pool: list[Endpoint],
        affinity: Mapping[str, int],
        request_class: str,
        prompt_tokens: int,
    ) -> tuple[Endpoint, dict[str, Any] | list[Any]]:
        """POST to a prefill replica. A long prompt holds a slot on the best replica with room
        (affinity and load rank them); if that replica fails, the slot goes back and the next
        one with room is tried. UpstreamFailed when none could."""
        gw = self.gw
        # Short prompts need no slot: post_json itself moves on to the next replica.
        ranked = [e.url for e in Endpoints.rank(pool, affinity)] if request_class == LONG else []
        while True:
            granted: str | None = None
            try:
                async with gw.peers.slot(request_class, ranked) as granted:
                    begun = time.monotonic()
                    answer = await gw.post_json(
                        "prefill",
                        pool if granted is None else [e for e in pool if e.url == granted],
                        path,
                        body,
                        self.headers,
                        self.settings.prefill_timeout,
                        affinity=affinity,
                        prefill_tokens=prompt_tokens,
                    )
                    gw.policy.health.observe_prefill(time.monotonic() - begun, prompt_tokens)
                    return answer
            except UpstreamFailed:
                ranked = [url for url in ranked if url != granted]
                if granted is None or not ranked:
                    raise  # no other replica to try: the caller prefills on decode

    # ---- route 1 and 3: render + tokens engines --------------------------------------------
    async def tokens_route(self) -> web.StreamResponse:
        gw = self.gw
        path = "/v1/chat/completions/render" if self.chat else "/v1/completions/render"
        render_endpoint, rendered = await gw.post_json(
            "render",
            self.selection.pools["render"],
            path,
            self.body,
            self.headers,
            self.settings.render_timeout,
        )
        self.served_by["render"] = render_endpoint.label
        generates = rendered if isinstance(rendered, list) else [rendered]
        if len(generates) != 1:
            raise GatewayError(400, "send one prompt per request", param="prompt")
        generate = generates[0]
        generate["request_id"] = self.request_id
        if self.gw.config.routing.mode == "Auto":
            self.decide_auto(len(generate["token_ids"]))
        prefill_endpoint: Endpoint | None = None
        kv: dict[str, Any] | None = None
        if self.pd:
            prefill_body = copy.deepcopy(generate)
            prefill_body["stream"] = False
            prefill_body["stream_options"] = None
            params = prefill_body["sampling_params"]
            params.update({"max_tokens": 1, "min_tokens": 0, "n": 1})
            handoff = self.bidirectional_handoff(generate["token_ids"])
            prefill_body["kv_transfer_params"] = handoff
            params["extra_args"] = {
                **(params.get("extra_args") or {}),
                "kv_transfer_params": handoff,
            }
            prefilled = await self.prefill(
                "/inference/v1/generate", prefill_body, generate["token_ids"]
            )
            if prefilled is not None:
                prefill_endpoint, kv = prefilled
        if self.stream:
            return await self.stream_generate(generate, kv, prefill_endpoint)
        return await self.generate_once(generate, kv, prefill_endpoint)

    def bidirectional_handoff(self, prompt_ids: list[int]) -> dict[str, Any]:
        """The prefill's kv_transfer_params: with bidirectional KV and a conversation whose last
        decode turn left its KV on decode, point prefill at it, if the token ids still match
        for at least a block."""
        handoff = prefill_handoff_params()
        gw = self.gw
        if not (gw.config.kv_transfer.bidirectional and self.conversation):
            return handoff
        held, outcome, matched = gw.decode_kv.reuse(
            self.conversation, prompt_ids, gw.config.block_size
        )
        if outcome != "none":
            gw.metrics.bidirectional.labels(outcome).inc()
        if held is None:
            return handoff
        gw.metrics.bidirectional_tokens.inc(matched)
        return {**held, "do_remote_decode": True, "do_remote_prefill": False}

    def keep_decode_kv(self, prompt_ids: list[int], answer: Mapping[str, Any]) -> None:
        """What decode holds after a non-streamed turn (streamed turns return no
        kv_transfer_params, so they leave nothing to reuse)."""
        params = answer.get("kv_transfer_params")
        choices = answer.get("choices") or []
        if not (self.gw.config.kv_transfer.bidirectional and self.conversation):
            return
        if isinstance(params, dict) and params.get("remote_request_id") and len(choices) == 1:
            output = list(choices[0].get("token_ids") or [])
            self.gw.decode_kv.keep(self.conversation, params, [*prompt_ids, *output])

    def decode_body(
        self, generate: Mapping[str, Any], kv: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        body = copy.deepcopy(dict(generate))
        if kv is not None:
            body["kv_transfer_params"] = dict(kv)
            params = body["sampling_params"]
            # Older engines read it only from extra_args.
            params["extra_args"] = {
                **(params.get("extra_args") or {}),
                "kv_transfer_params": dict(kv),
            }
        return body

    async def decode_once(
        self,
        path: str,
        body: dict[str, Any],
        local_body: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """One non-streamed decode call. If it fails loading prefill's KV (local_body is the
        same request without kv_transfer_params), retry once with local prefill on decode."""
        gw = self.gw
        # Decode prefills itself unless KV arrives: then its own prefix cache matters.
        local = local_body is None
        try:
            endpoint, answer = await gw.post_json(
                "decode",
                self.decode_candidates(with_kv=not local),
                path,
                body,
                self.headers,
                self.settings.decode_timeout,
                affinity=self.affinity("decode", token_ids if local else None),
            )
            self.remember("decode", endpoint, token_ids if local else None)
        except UpstreamFailed as error:
            if local_body is None:
                raise GatewayError(502, str(error), kind="UpstreamError") from None
            gw.fallback("kv_load_failed")
            await gw.abort(prefill_endpoint, [self.request_id])
            endpoint, answer = await gw.post_json(
                "decode",
                self.selection.pools["decode"],
                path,
                local_body,
                self.headers,
                self.settings.decode_timeout,
            )
            self.served_by["decode"] = endpoint.label
        assert isinstance(answer, dict)
        return answer

    async def generate_once(
        self, generate: dict[str, Any], kv: dict[str, Any] | None, prefill_endpoint: Endpoint | None
    ) -> web.Response:
        gw = self.gw
        answer = await self.decode_once(
            "/inference/v1/generate",
            self.decode_body(generate, kv),
            self.decode_body(generate, None) if kv is not None else None,
            prefill_endpoint,
            generate["token_ids"],
        )
        self.keep_decode_kv(generate["token_ids"], answer)
        path = "/v1/chat/completions/derender" if self.chat else "/v1/completions/derender"
        _, result = await gw.post_json(
            "derender",
            self.selection.pools["render"],
            path,
            {
                "stream": False,
                "model": gw.config.model,
                "generate_response": answer,
                "prompt_tokens": len(generate["token_ids"]),
                "prompt_token_ids": generate["token_ids"],
                "chat_request": self.body if self.chat else None,
            },
            self.headers,
            self.settings.render_timeout,
        )
        assert isinstance(result, dict)
        result["model"] = gw.config.model
        result["id"] = self.request_id
        usage = result.get("usage") or {}
        self.prompt_tokens, self.output_tokens = (
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
        )
        gw.metrics.ttft.labels(self.route).observe(time.monotonic() - self.started)
        return web.json_response(result)

    @asynccontextmanager
    async def open_decode_stream(
        self, generate: dict[str, Any], kv: dict[str, Any] | None, prefill_endpoint: Endpoint | None
    ) -> AsyncIterator[tuple[Endpoint, aiohttp.ClientResponse]]:
        """Open the decode SSE stream; a KV load failure before any token is retried once with
        local prefill on decode."""
        gw = self.gw
        attempts: list[dict[str, Any] | None] = [kv, None] if kv is not None else [None]
        tried: list[Endpoint] = []
        failure = "no decode endpoint"
        for attempt_kv in attempts:
            local_ids = generate["token_ids"] if attempt_kv is None else None
            affinity = self.affinity("decode", local_ids)
            while (
                endpoint := gw.endpoints.pick(
                    self.decode_candidates(with_kv=attempt_kv is not None), tried, affinity
                )
            ) is not None:
                body = self.decode_body(generate, attempt_kv)
                async with gw.counted(endpoint):
                    try:
                        response = await gw.post_stream(
                            endpoint, "/inference/v1/generate", body, self.headers
                        )
                    except (TimeoutError, aiohttp.ClientError) as error:
                        tried.append(endpoint)
                        gw.metrics.retries.labels("decode", "connect").inc()
                        failure = f"decode at {endpoint.url}: {type(error).__name__}: {error}"
                        continue
                    if response.status == 200:
                        self.remember("decode", endpoint, local_ids)
                        try:
                            yield endpoint, response
                        finally:
                            response.release()
                        return
                    message = upstream_message(await response.read())
                    response.release()
                if 400 <= response.status < 500:
                    raise GatewayError(response.status, message, kind="UpstreamError")
                failure = f"decode at {endpoint.url}: HTTP {response.status}: {message}"
                if attempt_kv is not None and "KV transfer" in message:
                    gw.fallback("kv_load_failed")
                    await gw.abort(prefill_endpoint, [self.request_id])
                    tried = []
                    break  # next attempt: local prefill
                tried.append(endpoint)
                gw.metrics.retries.labels("decode", "upstream_error").inc()
        raise GatewayError(502, failure, kind="UpstreamError")

    async def stream_generate(
        self, generate: dict[str, Any], kv: dict[str, Any] | None, prefill_endpoint: Endpoint | None
    ) -> web.StreamResponse:
        gw = self.gw
        self.prompt_tokens = len(generate["token_ids"])
        async with self.open_decode_stream(generate, kv, prefill_endpoint) as (decode, upstream):
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(self.request)
            writer = ClientWriter(response, self)
            pipelines: dict[int, DerenderPipeline] = {}
            usage: dict[str, Any] | None = None
            finished = False
            broke = ""
            opened = time.monotonic()
            first_event = True
            last_event: float | None = None
            try:
                try:
                    async for raw in upstream.content:
                        line = raw.decode().rstrip("\r\n")
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        if data == "[DONE]":
                            finished = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            broke = f"decode reported: {event['error']}"
                            break
                        if event.get("choices"):
                            now = time.monotonic()
                            if last_event is not None:
                                gw.note_step(decode, now - last_event, now)
                            last_event = now
                        if first_event and event.get("choices"):
                            first_event = False
                            gw.metrics.stage.labels("decode_first_token").observe(now - opened)
                            self.note_handoff(now, len(generate["token_ids"]))
                        if event.get("usage") is not None:
                            usage = event["usage"]
                        for choice in event.get("choices") or []:
                            self.output_tokens = (self.output_tokens or 0) + len(
                                choice.get("token_ids") or []
                            )
                            index = int(choice.get("index", 0))
                            if index not in pipelines:
                                pipelines[index] = DerenderPipeline(self, generate, index, writer)
                            pipelines[index].push(
                                list(choice.get("token_ids") or []), choice.get("finish_reason")
                            )
                except (TimeoutError, aiohttp.ClientError) as error:
                    broke = f"decode stream broke ({type(error).__name__})"
                # Flush what was generated before reporting anything, so chunks stay in order.
                results = await asyncio.gather(
                    *(p.close(complete=finished) for p in pipelines.values()),
                    return_exceptions=True,
                )
                failed = [r for r in results if isinstance(r, BaseException)]
                if finished:
                    gw.policy.observe_output(self.output_tokens or 0)
                if failed:
                    await writer.error(502, f"derender failed: {failed[0]}")
                elif not finished:
                    # The engine went away mid-stream: say so instead of truncating silently.
                    reason = f": {broke}" if broke else ""
                    await writer.error(
                        502, f"decode stream ended before the answer was complete{reason}"
                    )
                options = self.body.get("stream_options") or {}
                if finished and not failed and usage is not None and options.get("include_usage"):
                    await writer.send(
                        {
                            "id": self.request_id,
                            "object": writer.object_name,
                            "created": int(time.time()),
                            "model": gw.config.model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                await writer.done()
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away: stop the engines working for it.
                for pipeline in pipelines.values():
                    pipeline.cancel()
                await asyncio.shield(gw.abort(decode, [self.request_id]))
                raise
            return response

    # ---- route 2 and 4: engines speaking OpenAI --------------------------------------------
    async def openai_route(self) -> web.StreamResponse:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        kv: dict[str, Any] | None = None
        prefill_endpoint: Endpoint | None = None
        if self.gw.config.routing.mode == "Auto":
            self.decide_auto(self.estimated_prompt_tokens())
        if self.pd:
            prefill_body = {**self.body, "stream": False, "max_tokens": 1, "n": 1}
            if "max_completion_tokens" in prefill_body:
                prefill_body["max_completion_tokens"] = 1
            for field in ("stream_options", "min_tokens"):
                prefill_body.pop(field, None)
            prefill_body["kv_transfer_params"] = prefill_handoff_params()
            prefilled = await self.prefill(path, prefill_body)
            if prefilled is not None:
                prefill_endpoint, kv = prefilled
        body = {**self.body, **({"kv_transfer_params": kv} if kv else {})}
        if not self.stream:
            answer = await self.decode_once(
                path, body, self.body if kv is not None else None, prefill_endpoint
            )
            answer.pop("kv_transfer_params", None)
            usage = answer.get("usage") or {}
            self.prompt_tokens = usage.get("prompt_tokens")
            self.output_tokens = usage.get("completion_tokens")
            return web.json_response(answer)
        return await self.proxy_stream(path, body)

    async def proxy_stream(self, path: str, body: dict[str, Any]) -> web.StreamResponse:
        gw = self.gw
        endpoint = gw.endpoints.pick(
            self.decode_candidates(with_kv="kv_transfer_params" in body),
            affinity=self.affinity("decode", None),
        )
        if endpoint is None:
            raise GatewayError(503, "no healthy decode endpoint")
        self.remember("decode", endpoint, None)
        # Count the stream on its engine at once: the next pick must not wait for a scrape.
        backlog = 0 if "kv_transfer_params" in body else self.estimated_prompt_tokens()
        async with gw.counted(endpoint, backlog) as prefilled:
            return await self._proxy_stream(endpoint, path, body, prefilled)

    async def _proxy_stream(
        self, endpoint: Endpoint, path: str, body: dict[str, Any], prefilled: Callable[[], None]
    ) -> web.StreamResponse:
        gw = self.gw
        try:
            upstream = await gw.post_stream(endpoint, path, body, self.headers)
        except (TimeoutError, aiohttp.ClientError) as error:
            raise GatewayError(
                502,
                f"decode at {endpoint.url}: {type(error).__name__}: {error}",
                kind="UpstreamError",
            ) from None
        try:
            if upstream.status != 200:
                raise GatewayError(
                    upstream.status if upstream.status < 500 else 502,
                    upstream_message(await upstream.read()),
                    kind="UpstreamError",
                )
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(self.request)
            writer = ClientWriter(response, self)
            done = False
            broke = ""
            events = 0
            last_event: float | None = None
            try:
                try:
                    async for raw in upstream.content:
                        line = raw.decode().rstrip("\r\n")
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            gw.policy.observe_output(events)
                            break
                        now = time.monotonic()
                        if last_event is not None:
                            gw.note_step(endpoint, now - last_event, now)
                        last_event = now
                        events += 1
                        if "kv_transfer_params" in body:
                            self.note_handoff(now, self.estimated_prompt_tokens())
                        prefilled()
                        writer.note_token()
                        await response.write(f"{line}\n\n".encode())
                except (TimeoutError, aiohttp.ClientError) as error:
                    broke = f": decode stream broke ({type(error).__name__})"
                if not done:
                    await writer.error(
                        502, f"decode stream ended before the answer was complete{broke}"
                    )
                await writer.done()
            except (ConnectionResetError, asyncio.CancelledError):
                await asyncio.shield(gw.abort(endpoint, [self.request_id]))
                raise
            return response
        finally:
            upstream.release()


class ClientWriter:
    """Serializes writes to the client and records TTFT/ITL as the client sees them."""

    def __init__(self, response: web.StreamResponse, context: Context) -> None:
        self.response, self.context = response, context
        self.lock = asyncio.Lock()
        self.object_name = "chat.completion.chunk" if context.chat else "text_completion"

    def note_token(self) -> None:
        ctx, now = self.context, time.monotonic()
        if ctx.first_token_at is None:
            ctx.first_token_at = now
            ctx.gw.metrics.ttft.labels(ctx.route).observe(now - ctx.started)
        elif ctx.last_chunk_at is not None:
            ctx.gw.metrics.itl.labels(ctx.route).observe(now - ctx.last_chunk_at)
            ctx.gaps.append(now - ctx.last_chunk_at)
        ctx.last_chunk_at = now

    async def send(self, chunk: Any) -> None:
        async with self.lock:
            await self.response.write(sse(chunk))

    async def error(self, status: int, message: str) -> None:
        await self.send(error_body(status, message, "UpstreamError"))

    async def done(self) -> None:
        async with self.lock:
            await self.response.write(b"data: [DONE]\n\n")


class DerenderPipeline:
    """At most one derender call in flight per choice: tokens that arrive meanwhile are merged
    into the next call, so light load is per-token (TTFT untouched) and heavy load batches
    itself, cutting render CPU."""

    def __init__(
        self, context: Context, generate: Mapping[str, Any], index: int, writer: ClientWriter
    ) -> None:
        self.context, self.generate, self.index, self.writer = context, generate, index, writer
        self.queue: asyncio.Queue[tuple[list[int], str | None]] = asyncio.Queue()
        self.task = asyncio.create_task(self.run())
        self.calls = 0

    def push(self, token_ids: list[int], finish: str | None) -> None:
        self.queue.put_nowait((token_ids, finish))

    async def close(self, *, complete: bool) -> None:
        if not complete:
            self.queue.put_nowait(([], "__abandoned__"))
        await self.task

    def cancel(self) -> None:
        self.task.cancel()

    async def run(self) -> None:
        ctx = self.context
        gw = ctx.gw
        state: Any = None
        path = "/v1/chat/completions/derender" if ctx.chat else "/v1/completions/derender"
        prompt_ids = self.generate["token_ids"]
        while True:
            token_ids, finish = await self.queue.get()
            pipelining = ctx.settings.derender_pipelining
            while pipelining and finish is None and not self.queue.empty():
                more, finish = self.queue.get_nowait()
                token_ids = token_ids + more
            # The stream ended early: derender what arrived, then stop (no finish reason).
            abandoned = finish == "__abandoned__"
            if abandoned:
                finish = None
                if not token_ids:
                    break
            self.calls += 1
            gw.metrics.tokens_per_derender.observe(len(token_ids))
            _, result = await gw.post_json(
                "derender",
                ctx.selection.pools["render"],
                path,
                {
                    "stream": True,
                    "model": gw.config.model,
                    "stream_state": state,
                    "generate_chunk": {
                        "request_id": ctx.request_id,
                        "choices": [
                            {
                                "index": self.index,
                                "token_ids": token_ids,
                                "finish_reason": finish,
                                "logprobs": None,
                            }
                        ],
                    },
                    "prompt_tokens": len(prompt_ids),
                    "prompt_token_ids": prompt_ids,
                    "chat_request": ctx.body if ctx.chat else None,
                },
                ctx.headers,
                ctx.settings.render_timeout,
            )
            assert isinstance(result, dict)
            state = result.get("stream_state")
            chunk = result["chunk"]
            chunk["id"] = ctx.request_id
            chunk["model"] = gw.config.model
            choices = chunk.get("choices") or []
            if any(_has_content(c) or c.get("finish_reason") for c in choices):
                self.writer.note_token()
                await self.writer.send(chunk)
            if finish is not None or abandoned:
                break
        gw.metrics.derender_calls.observe(self.calls)


def _has_content(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        return any(
            delta.get(k)
            for k in ("role", "content", "reasoning", "reasoning_content", "tool_calls")
        )
    return bool(choice.get("text"))
