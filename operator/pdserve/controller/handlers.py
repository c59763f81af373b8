"""kopf wiring, kept thin: every event only schedules a level-based reconcile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from pdserve.api import GROUP, PLURAL, VERSION
from pdserve.builders.names import INSTANCE_LABEL
from pdserve.controller.kube import Credentials, Kube
from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings

log = logging.getLogger("pdserve.operator")
MANAGED = {"app.kubernetes.io/managed-by": "pdserve"}


def build_registry(
    credentials: Credentials, operator_settings: OperatorSettings
) -> tuple[kopf.OperatorRegistry, dict[str, Any]]:
    """A registry with pdserve's handlers; the dict holds the live Reconciler once started."""
    registry = kopf.OperatorRegistry()
    state: dict[str, Any] = {}

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(
            server=credentials.server,
            ca_path=credentials.ca_path,
            insecure=credentials.insecure,
            token=credentials.current_token(),
            certificate_path=credentials.cert_file,
            private_key_path=credentials.key_file,
        )

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        reconciler = Reconciler(Kube(credentials), operator_settings)
        state["reconciler"] = reconciler
        state["resync"] = asyncio.create_task(reconciler.resync_forever(), name="resync")

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        task = state.get("resync")
        if task is not None:
            task.cancel()
        reconciler: Reconciler | None = state.get("reconciler")
        if reconciler is not None:
            await reconciler.drain()
            await reconciler.kube.close()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def on_model(type: str, namespace: str | None, name: str, **_: Any) -> None:
        reconciler: Reconciler = state["reconciler"]
        if namespace is None:
            return
        if type == "DELETED":
            reconciler.forget(namespace, name)  # owner references let the GC remove children
        else:
            reconciler.trigger(namespace, name)

    async def on_child(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        owner = labels.get(INSTANCE_LABEL)
        if owner and namespace:
            state["reconciler"].trigger(namespace, owner)

    for group_version, plural in (("apps/v1", "statefulsets"), ("apps/v1", "deployments")):
        kopf.on.event(group_version, plural, labels=MANAGED, registry=registry)(on_child)

    return registry, state
