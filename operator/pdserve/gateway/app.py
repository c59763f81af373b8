"""The OpenAI-compatible gateway: render -> prefill -> decode -> derender, streaming, failures.

Routes (chosen by the model's config):
1. render + P/D: render, prefill (max_tokens=1, do_remote_decode), decode with prefill's
   kv_transfer_params, derender.
2. P/D without render: the OpenAI-level handoff against engines that speak OpenAI.
3. render + one engine pool: render, generate, derender.
4. aggregated: straight to the decode pool; also the fallback when P/D cannot serve a request.
Every request ends in a correct answer or a clear OpenAI-style error, never a hang.

This module wires the parts (intake.py, planner.py, tokens_route.py, openai_route.py,
admission.py, upstream.py) into the web application, runs its background tasks, and serves
the operational endpoints (health, ready, models, metrics, status); server.py serves it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from pdserve.contract.names import GATEWAY_EVENT_REPORTER
from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.admission import AdmissionHandlers
from pdserve.gateway.affinity import Conversations, DecodeKv, PrefixIndex
from pdserve.gateway.dataplane import (
    INTAKE_HEADER,
    INTAKE_PATH,
    DataPlane,
    from_data_plane,
    spent_in_data_plane,
)
from pdserve.gateway.discovery import PodDiscovery
from pdserve.gateway.endpoints import Endpoints, NoEndpoints
from pdserve.gateway.errors import (
    GatewayError,
    client_error,
    client_went_away,
    error_body,
    error_response,
    http_error_response,
)
from pdserve.gateway.exchange import (
    Exchange,
    client_request_id,
    echo_request_id,
    gateway_request_id,
)
from pdserve.gateway.fairqueue import PrefillAdmission
from pdserve.gateway.held_kv import DecodeHolds
from pdserve.gateway.hops import Hops
from pdserve.gateway.intake import Intake
from pdserve.gateway.load import LoadScraper
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_route import OpenAIRoute
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.placement import Placement
from pdserve.gateway.planner import RoutePlanner
from pdserve.gateway.policy import AutoPolicy
from pdserve.gateway.replica_contract import (
    ReplicaCheck,
    ReplicaContract,
    Verdict,
    event_of,
    session_fetch,
)
from pdserve.gateway.request_log import RequestLog
from pdserve.gateway.server import CLIENT_KEEPALIVE
from pdserve.gateway.settings import GatewaySettings
from pdserve.gateway.tokens_route import TokensRoute
from pdserve.gateway.upstream import UpstreamClient
from pdserve.kube.client import Kube
from pdserve.kube.events import post_event
from pdserve.wirejson import dumps

log = logging.getLogger("pdserve.gateway")


class Gateway:
    def __init__(self, config: GatewayConfig, settings: GatewaySettings | None = None) -> None:
        self.config = config
        self.settings = s = settings or GatewaySettings()
        self.endpoints = Endpoints(config)
        self.metrics = GatewayMetrics()
        self._slots = asyncio.Semaphore(s.max_inflight)
        self._discovery: PodDiscovery | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._scrape_task: asyncio.Task[None] | None = None
        self._peers_task: asyncio.Task[None] | None = None
        self.upstream = UpstreamClient(self.endpoints, self.metrics, s)
        self.intake = Intake(
            config.model,
            s,
            tokens_only_engines=config.tokens_only_engines,
            adapters=config.adapters,
        )
        self.admission = PrefillAdmission(s.fair_queue)
        # Peers present the peer key when one is set, else the gateway's own API key.
        peer_key = next(iter(s.peer_keys or s.api_keys), None)
        self.peers = PeerAdmission(self.admission, lambda: self.upstream.session, api_key=peer_key)
        if config.endpoints is not None:
            own = config.endpoints.self_url
            self.peers.set_peers(
                [u.rstrip("/") for u in config.endpoints.peers],
                self_url=None if own is None else own.rstrip("/"),
            )
        self.planner = RoutePlanner(
            config,
            self.endpoints,
            AutoPolicy(settings.policy if settings else None),
            self.admission,
            self.peers,
            self.metrics,
            endpoint_wait_seconds=s.endpoint_wait_seconds,
            engine_seconds_scale=s.engine_seconds_scale,
            step_window_seconds=s.step_window_seconds,
        )
        self.prefixes = PrefixIndex()
        self.conversations = Conversations()
        self.decode_kv = DecodeKv(ttl=config.kv_transfer.decode_blocks_ttl_seconds)
        self.decode_holds = DecodeHolds(
            ttl=config.kv_transfer.decode_blocks_ttl_seconds,
            block_size=config.block_size,
            fraction=s.held_kv_fraction,
        )
        placement = Placement(config.block_size, self.prefixes, self.conversations)
        hops = Hops(self.upstream, self.planner, placement, self.admission, self.peers, s)
        self.completion_route: TokensRoute | OpenAIRoute
        if config.engine_api == "tokens":
            self.completion_route = TokensRoute(
                config, s, self.upstream, hops, self.planner, placement, self.decode_kv,
                self.metrics, self.decode_holds, self.peers,
            )  # fmt: skip
        else:
            self.completion_route = OpenAIRoute(
                self.upstream, hops, self.planner, placement, self.metrics
            )
        self.admission_handlers = AdmissionHandlers(
            self.admission, self.peers, hold_seconds=s.first_byte_timeout,
            max_holds_per_peer=s.max_inflight,
        )  # fmt: skip
        self.request_log = RequestLog(s.request_log) if s.request_log else None
        self.replica_contract = (
            ReplicaContract(
                self.endpoints, config.model, session_fetch(lambda: self.upstream.session),
                report=self._report_check,
            )
            if config.replica_check == "Enforce"
            else None
        )  # fmt: skip
        self._event_tasks: set[asyncio.Task[None]] = set()
        self.data_plane: DataPlane | None = None
        prefill, decode = config.pools.prefill, config.pools.decode
        if prefill is not None and prefill.kv_compat != decode.kv_compat:
            # The spec's own pools can never pair: every request will prefill on decode.
            log.warning(
                "prefill and decode pools have different KV-compatibility digests (%s, %s): "
                "no P/D pairing is possible; check the pools' --dtype and other KV layout "
                "inputs in extraArgs/env",
                prefill.kv_compat,
                decode.kv_compat,
            )

    @property
    def policy(self) -> AutoPolicy:
        return self.planner.policy

    @policy.setter
    def policy(self, policy: AutoPolicy) -> None:
        self.planner.policy = policy

    @property
    def client(self) -> aiohttp.ClientSession:
        return self.upstream.session

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[self.intake.middleware, self._errors],
            # The intake undoes Content-Encoding (content_encoding.py): aiohttp's parser would
            # refuse a coding or a body it cannot decode itself, in text/plain.
            handler_args={"auto_decompress": False},
        )
        app[CLIENT_KEEPALIVE] = self.settings.keepalive_timeout
        app.on_response_prepare.append(echo_request_id)
        expect = self.intake.expect_continue
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=expect)
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        app.router.add_get("/v1/models", self.models, expect_handler=expect)
        app.router.add_get("/health", self.health, expect_handler=expect)
        app.router.add_get("/ready", self.ready, expect_handler=expect)
        app.router.add_get("/metrics", self.metrics_endpoint, expect_handler=expect)
        app.router.add_get("/status", self.status, expect_handler=expect)
        self.admission_handlers.add_routes(app, expect)
        for path, chat in (("/v1/chat/completions", True), ("/v1/completions", False)):
            app.router.add_post(INTAKE_PATH + path, partial(self.intake_for_data_plane, chat=chat))
        app.on_startup.append(self._start_background)
        app.on_cleanup.append(self._close)
        return app

    def discover_pods(self, kube: Kube, own_pod: str | None = None) -> None:
        """Find endpoints (and peer gateways) by watching the model's pods (in a cluster)
        instead of a static list."""
        self._discovery = PodDiscovery(kube, self.config, self.endpoints, self.peers, own_pod)

    def use_data_plane(self, binary: Path, listen: str, python_url: str) -> None:
        """Serve clients through the compiled data plane at `listen`, this gateway (at
        `python_url`, loopback) deciding behind it (dataplane.py)."""
        self.data_plane = DataPlane(
            binary, listen, python_url, self.config, self.endpoints, self.settings, self.metrics,
            self.peers, self.planner, request_log=self.request_log, holds=self.decode_holds,
        )  # fmt: skip
        self.admission_handlers.behind_data_plane = True
        # This replica's fair queue runs in the data plane: its long prompts wait with no call.
        self.admission.remote = self.data_plane.admission

    async def _start_background(self, _: web.Application) -> None:
        if self.request_log is not None:
            self.request_log.start()
        if self.replica_contract is not None:
            self.replica_contract.start()
        if self.settings.load_scrape_seconds is not None:
            scraper = LoadScraper(
                self.endpoints,
                self.upstream.session,
                self.settings.load_scrape_seconds,
                on_transfers=self.planner.note_transfers,
            )
            self._scrape_task = asyncio.create_task(scraper.run(), name="load-scraper")
        if self._discovery is not None:
            self._discovery_task = asyncio.create_task(self._discovery.run(), name="discovery")
        if self._discovery is not None or self.peers.urls:
            self._peers_task = asyncio.create_task(self.peers.run(), name="peer-admission")
        if self.data_plane is not None:
            await self.data_plane.start(self.upstream.session)

    async def _close(self, _: web.Application) -> None:
        if self.data_plane is not None:
            await self.data_plane.stop()
        for task in (self._scrape_task, self._peers_task):
            if task is not None:
                task.cancel()
        if self.replica_contract is not None:
            self.replica_contract.stop()
        if self.request_log is not None:
            await self.request_log.stop()
        if self._discovery_task is not None:
            self._discovery_task.cancel()
        if self._discovery is not None:
            await self._discovery.kube.close()
        await self.upstream.close()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every other endpoint's failures in the OpenAI shape too (the completions' own path
        is fail()): a wrong API key, an unknown path, anything unexpected."""
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return http_error_response(error)
        except Exception as error:
            if client_went_away(error):
                raise
            request_id = gateway_request_id(request)
            answer = client_error(error, request_id)
            self._log_failure(error, answer, request_id)
            return error_response(answer)

    def _report_check(self, check: ReplicaCheck) -> None:
        """A replica check's verdict changed: logged and, in a cluster, an Event on the pod."""
        replica = f"{check.pool} replica {check.endpoint.label}"
        if check.verdict is Verdict.verified:
            log.info("%s passed its replica check", replica)
        else:
            log.warning("%s: %s (%s)", replica, check.verdict.value, check.reason)
        discovery = self._discovery
        pod = discovery.pods.get(check.endpoint.name or "") if discovery else None
        event = event_of(check, discovery.own_pod if discovery else None)
        if discovery is None or pod is None or event is None:
            return
        task = asyncio.create_task(
            post_event(discovery.kube, {**pod, "apiVersion": "v1", "kind": "Pod"}, *event,
                       reporter=GATEWAY_EVENT_REPORTER)
        )  # fmt: skip
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    # ---- operational endpoints -----------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(self, _: web.Request) -> web.Response:
        try:
            self.endpoints.select(self.planner.needed_pools())
        except NoEndpoints as error:
            return web.json_response({"ready": False, "reason": str(error)}, status=503)
        return web.json_response({"ready": True})

    async def models(self, _: web.Request) -> web.Response:
        """The model, then its LoRA adapters with the model as their parent, as `vllm serve`
        lists them."""
        model = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "pdserve"}
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
             "parent": self.config.model}
            for name in self.config.adapters
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        queue = self.admission.state()
        self.metrics.prefill_queue.set(queue.queued)
        self.metrics.prefill_oldest_wait.set(queue.oldest_wait)
        self.metrics.prefill_aged.set(queue.aged)
        self.metrics.admission_leader_errors.set(self.peers.leader_errors)
        # Read live: what the operator's transport monitor reports as GatewayFallback.
        self.metrics.pd_degraded.set(int(self.policy.health.degraded))
        self.metrics.pd_recent_failures.set(len(self.policy.health.failures))
        self.metrics.decode_held_blocks.clear()
        if self.config.kv_transfer.bidirectional:
            for decode in self.endpoints.pools.get("decode", []):
                held = self.decode_holds.total_held(decode.url)
                self.metrics.decode_held_blocks.labels(decode.label).set(held)
        if self.replica_contract is not None:
            # Rebuilt each scrape: replicas that left take their series with them.
            self.metrics.replica_checks.clear()
            for pool, replicas in self.replica_contract.status().items():
                for replica, entry in replicas.items():
                    self.metrics.replica_checks.labels(pool, replica, entry["verdict"]).set(1)
        return web.Response(
            body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    def admission_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "leader": self.peers.leader() or "self",
            "peers": sorted(self.peers.live),
        }
        if self.data_plane is not None:
            # Where the data plane's long prompts take their slots (as of its last /stats).
            here = self.data_plane.admission.admits_here
            status["dataPlaneAdmits"] = "here" if here else "through the leader"
        return status

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
                "admission": self.admission_status(),
                "kvCompat": self.kv_compat_status(),
                "replicaCheck": (
                    self.replica_contract.status() if self.replica_contract else "Off"
                ),
                "dataPlane": self.data_plane.status() if self.data_plane else "Off",
            }
        )

    def kv_compat_status(self) -> dict[str, dict[str, str | None]]:
        """Each engine replica's KV-compatibility digest (pod name or URL -> digest), and what
        the routing config expects of each pool: mid-upgrade it shows which pods pair."""
        pools = {"prefill": self.config.pools.prefill, "decode": self.config.pools.decode}
        status: dict[str, dict[str, str | None]] = {
            pool: {e.label: e.kv_compat for e in self.endpoints.pools[pool]} for pool in pools
        }
        status["expected"] = {pool: ref.kv_compat for pool, ref in pools.items() if ref}
        return status

    # ---- completions ---------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=False)

    async def handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        started = time.monotonic() - spent_in_data_plane(request.headers, self.data_plane)
        route = "unknown"
        try:
            data = await self.intake.receive(request)  # before a slot: slow bodies hold none
        except GatewayError as error:
            self.metrics.requests.labels(route, f"error_{error.status}").inc()
            return error_response(error)
        if self._slots.locked():
            self.metrics.requests.labels(route, "rejected").inc()
            return error_response(
                GatewayError(
                    429,
                    f"the gateway is at its limit of {self.settings.max_inflight} requests in "
                    "flight; retry shortly",
                )
            )
        # A request the data plane handed over is in its count of requests in flight already.
        counted = not from_data_plane(request.headers, self.data_plane)
        async with self._slots:
            if counted:
                self.metrics.inflight.inc()
            exchange: Exchange | None = None
            try:
                body = self.intake.read_body(request, data)
                body = self.intake.check_body(body, chat=chat)
                # The engines' request id is the gateway's own: clients' ids may collide.
                request_id = gateway_request_id(request)
                plan = await self.planner.plan()
                exchange = Exchange(
                    request=request,
                    body=body,
                    chat=chat,
                    request_id=request_id,
                    client_request_id=client_request_id(request),
                    selection=plan.selection,
                    pd=plan.pd,
                    started=started,
                    tokens_api=self.config.engine_api == "tokens",
                    headers=self.intake.upstream_headers(request, request_id),
                )
                route = exchange.route
                response = await self.completion_route.serve(exchange)
                route = exchange.route  # Auto mode decides P/D or local inside serve()
                failed = exchange.stream_error  # a stream that ended with an error event
                outcome = "ok" if failed is None else f"error_{failed}"
                self.metrics.requests.labels(route, outcome).inc()
                self.metrics.e2e.labels(route).observe(time.monotonic() - started)
                if self.request_log is not None:
                    self.request_log.record(exchange.log_entry())
                return response
            except asyncio.CancelledError:
                # The client went away (aiohttp cancels the handler; the routes abort the
                # engines' work): no one to answer, but the request is counted and logged.
                self._client_gone(exchange, route)
                raise
            except Exception as error:
                if client_went_away(error):
                    self._client_gone(exchange, route)
                    raise
                return await self.fail(request, exchange, route, error)
            finally:
                if counted:
                    self.metrics.inflight.dec()

    async def intake_for_data_plane(self, request: web.Request, *, chat: bool) -> web.Response:
        """This gateway's intake on a completion its data plane could not prove valid cheaply
        (or read as the engines would: a Content-Encoding, a member given twice): the body as
        this gateway would send it on (decoded, each member once, the model and the max-tokens
        cap filled in), or the client's answer (a 400 naming the parameter, ...). The data plane
        serves the one or answers the other itself; nothing is counted here. To anyone but the
        data plane (its token), the path does not exist."""
        if not from_data_plane(request.headers, self.data_plane):
            raise web.HTTPNotFound()
        try:
            data = await self.intake.receive(request)
            body = self.intake.check_body(self.intake.read_body(request, data), chat=chat)
        except GatewayError as error:
            answer = error_response(error)
        else:
            answer = web.Response(body=dumps(body), content_type="application/json")
        answer.headers[INTAKE_HEADER] = "1"
        return answer

    def _client_gone(self, exchange: Exchange | None, route: str) -> None:
        route = exchange.route if exchange else route
        self.metrics.requests.labels(route, "client_gone").inc()
        if self.request_log is not None and exchange is not None:
            self.request_log.record(exchange.log_entry())

    async def fail(
        self, request: web.Request, exchange: Exchange | None, route: str, error: Exception
    ) -> web.StreamResponse:
        """The one error path of a completion request: whatever it raised answers as an OpenAI
        error (errors.client_error), or, once its stream started, as an error event and
        [DONE] on that stream."""
        request_id = exchange.request_id if exchange else gateway_request_id(request)
        answer = client_error(error, request_id)
        route = exchange.route if exchange else route
        outcome = "no_endpoints" if isinstance(error, NoEndpoints) else f"error_{answer.status}"
        self.metrics.requests.labels(route, outcome).inc()
        self._log_failure(error, answer, request_id)
        writer = exchange.writer if exchange else None
        if writer is None:
            return error_response(answer)
        if not writer.finished:
            with suppress(ConnectionResetError):
                await writer.send(
                    error_body(answer.status, answer.message, answer.kind, answer.param)
                )
                await writer.done()
        return writer.response

    @staticmethod
    def _log_failure(error: Exception, answer: GatewayError, request_id: str | None) -> None:
        """Unexpected failures (500) with their stack, the others (upstream, no endpoints) with
        the addresses the client is not told; the client's own mistakes (4xx) are not logged."""
        extra = {"request_id": request_id}
        if answer.status < 500:
            return
        if answer.kind == "InternalServerError":
            log.error("%s: unexpected failure", request_id, exc_info=error, extra=extra)
        else:
            log.warning("%s: answered %d: %s", request_id, answer.status, error, extra=extra)
