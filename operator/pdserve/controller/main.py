"""`pdserve operator`: run the kopf operator with pdserve's handlers and settings."""

from __future__ import annotations

import asyncio
import logging
import signal

import kopf

from pdserve.controller.handlers import build_registry
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.credentials import load_credentials
from pdserve.logsetup import configure_logging


async def run_operator(settings: OperatorSettings) -> None:
    credentials = load_credentials(settings.kubeconfig)
    registry, _ = build_registry(credentials, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await kopf.operator(
        registry=registry,
        # No KopfPeering: several replicas all watch and serve the webhook; pdserve's own Lease
        # (--leader-election) decides which one reconciles.
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=settings.liveness_endpoint,
        stop_flag=stop,
    )


def main(settings: OperatorSettings) -> int:
    configure_logging(settings.log_format, settings.log_level)
    logging.getLogger("pdserve.operator").info(
        "starting: namespaces=%s resync=%ss network-policies=%s leader-election=%s",
        list(settings.namespaces) or "all", settings.resync_seconds,
        "on" if settings.network_policies is not None else "off",
        settings.leader_election.identity if settings.leader_election else "off",
    )  # fmt: skip
    asyncio.run(run_operator(settings))
    return 0
