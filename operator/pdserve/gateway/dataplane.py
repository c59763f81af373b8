"""`pdserve gateway --data-plane`: the compiled data plane (pdserve/dataplane, Go) in front of
this gateway. It takes the clients' port; this gateway listens on loopback behind it, decides
(fastpath.routing_table, pushed whenever it changes), and serves whatever the data plane hands
it. What the data plane served is folded into this gateway's /metrics.

The data plane is this process's child: it stops when its standard input closes (this gateway
died), and this gateway stops it after its own drain."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import secrets
import signal
from collections.abc import Awaitable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.dataplane_admission import AdmissionChannel
from pdserve.gateway.endpoints import Endpoints
from pdserve.gateway.fastpath import (
    UNAVAILABLE,
    admission_table,
    route_of,
    routing_table,
    same_table,
    served_route,
)
from pdserve.gateway.held_kv import DecodeHolds
from pdserve.gateway.metrics import COUNTS, LATENCY, GatewayMetrics
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.planner import PD_FAILURES, RoutePlanner
from pdserve.gateway.request_log import RequestLog
from pdserve.gateway.settings import GatewaySettings
from pdserve.gobuild import built

log = logging.getLogger("pdserve.gateway")
SOURCE = Path(__file__).resolve().parents[1] / "dataplane"
BINARY = "dataplane"
STARTUP_SECONDS = 10.0
ELAPSED_HEADER = "X-PDServe-Elapsed-Ms"
"""On a completion the data plane hands over: the milliseconds it already spent on it."""
TOKEN_HEADER = "X-PDServe-Dataplane-Token"
"""Beside ELAPSED_HEADER: the data plane's token, which only this gateway's own data plane has
(it deletes clients' copies of both headers)."""


class DataPlaneError(RuntimeError):
    """The data plane could not start: the message says why and what to pass instead."""


INTAKE_PATH = "/_pdserve/dataplane/intake"
"""Where the data plane asks this gateway's intake about a completion it could not prove valid
cheaply (the completion's own path follows: dataplane/intake.go); for its token alone."""
INTAKE_HEADER = "X-PDServe-Intake"
"""On each of the intake's answers: told apart from a path this gateway does not serve."""


def from_data_plane(headers: Mapping[str, str], data_plane: DataPlane | None) -> bool:
    """The request carries this gateway's data plane's token (which no client can send: the
    data plane deletes clients' copies of the header)."""
    if data_plane is None:
        return False
    token = headers.get(TOKEN_HEADER, "")
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), data_plane.token.encode())


def spent_in_data_plane(headers: Mapping[str, str], data_plane: DataPlane | None) -> float:
    """The seconds this gateway's data plane already spent on a request it handed over (its
    fast path began it, then gave up), so that the request timeout runs from the client's first
    byte instead of starting again; 0 for any other request. Honoured only with the data
    plane's token: a client cannot move its own deadline."""
    if ELAPSED_HEADER not in headers or not from_data_plane(headers, data_plane):
        return 0.0
    try:
        spent = float(headers[ELAPSED_HEADER]) / 1000
    except ValueError:
        return 0.0
    return spent if math.isfinite(spent) and spent > 0 else 0.0


def build_binary(go: str | None = None) -> Path:
    """The data plane built from this package's Go source (cached by source digest)."""
    return built(SOURCE, ["."], "dataplane", go) / BINARY


