"""Kubernetes Events (what `kubectl describe` and `kubectl get events` show), built in one place
for every process that posts them: the operator on a DisaggregatedModel, the gateway on a pod."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from pdserve.kube.client import Kube, KubeError

log = logging.getLogger("pdserve.events")


def event_object(
    body: Mapping[str, Any], type_: str, reason: str, message: str, *, reporter: str
) -> dict[str, Any]:
    """A core/v1 Event about `body` (any object with apiVersion, kind and metadata)."""
    meta = body["metadata"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{secrets.token_hex(8)}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": body["apiVersion"], "kind": body["kind"], "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": reporter},
        "reportingComponent": reporter,
        "reportingInstance": reporter,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }  # fmt: skip


async def post_event(
    kube: Kube, body: Mapping[str, Any], type_: str, reason: str, message: str, *, reporter: str
) -> None:
    """Best effort: a lost event must never fail the work that reports it."""
    try:
        await kube.create(event_object(body, type_, reason, message, reporter=reporter))
    except (KubeError, httpx.HTTPError) as error:
        log.warning("could not post event %s: %s", reason, error)
