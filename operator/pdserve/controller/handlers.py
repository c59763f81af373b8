"""kopf wiring, kept thin: start-up, shutdown, the webhook. The Reconciler's own watches (its
cache of the models and their children) schedule the level-based passes; kopf watches nothing,
since its per-event processing cost more than the passes. With leader election every replica
serves the webhook and keeps the cache; only the Lease holder's Reconciler acts on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.api import GROUP, PLURAL, VERSION, SpecError, parse_stored
from pdserve.api.advice import admission_warnings
from pdserve.controller.leader import LeaderElector
from pdserve.controller.pod_security import pod_security_refusal
from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings
from pdserve.controller.webhook_cert import serve_own_certificate
from pdserve.kube.client import Kube
from pdserve.kube.credentials import Credentials, LoginTokens

log = logging.getLogger("pdserve.operator")
WEBHOOK_CONFIGURATION = "validate.pdserve.io"


async def serve_metrics(registry: CollectorRegistry, port: int) -> web.AppRunner:
    """The operator's /metrics (its scaling decisions), on all interfaces."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()  # scraped by Prometheus
    return runner


@dataclass
class Running:
    """What the handlers own while the operator runs: the Reconciler (it holds the loops and
    all per-model state), the leader elector and its loop, and the /metrics server."""

    reconciler: Reconciler | None = None
    metrics: web.AppRunner | None = None
    elector: LeaderElector | None = None
    election: asyncio.Task[None] | None = None
    # The webhook's own client while the startup handler has not made the Reconciler's: kopf may
    # serve admission requests first, and a Pod Security judgement skipped then would admit
    # what the namespace refuses.
    webhook_kube: Kube | None = None

    def started(self) -> Reconciler:
        if self.reconciler is None:
            raise RuntimeError("an event before the operator's startup handler ran")
        return self.reconciler


async def shut_down(running: Running) -> None:
    """Stop reconciling, then hand the Lease over: a leader stops its passes at once (the next
    leader repeats any of them harmlessly) and releases the Lease, so that a rolling restart
    hands over within the other replica's poll period rather than a lease duration."""
    if running.election is not None:
        running.election.cancel()
        await asyncio.gather(running.election, return_exceptions=True)
    reconciler = running.reconciler
    if reconciler is not None:
        if running.elector is not None:
            reconciler.step_down()
        else:
            reconciler.stop_loops()
    if running.metrics is not None:
        await running.metrics.cleanup()
    if reconciler is not None:
        await reconciler.drain()
    if running.elector is not None:
        await running.elector.release()
    if reconciler is not None:
        await reconciler.close()
    if running.webhook_kube is not None:
        await running.webhook_kube.close()


def build_registry(
    credentials: Credentials, operator_settings: OperatorSettings
) -> tuple[kopf.OperatorRegistry, Running]:
    """A registry with pdserve's handlers, and what they hold once started."""
    registry = kopf.OperatorRegistry()
    running = Running()

    logins = LoginTokens(credentials)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # kopf calls it again once the token it got was refused or reached its expiration:
        # an exec plugin's token is then a new one.
        token, expiration = logins.next()
        return kopf.ConnectionInfo(
            server=credentials.server,
            ca_path=credentials.ca_path,
            insecure=credentials.insecure,
            token=token,
            certificate_path=credentials.cert_file,
            private_key_path=credentials.key_file,
            expiration=expiration,
        )

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        hook = operator_settings.webhook
        kube = Kube(credentials)
        if hook is not None and hook.cert_secret is not None:
            # The settings insist on the namespace with --webhook-cert-secret.
            assert operator_settings.operator_namespace is not None
            await serve_own_certificate(kube, operator_settings.operator_namespace, hook)
        if hook is not None:
            settings.admission.server = kopf.WebhookServer(
                addr=hook.listen, port=hook.port, host=hook.host, certfile=hook.cert_file,
                pkeyfile=hook.key_file, cafile=hook.ca_file,
            )  # fmt: skip
            if hook.manage:
                settings.admission.managed = WEBHOOK_CONFIGURATION
        election = operator_settings.leader_election
        reconciler = running.reconciler = Reconciler(
            kube, operator_settings, leading=election is None, watch=True
        )
        reconciler.start_watching()
        metrics = reconciler.registry
        if election is None:
            reconciler.start_loops()
        else:
            if operator_settings.operator_namespace is None:  # the settings insist on it
                raise RuntimeError("leader election needs the operator's namespace")
            elector = running.elector = LeaderElector(
                kube, operator_settings.operator_namespace, election.identity,
                lease_seconds=election.lease_seconds, on_lead=reconciler.lead,
                on_lose=reconciler.step_down, registry=metrics,
            )  # fmt: skip
            running.election = asyncio.create_task(elector.run(), name="leader election")
        if operator_settings.metrics_port is not None:
            running.metrics = await serve_metrics(metrics, operator_settings.metrics_port)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await shut_down(running)

    def webhook_kube() -> Kube:
        if running.reconciler is not None:
            return running.reconciler.kube
        if running.webhook_kube is None:
            running.webhook_kube = Kube(credentials)
        return running.webhook_kube

    if operator_settings.webhook is not None:
        # kopf refuses to start with admission handlers but no webhook server.
        @kopf.on.validate(GROUP, VERSION, PLURAL, id="spec", operations=["CREATE", "UPDATE"],
                          registry=registry)  # fmt: skip
        async def validate(body: Mapping[str, Any], warnings: list[str], **_: Any) -> None:
            """Reject at apply time what the CRD schema cannot express (parity flags in extraArgs,
            names too long for child objects, ...), naming every field, and a spec whose pods
            the namespace's Pod Security level would refuse; fields of a newer CRD are admitted
            with a warning (kubectl prints it)."""
            try:
                dm, unknown = parse_stored(dict(body))
            except SpecError as error:
                raise kopf.AdmissionError("; ".join(error.problems), code=422) from None
            warnings.extend(unknown)
            warnings.extend(admission_warnings(dm.spec))
            refusal = await pod_security_refusal(webhook_kube(), dm)
            if refusal is not None:
                raise kopf.AdmissionError(refusal, code=422)

    return registry, running
