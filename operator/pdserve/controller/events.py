"""Kubernetes Events on a DisaggregatedModel (what `kubectl describe dm` shows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.controller.reconcile import Event
from pdserve.kube import events
from pdserve.kube.client import Kube

REPORTER = "pdserve-operator"


async def post_event(kube: Kube, body: Mapping[str, Any], event: Event) -> None:
    """Best effort: a lost event must never fail a reconcile."""
    await events.post_event(kube, body, event.type, event.reason, event.message, reporter=REPORTER)