class DataPlane:
    def __init__(
        self,
        binary: Path,
        listen: str,
        python_url: str,
        config: GatewayConfig,
        endpoints: Endpoints,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        peers: PeerAdmission,
        planner: RoutePlanner,
        *,
        request_log: RequestLog | None = None,
        holds: DecodeHolds | None = None,
        push_seconds: float = 0.25,
        stats_seconds: float = 1.0,
    ) -> None:
        self.binary, self.listen, self.python_url = binary, listen, python_url
        self.config, self.endpoints, self.settings = config, endpoints, settings
        self.metrics, self.peers, self.planner = metrics, peers, planner
        self.request_log = request_log  # the data plane writes its entries to its file too
        # Bidirectional KV: what decode holds for either process's requests counts in both.
        self.holds = holds
        self.auto_seq = 0  # the last of the data plane's Auto observations folded
        self.push_seconds, self.stats_seconds = push_seconds, stats_seconds
        self.process: asyncio.subprocess.Process | None = None
        self.control: str | None = None
        # Where clients connect, as the data plane bound it (`listen` may name port 0).
        self.address: str | None = None
        self.pushed: dict[str, Any] | None = None
        self.version = 0
        self.seen: dict[str, float] = {}
        self.render_pods: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # What the data plane presents when it asks this gateway for long prompts' slots and
        # when it hands a request over, and what this gateway presents on every control call.
        self.token = secrets.token_hex(16)
        self.admission = AdmissionChannel(
            peers, self.token, hold_seconds=settings.first_byte_timeout
        )
        self.stopping = False

    async def start(self, session: aiohttp.ClientSession) -> None:
        argv = [
            str(self.binary), "-listen", self.listen, "-python", self.python_url,
            "-control", "127.0.0.1:0", "-exit-with-stdin",
            "-admission", await self.admission.start(),
            "-max-body-bytes", str(self.settings.max_body_bytes),
            "-max-inflight", str(self.settings.max_inflight),
            "-connect-timeout-seconds", str(self.settings.connect_timeout),
            "-first-byte-timeout-seconds", str(self.settings.first_byte_timeout),
            "-idle-timeout-seconds", str(self.settings.idle_timeout),
            "-request-timeout-seconds", str(self.settings.request_timeout),
            "-render-timeout-seconds", str(self.settings.render_timeout),
            "-body-timeout-seconds", str(self.settings.body_timeout),
            "-keepalive-timeout-seconds", str(self.settings.keepalive_timeout),
            "-latency-buckets", ",".join(map(str, LATENCY)),
            "-count-buckets", ",".join(map(str, COUNTS)),
        ]  # fmt: skip
        if self.settings.api_keys:
            argv.append("-require-api-keys")  # a table without the keys' digests is refused
        inherited: tuple[int, ...] = ()
        if self.request_log is not None and self.request_log.fd is not None:
            inherited = (self.request_log.fd,)
            argv += ["-request-log-fd", str(self.request_log.fd)]
        try:
            self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=inherited,
                env={**os.environ, "PDSERVE_DATAPLANE_TOKEN": self.token},
            )
        except OSError as error:
            raise DataPlaneError(f"--data-plane {self.binary}: {error.strerror or error}") from None
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), STARTUP_SECONDS)
            bound = json.loads(line)
            self.control, self.address = "http://" + bound["control"], bound["listen"]
        except (TimeoutError, ValueError, KeyError):
            code = self.process.returncode
            raise DataPlaneError(
                f"--data-plane {self.binary} did not start within {STARTUP_SECONDS:g} s "
                f"(exit status {code}; its error is above): is the address {self.listen} free?"
            ) from None
        log.info("data plane at %s serves route %s", self.listen, route_of(self.config))
        await self.push(session)
        self.admission.refresh = partial(self.queue_state, session)
        await self.queue_state(session)  # where its long prompts wait, known from the start
        self._tasks = [
            asyncio.create_task(self.run(session), name="data-plane"),
            asyncio.create_task(self.watch(), name="data-plane-exit"),
        ]

    async def watch(self) -> None:
        """The data plane holds the clients' port: without it this gateway serves no one, so it
        stops too (the kubelet restarts the container)."""
        assert self.process is not None
        code = await self.process.wait()
        if not self.stopping:
            log.error("the data plane exited (status %s): stopping the gateway", code)
            os.kill(os.getpid(), signal.SIGINT)  # SIGINT: no drain, nobody can reach us

    async def push(self, session: aiohttp.ClientSession) -> None:
        """The routing table, when it changed since the last push."""
        prefill = self.endpoints.pools.get("prefill", [])
        admission = admission_table(
            self.settings,
            leader_elsewhere=self.peers.leader() is not None,
            others={e.url: self.peers.total(e.url) for e in prefill},
        )
        table = routing_table(
            self.config, self.endpoints, self.settings, self.version + 1, admission,
            policy=self.planner.policy, peers_queued=self.peers.queued(),
            holds=self.holds, gateway_replicas=self.peers.replicas(),
        )  # fmt: skip
        if same_table(self.pushed, table):
            return
        async with session.put(
            f"{self.control}/table", json=table, headers=self.control_headers
        ) as answer:
            if answer.status != 204:
                # A table the data plane refuses is a bug here: keep the last one, say why.
                log.error("data plane refused the routing table: %s", await answer.text())
                return
        self.version += 1
        self.pushed = table

    @property
    def control_headers(self) -> dict[str, str]:
        """The control API answers only calls with the token the data plane was started with."""
        return {"Authorization": f"Bearer {self.token}"}

    async def queue_state(self, session: aiohttp.ClientSession) -> None:
        """The data plane's fair queue as it is now (for `GET /admission`)."""
        async with session.get(f"{self.control}/stats", headers=self.control_headers) as answer:
            self.admission.fold_state(await answer.json())

    async def fold_stats(self, session: aiohttp.ClientSession) -> None:
        """The data plane's counters since the last poll, into this gateway's metrics."""
        async with session.get(
            f"{self.control}/stats",
            params={"after": str(self.auto_seq)},  # the observations not folded yet
            headers=self.control_headers,
        ) as answer:
            stats = await answer.json()
        self.admission.fold_state(stats)
        # Render servers by pod, as this gateway labels its own calls (kept for one that left).
        self.render_pods |= {e.url: e.label for e in self.endpoints.pools.get("render", [])}
        self.metrics.fold_data_plane(stats.get("metrics") or {}, self.render_pods)
        self.fold_engines(stats.get("engineInflight") or {}, stats.get("stepSeconds") or {})
        self.metrics.fold_inflight(float(stats.get("inflight", 0)))
        # By route as the data plane names them: the labels of dataplane_requests_total.
        routes = stats.get("routes") or {}
        totals = {f"route:{route}": float(count) for route, count in routes.items()}
        totals["route:unreadable_body"] = float(stats.get("unreadable", 0))
        totals |= {f"fallback:{k}": float(v) for k, v in (stats.get("fallbacks") or {}).items()}
        # Served by local prefill on decode: this gateway's own fallbacks, by its reasons.
        local = stats.get("localPrefill") or {}
        totals |= {f"local_prefill:{k}": float(v) for k, v in local.items()}
        # Failed upstream calls another may follow, by "stage/reason": this gateway's retries.
        totals |= {f"retry:{k}": float(v) for k, v in (stats.get("retries") or {}).items()}
        totals["abort:"] = float(stats.get("aborts", 0))  # posted to tokens engines
        # Long prompts it admitted itself, the leader's slot not to be had: the leader errors.
        totals["leader_error:"] = float(stats.get("leaderErrors", 0))
        totals |= {f"runtime:{k}": float(v) for k, v in (stats.get("runtime") or {}).items()}
        bidirectional = stats.get("bidirectional") or {}
        reuse = bidirectional.get("reuse") or {}
        totals |= {f"reuse:{k}": float(v) for k, v in reuse.items()}
        totals["reused_tokens:"] = float(bidirectional.get("reusedTokens", 0))
        if self.holds is not None:
            self.holds.elsewhere = {
                url: int(n) for url, n in (bidirectional.get("held") or {}).items()
            }
        auto = stats.get("auto") or {}
        totals |= {f"auto:{k}": float(v) for k, v in (auto.get("decisions") or {}).items()}
        totals["learning:started"] = float(auto.get("learningStarts", 0))
        self.learn(auto.get("observations") or [])
        for key, total in totals.items():
            delta = total - self.seen.get(key, 0.0)
            if delta <= 0:
                continue
            kind, _, name = key.partition(":")
            if kind == "runtime":
                if name in self.metrics.dataplane_runtime:
                    self.metrics.dataplane_runtime[name].inc(delta)
            elif kind == "route":
                self.metrics.dataplane_requests.labels(name).inc(delta)
            elif kind == "local_prefill":
                self.metrics.fallbacks.labels(name).inc(delta)
                if name in PD_FAILURES:
                    for _ in range(int(delta)):
                        self.planner.policy.health.failure()
                    self.metrics.pd_degraded.set(int(self.planner.policy.health.degraded))
            elif kind == "reuse":
                self.metrics.bidirectional.labels(name).inc(delta)
            elif kind == "reused_tokens":
                self.metrics.bidirectional_tokens.inc(delta)
            elif kind == "abort":
                self.metrics.aborts.inc(delta)
            elif kind == "leader_error":
                self.peers.leader_errors += int(delta)
            elif kind == "retry":
                stage, _, reason = name.partition("/")
                self.metrics.retries.labels(stage, reason).inc(delta)
            elif kind == "auto":
                self.metrics.auto_decisions.labels(name).inc(delta)
            elif kind == "learning":
                self.planner.policy.health.start_learning()  # the data plane sent one
            else:
                self.metrics.dataplane_fallbacks.labels(name).inc(delta)
            self.seen[key] = total

    def fold_engines(self, inflight: Mapping[str, Any], steps: Mapping[str, Any]) -> None:
        """Per engine, what the data plane reports as it is now: its render calls in flight
        (into `render_inflight`), and the step time its streams measured, which Auto mode's
        decisions here read too."""
        self.metrics.fold_render_inflight(inflight, self.render_pods)
        for endpoint in self.endpoints.pools.get("decode", []):
            if (seconds := steps.get(endpoint.key)) is not None:
                endpoint.steps.seconds = float(seconds)

    def learn(self, observations: Iterable[Mapping[str, Any]]) -> None:
        """What the data plane's Auto-mode requests taught, each folded once (by `seq`) into
        Auto mode's model as the Python gateway's own requests fold theirs (planner.py)."""
        policy, ttft = self.planner.policy, self.planner.ttft_budget()
        for each in observations:
            if each["seq"] <= self.auto_seq:
                continue
            self.auto_seq = each["seq"]
            kind, seconds, tokens = each["kind"], float(each.get("seconds", 0)), each["tokens"]
            if kind == "handoff":
                self.metrics.stage.labels("kv_handoff").observe(seconds)
                policy.health.observe(seconds, tokens, ttft, each.get("prefill"))
            elif kind == "prefill":
                policy.health.observe_prefill(seconds, tokens)
            elif kind == "pdPrompt":
                policy.health.note_pd_prompt(tokens)
            elif kind == "output":
                policy.observe_output(tokens)
        self.metrics.pd_degraded.set(int(policy.health.degraded))

    def awaiting_first_handoff(self) -> bool:
        """Routing mode Auto holds P/D back until a first handoff is measured, and the data
        plane measures it: what it reports is folded at every push until then, not a second
        late."""
        policy = self.planner.policy
        return (
            self.config.routing.mode == "Auto"
            and policy.health.learning(self.planner.ttft_budget()) is not None
        )

    async def run(self, session: aiohttp.ClientSession) -> None:
        since_stats = 0.0
        while True:
            await asyncio.sleep(self.push_seconds)
            since_stats += self.push_seconds
            # Stats first: what the data plane learned goes out in the same pass's table.
            if since_stats >= self.stats_seconds or self.awaiting_first_handoff():
                since_stats = 0.0
                await self.survive("stats poll", self.fold_stats(session))
            await self.survive("table push", self.push(session))

    @staticmethod
    async def survive(call: str, work: Awaitable[None]) -> None:
        """This loop is what keeps the data plane's table current: it must outlive a defect in
        one call, never end with it and leave a stale table serving."""
        try:
            await work
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("data plane %s failed: %s", call, error)
        except Exception:
            log.exception("data plane %s failed", call)

    def status(self) -> dict[str, Any]:
        """What `/status` shows of the data plane: the route of the table it serves by, the
        table's version and why, while it holds requests for want of engines
        (`unavailableBecause`) or prefills them on decode (`localPrefillBecause`)."""
        pushed = (self.pushed or {}).get("models", {}).get(self.config.model, {})
        shown: dict[str, Any] = {"route": pushed.get("route"), "tableVersion": self.version}
        served = served_route(self.config, self.endpoints)
        if served.why is not None:
            key = "unavailableBecause" if served.route == UNAVAILABLE else "localPrefillBecause"
            shown[key] = served.why
        return shown

    async def drain(self) -> None:
        """This gateway drains: the data plane closes each connection after its answer too."""
        if self.control is None:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{self.control}/drain", headers=self.control_headers),
            ):
                pass

    async def stop(self) -> None:
        """Stop accepting and let the data plane finish what it holds (this gateway still
        answers its intake); idempotent. The tables keep coming until it has exited: a
        request it holds for engines (mid-rollout, the old pod's last ones) is served by the
        next table that has them, as this gateway's own waiting requests are."""
        self.stopping = True
        try:
            await self._stop_process()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.admission.stop()  # after: the data plane's prefills held their slots

    async def _stop_process(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 65)
        except TimeoutError:
            process.kill()
            with contextlib.suppress(ProcessLookupError):
                await process.wait()
