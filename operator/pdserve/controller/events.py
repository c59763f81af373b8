"""Kubernetes Events on a DisaggregatedModel (what `kubectl describe dm` shows)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from pdserve.controller.reconcile import Event
from pdserve.kube.client import Kube, KubeError

log = logging.getLogger("pdserve.events")
REPORTER = "pdserve-operator"


def event_object(body: Mapping[str, Any], type_: str, reason: str, message: str) -> dict[str, Any]:
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
        "source": {"component": REPORTER},
        "reportingComponent": REPORTER,
        "reportingInstance": REPORTER,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }  # fmt: skip


async def post_event(kube: Kube, body: Mapping[str, Any], event: Event) -> None:
    """Best effort: a lost event must never fail a reconcile."""
    try:
        await kube.create(event_object(body, event.type, event.reason, event.message))
    except (KubeError, httpx.HTTPError) as error:
        log.warning("could not post event %s: %s", event.reason, error)
