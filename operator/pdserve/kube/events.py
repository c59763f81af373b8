"""Kubernetes Events (what `kubectl describe` and `kubectl get events` show), built in one place
for every process that posts them: the operator on a DisaggregatedModel, the gateway on a pod."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from pdserve.kube.client import KINDS, Kube, KubeError

log = logging.getLogger("pdserve.events")


EVENT = KINDS[("v1", "Event")]


def event_name(
    body: Mapping[str, Any], type_: str, reason: str, message: str, reporter: str
) -> str:
    """One name per object, type, reason, message and reporter: the same Event told again is
    the same object, its count raised (as client-go's correlator does), not a new one."""
    meta = body["metadata"]
    told = "\0".join((meta["uid"], type_, reason, message[:1024], reporter))
    return f"{meta['name']}.{hashlib.sha256(told.encode()).hexdigest()[:16]}"


def event_object(
    body: Mapping[str, Any], type_: str, reason: str, message: str, *, reporter: str
) -> dict[str, Any]:
    """A core/v1 Event about `body` (any object with apiVersion, kind and metadata)."""
    meta = body["metadata"]
    now = timestamp()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(body, type_, reason, message, reporter),
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
    """Best effort: a lost event must never fail the work that reports it. Told again, the
    Event that exists (until the API server's event TTL removes it) counts one more."""
    event = event_object(body, type_, reason, message, reporter=reporter)
    try:
        try:
            await kube.create(event)
            return
        except KubeError as error:
            if error.status != 409:
                raise
        meta = event["metadata"]
        found = await kube.get(EVENT, meta["namespace"], meta["name"])
        if found is None:  # expired between the two calls
            await kube.create(event)
            return
        await kube.patch_merge(EVENT, meta["namespace"], meta["name"], {
            "count": int(found.get("count") or 1) + 1, "lastTimestamp": timestamp(),
        })  # fmt: skip
    except (KubeError, httpx.HTTPError) as error:
        log.warning("could not post event %s: %s", reason, error)


def timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
