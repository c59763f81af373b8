"""What a user reads while a model loads, and when it is stuck: whether it serves at all
(Available, apart from Ready, which waits for every replica), what each pod that is not Ready
yet waits on and for how long (image pull, volumes, the engine's model load), and the pods past
spec.progressDeadlineSeconds. Pure functions of the pods and the time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.gateway import RoutingMode
from pdserve.api.status import PoolStatus
from pdserve.builders.leaderworkerset import GROUP_INDEX_LABEL, WORKER_INDEX_LABEL
from pdserve.contract.names import COMPONENT_LABEL, Component

SERVING = {c.value for c in (Component.prefill, Component.decode, Component.render,
                             Component.gateway)}  # fmt: skip
WAITING = {
    "ContainerCreating": "pulling the image or mounting volumes",
    "PodInitializing": "running init containers",
}


def available(dm: DisaggregatedModel, pools: Mapping[str, PoolStatus]) -> tuple[bool, str, str]:
    """Available: a request can be served now, every pool it needs having a ready replica
    (prefill only in routing mode Disaggregated: otherwise decode prefills itself)."""
    needed = ["decode", "gateway"]
    if dm.spec.render.enabled:
        needed.append("render")
    if dm.spec.disaggregated and dm.spec.gateway.routing.mode is RoutingMode.disaggregated:
        needed.append("prefill")
    empty = [pool for pool in needed if pools[pool].ready == 0]
    if empty:
        return False, "NoReadyReplicas", f"no ready replica in {', '.join(empty)}"
    return (
        True,
        "Serving",
        "serving: " + ", ".join(f"{pool} {pools[pool].summary}" for pool in needed),
    )


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def duration(seconds: float) -> str:
    minutes, second = divmod(int(seconds), 60)
    return f"{minutes}m{second:02d}s" if minutes else f"{second}s"


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))  # fmt: skip


def _serving_pods(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods of the serving pools that are not Ready and not on their way out."""
    return [
        p for p in pods
        if p["metadata"].get("labels", {}).get(COMPONENT_LABEL) in SERVING
        and not p["metadata"].get("deletionTimestamp") and not _ready(p)
    ]  # fmt: skip


def waits_on(pod: Mapping[str, Any], now: datetime) -> str:
    """'decode pod qwen-decode-0: starting (loading the model) for 3m12s, 1 restart'."""
    meta, status = pod["metadata"], pod.get("status", {})
    pool = meta.get("labels", {}).get(COMPONENT_LABEL, "pod")
    created = parse_time(meta.get("creationTimestamp"))
    since = created
    if not status.get("containerStatuses"):
        what = "waiting to be scheduled" if not pod.get("spec", {}).get("nodeName") else (
            "waiting for its containers")  # fmt: skip
    else:
        [first, *_] = status["containerStatuses"]
        state = first.get("state", {})
        restarts = sum(int(c.get("restartCount", 0)) for c in status["containerStatuses"])
        if "running" in state:
            since = parse_time(state["running"].get("startedAt")) or created
            what = "starting (loading the model)" if pool in ("prefill", "decode") else "starting"
        elif "waiting" in state:
            reason = state["waiting"].get("reason", "Waiting")
            what = f"{WAITING.get(reason, reason)} ({reason})" if reason in WAITING else reason
        else:
            what = "its container stopped"
        if restarts:
            what += f", {restarts} restart{'s' if restarts > 1 else ''}"
    took = f" for {duration((now - since).total_seconds())}" if since is not None else ""
    return f"{pool} pod {meta['name']}{group_member(pod)}: {what}{took}"


def group_member(pod: Mapping[str, Any]) -> str:
    """' (group 1, worker 1: DP ranks 2-3)' for a pod of a LeaderWorkerSet group, from its
    labels and its vLLM line (--data-parallel-size over --nnodes ranks per pod); '' otherwise.
    One rank not up stalls its whole group, so the user is told which."""
    labels = pod["metadata"].get("labels", {})
    group, worker = labels.get(GROUP_INDEX_LABEL), labels.get(WORKER_INDEX_LABEL)
    if group is None or worker is None:
        return ""
    containers = pod.get("spec", {}).get("containers") or [{}]
    args = list(containers[0].get("args", []))
    try:
        ranks = int(args[args.index("--data-parallel-size") + 1])
        nodes = int(args[args.index("--nnodes") + 1])
        first = int(worker) * (ranks // nodes)
    except (ValueError, IndexError):
        return f" (group {group}, worker {worker})"
    return f" (group {group}, worker {worker}: DP ranks {first}-{first + ranks // nodes - 1})"


def load_progress(pods: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    return sorted(waits_on(p, now) for p in _serving_pods(pods))


def past_deadline(
    pods: Sequence[Mapping[str, Any]], now: datetime, deadline_seconds: int
) -> list[str]:
    """Pods not Ready `deadline_seconds` after they were created, with what they wait on."""
    late = []
    for pod in _serving_pods(pods):
        created = parse_time(pod["metadata"].get("creationTimestamp"))
        if created is not None and (now - created).total_seconds() > deadline_seconds:
            late.append(waits_on(pod, now))
    return sorted(late)
