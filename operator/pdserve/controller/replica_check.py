"""The gateways' replica checks as the model's ContractVerified condition: each pod's latest
verdict Event from a gateway (gateway/replica_contract.py), the pods kept out of routing named
with what differs. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.contract.names import (
    COMPONENT_LABEL,
    REPLICA_MISMATCH_REASON,
    REPLICA_VERIFIED_REASON,
)

VERDICTS = (REPLICA_MISMATCH_REASON, REPLICA_VERIFIED_REASON)


def _when(event: Mapping[str, Any]) -> tuple[str, int]:
    """Events in the order they happened: their last time (seconds), then the server's write
    order within one second."""
    version = str(event.get("metadata", {}).get("resourceVersion", "0"))
    stamp = event.get("lastTimestamp") or event.get("eventTime") or ""
    return str(stamp), int(version) if version.isdigit() else 0


def replica_mismatches(
    pods: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Pods whose latest verdict Event says a gateway keeps them out of routing, and why."""
    names = {
        pod["metadata"].get("uid"): (
            pod["metadata"]["name"],
            pod["metadata"].get("labels", {}).get(COMPONENT_LABEL, "pod"),
        )
        for pod in pods
    }
    latest: dict[str, Mapping[str, Any]] = {}
    for event in events:
        uid = event.get("involvedObject", {}).get("uid")
        if uid not in names or event.get("reason") not in VERDICTS:
            continue  # a pod that is gone, or another kind of event
        if uid not in latest or _when(event) > _when(latest[uid]):
            latest[uid] = event
    return sorted(
        f"{names[uid][1]} pod {names[uid][0]}: {event.get('message', '')}"
        for uid, event in latest.items()
        if event.get("reason") == REPLICA_MISMATCH_REASON
    )


def contract_condition(mismatches: list[str] | None) -> tuple[bool | None, str, str]:
    """ContractVerified: (status, reason, message); None: the replica check is off."""
    if mismatches is None:
        return None, "CheckOff", "spec.gateway.replicaCheck is Off: replicas are not checked"
    if mismatches:
        return False, "ReplicaMismatch", "; ".join(mismatches)
    return True, "NoMismatch", "no gateway keeps a replica out of routing"
