"""One level-based reconcile of one DisaggregatedModel: read, build, apply what differs, prune,
write status only when it changed. Running it twice on an unchanged world writes nothing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pdserve.api import (
    API_VERSION,
    KIND,
    DisaggregatedModel,
    SpecError,
    parse_stored,
)
from pdserve.api.advice import admission_warnings
from pdserve.api.autoscaling import RenderAutoscaler
from pdserve.api.images import DEFAULT_GATEWAY_IMAGE
from pdserve.api.status import DisaggregatedModelStatus
from pdserve.builders import (
    KIND_ORDER,
    Component,
    NetworkPolicyOptions,
    build_all,
    content_digest,
    object_key,
)
from pdserve.builders.parity import parity_hash
from pdserve.builders.preflight import preflight
from pdserve.contract.names import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    FIELD_MANAGER,
    GATEWAY_CONTAINER_PORT,
    GATEWAY_EVENT_REPORTER,
    KV_TRANSPORT_ANNOTATION,
    children_selector,
    peer_key_secret_name,
)
from pdserve.controller.autoscale.loop import Autoscaler
from pdserve.controller.autoscale.plans import live_plan
from pdserve.controller.cache import ClusterCache
from pdserve.controller.children import (
    NETWORK_POLICY,
    WRITE_ONLY_KINDS,
    ChildKey,
    describe,
    key_of,
    list_children,
    owned,
)
from pdserve.controller.diff import is_current, merge_patch
from pdserve.controller.drift import parity_drift
from pdserve.controller.health import HealthVerdict, TransportMonitor, transfer_budget_seconds
from pdserve.controller.peer_key import SECRET, PeerMaster, had_peer_key, peer_key_for
from pdserve.controller.pod_security import pod_security_refusal
from pdserve.controller.replica_check import replica_mismatches
from pdserve.controller.rollout import engine_rollout, rollout_steps
from pdserve.controller.status import (
    Observation,
    component_pods,
    compute_status,
    engine_pods,
)
from pdserve.controller.transport import (
    JOB_UID_LABEL,
    node_pairs,
    pair_verdicts,
    pod_annotation_patches,
    probe_jobs_to_rerun,
    slice_verdict,
)
from pdserve.kube.client import KINDS, Kube, KubeError, kind_of

log = logging.getLogger("pdserve.reconcile")

DM_KIND = KINDS[(API_VERSION, KIND)]
SCALED_OBJECT = KINDS[("keda.sh/v1alpha1", "ScaledObject")]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
POD = KINDS[("v1", "Pod")]
EVENT = KINDS[("v1", "Event")]
JOB = KINDS[("batch/v1", "Job")]
LEADER_WORKER_SET = KINDS[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")]
PARITY_DRIFT = "ParityDrift"  # the Event's reason; the operator's metrics count them


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Outcome:
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    status_written: bool = False
    problems: list[str] = field(default_factory=list)
    status: DisaggregatedModelStatus | None = None
    events: list[Event] = field(default_factory=list)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))


WORKLOAD_KINDS = ("StatefulSet", "LeaderWorkerSet", "Deployment")


async def missing_apis(kube: Kube, dm: DisaggregatedModel) -> list[str]:
    """What the model needs that the cluster does not serve: the LeaderWorkerSet API for a
    replica spanning nodes."""
    spanning = [name for name, pool in dm.spec.engine_pools() if pool.multi_node]
    if not spanning or await kube.serves(LEADER_WORKER_SET):
        return []
    fields = " and ".join(f"spec.{name}.nodesPerReplica" for name in spanning)
    return [
        f"{fields} above 1 runs each replica as a LeaderWorkerSet group, but this cluster does "
        f"not serve {LEADER_WORKER_SET.api_version} {LEADER_WORKER_SET.kind}: install the "
        "LeaderWorkerSet controller (v0.7.0 or later, https://lws.sigs.k8s.io), or set "
        "nodesPerReplica 1"
    ]


def apply_waves(desired: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """`desired` (in apply order) in three waves applied one after another, each at once:
    what pods need (accounts, RBAC, policies, Secrets, ConfigMaps, Services), the workloads,
    then what points at them (autoscalers, disruption budgets, preflight Jobs)."""
    waves: list[list[Mapping[str, Any]]] = [[], [], []]
    first_workload = min(KIND_ORDER.index(kind) for kind in WORKLOAD_KINDS)
    for obj in desired:
        kind = obj["kind"]
        wave = 1 if kind in WORKLOAD_KINDS else 0 if KIND_ORDER.index(kind) < first_workload else 2
        waves[wave].append(obj)
    return [wave for wave in waves if wave]


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def chat_template_digest(kube: Kube, dm: DisaggregatedModel) -> tuple[str | None, list[str]]:
    ref = dm.spec.serving.chat_template
    if ref is None:
        return None, []
    config_map = await kube.get(CONFIGMAP, dm.namespace, ref.name)
    if config_map is None:
        return None, [
            f"spec.serving.chatTemplate: ConfigMap {ref.name} not found in {dm.namespace}"
        ]
    text = config_map.get("data", {}).get(ref.key)
    if text is None:
        return None, [f"spec.serving.chatTemplate: ConfigMap {ref.name} has no key {ref.key!r}"]
    return content_digest(text), []


def previous_status(body: Mapping[str, Any]) -> DisaggregatedModelStatus | None:
    try:
        return DisaggregatedModelStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return None  # a status written by something else: recompute from scratch


async def write_status(
    kube: Kube, body: Mapping[str, Any], status: DisaggregatedModelStatus,
    cache: ClusterCache | None = None,
) -> bool:  # fmt: skip
    old = body.get("status") or {}
    new = status.to_json()
    if old == new:
        return False
    meta = body["metadata"]
    patch = merge_patch(old, new)
    # What changed, for whoever wonders why a settled model's status was written.
    log.debug("%s/%s: status patch %s", meta["namespace"], meta["name"], json.dumps(patch))
    written = await kube.patch_status(DM_KIND, meta["namespace"], meta["name"], patch)
    if cache is not None:
        cache.observe(DM_KIND, written)
    return True


def transition_events(
    before: DisaggregatedModelStatus | None, after: DisaggregatedModelStatus, outcome: Outcome
) -> None:
    old = {c.type: c for c in (before.conditions if before else [])}
    for cond in after.conditions:
        prior = old.get(cond.type)
        if prior is not None and prior.status == cond.status and prior.reason == cond.reason:
            continue
        if cond.type == "Ready" and (prior is not None or cond.status == "True"):
            outcome.event("Normal" if cond.status == "True" else "Warning", cond.reason,
                          cond.message)  # fmt: skip
        elif cond.type == "Degraded" and cond.status == "True":
            outcome.event("Warning", cond.reason, cond.message)
        elif cond.type == "Degraded" and prior is not None and prior.status == "True":
            outcome.event("Normal", "Recovered", cond.message)


def watch_transport(
    health: TransportMonitor | None, dm: DisaggregatedModel, pods: Sequence[Mapping[str, Any]]
) -> HealthVerdict | None:
    """Point the scraper at the model's decode engines and gateways; its last verdict."""
    if health is None:
        return None
    key = (dm.namespace, dm.name)
    if not dm.spec.disaggregated:
        health.forget(key)
        return None

    def addresses(component: Component) -> dict[str, str]:
        """Pod IP -> pod name, of the component's pods that have one and stay."""
        return dict(sorted(
            (pod["status"]["podIP"], pod["metadata"]["name"])
            for pod in component_pods(pods, component)
            if pod.get("status", {}).get("podIP") and not pod["metadata"].get("deletionTimestamp")
        ))  # fmt: skip

    decode = {f"http://{ip}:{ENGINE_PORT}/metrics": name
              for ip, name in addresses(Component.decode).items()}  # fmt: skip
    health.track(
        key,
        list(decode),
        transfer_budget_seconds(dm),
        gateways=[f"http://{ip}:{GATEWAY_CONTAINER_PORT}" for ip in addresses(Component.gateway)],
        names=decode,
    )
    return health.verdict(key)


async def annotate_pod(
    kube: Kube, namespace: str, name: str, annotations: Mapping[str, str],
    cache: ClusterCache | None = None,
) -> bool:  # fmt: skip
    """False when the pod is gone: a rolling update deletes pods between our list and this
    patch, and its replacement brings a pod event, hence a pass that annotates it."""
    try:
        patched = await kube.patch_merge(
            POD, namespace, name, {"metadata": {"annotations": dict(annotations)}}
        )
    except KubeError as error:
        if error.status != 404:
            raise
        log.debug("%s/%s: pod gone before its annotation (%s)", namespace, name, error)
        return False
    if cache is not None:
        cache.observe(POD, patched)
    return True


async def model_pods(
    kube: Kube, cache: ClusterCache | None, namespace: str, name: str
) -> list[dict[str, Any]]:
    """The model's pods, as the pod watch holds them or (not watched now) listed."""
    held = cache.children_of(POD, namespace, name) if cache is not None else None
    if held is not None:
        return held
    return await kube.list(POD, namespace, label_selector=children_selector(name))


def warn_once(warned: set[str] | None, dm: DisaggregatedModel, text: str) -> None:
    """Logged once per model and operator process (every pass without `warned`)."""
    seen = f"{dm.namespace}/{dm.name} {text}"
    if warned is None or seen not in warned:
        log.warning("%s/%s: %s", dm.namespace, dm.name, text)
        if warned is not None:
            warned.add(seen)


class PassFailed(Exception):
    """A pass that failed part-way: what it found and did until then (`outcome`: the events to
    post, since a retry finds nothing left to repair and would never tell them) and the error
    that ended it (`error`, also the cause), which the caller re-raises once it has told them."""

    def __init__(self, outcome: Outcome, error: BaseException) -> None:
        super().__init__(f"reconcile failed: {error!r}")
        self.outcome = outcome
        self.error = error


async def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    *,
    now: Callable[[], str] = utc_now,
    network: NetworkPolicyOptions | None = None,
    health: TransportMonitor | None = None,
    autoscaler: Autoscaler | None = None,
    warned: set[str] | None = None,
    peer_master: PeerMaster | None = None,
    cache: ClusterCache | None = None,
    gateway_image: str = DEFAULT_GATEWAY_IMAGE,
) -> Outcome:
    """Converge the children of `body` and return what the pass did, events to post included.
    `network`: the operator's NetworkPolicy settings (None: the model gets none, and loses those
    it has). `health`: the background scraper of decode engines' NIXL metrics (None: not
    measured). `autoscaler`: the Builtin autoscaling loop (None: Builtin pools keep their live
    replicas). `warned`: kinds the operator may not list that it already warned about (see
    list_children). `peer_master`: the operator's cached master key, from which a model with API
    keys or several gateway replicas gets its gateways' peer key (None: a model with API keys
    fails its pass, one without is Degraded: its replicas cannot share the long-prefill limit).
    `cache`: what the operator's watches hold, read instead of the API server where it can be
    and told of every write (None: every read is a request). `gateway_image`: the gateway's
    image where the spec names none (the operator's own). A pass that fails part-way raises
    PassFailed with what it did until then."""
    outcome = Outcome()
    try:
        await _converge(
            kube, body, outcome, now=now, network=network, health=health,
            autoscaler=autoscaler, warned=warned, peer_master=peer_master, cache=cache,
            gateway_image=gateway_image,
        )  # fmt: skip
    except (Exception, asyncio.CancelledError) as error:  # cancelled too: still told
        raise PassFailed(outcome, error) from error
    return outcome


async def _converge(
    kube: Kube,
    body: Mapping[str, Any],
    outcome: Outcome,
    *,
    now: Callable[[], str],
    network: NetworkPolicyOptions | None,
    health: TransportMonitor | None,
    autoscaler: Autoscaler | None,
    warned: set[str] | None,
    peer_master: PeerMaster | None,
    cache: ClusterCache | None,
    gateway_image: str,
) -> None:
    """The pass itself; `outcome` (the pass's own, not a caller's) is filled as it goes."""
    meta = body["metadata"]
    generation = meta.get("generation")
    before = previous_status(body)

    async def refuse(problems: list[str], reason: str) -> None:
        """Nothing applied: the model Failed with `reason`, told once as a Warning."""
        outcome.problems = problems
        status = compute_status(
            None, Observation(problems=problems, problem_reason=reason), before,
            generation=generation, parity=None, now=now(),
        )  # fmt: skip
        outcome.status = status
        outcome.status_written = await write_status(kube, body, status, cache)
        if outcome.status_written:
            outcome.event("Warning", reason, "; ".join(problems))

    try:
        dm, newer = parse_stored(dict(body))
    except SpecError as error:
        await refuse(error.problems, "InvalidSpec")
        return
    if missing := await missing_apis(kube, dm):
        await refuse(missing, "MissingAPI")
        return

    for field_warning in newer:
        # Once per field and operator process: it stays until the operator is upgraded.
        warn_once(warned, dm, field_warning)
    for advice in admission_warnings(dm.spec):
        # The webhook told whoever applied it; this tells whoever runs a cluster without it.
        warn_once(warned, dm, advice)
    digest, warnings = await chat_template_digest(kube, dm)
    pods_before = await model_pods(kube, cache, dm.namespace, dm.name)
    optional = set() if network is not None else {NETWORK_POLICY}
    scaling = dm.spec.render.autoscaling
    if not (dm.spec.render.enabled and scaling.enabled and scaling.engine is RenderAutoscaler.keda):
        optional.add(SCALED_OBJECT)  # none wanted: a cluster without KEDA RBAC is fine
    live = await list_children(
        kube, dm.namespace, dm.name, optional=frozenset(optional), warned=warned,
        cached=cache.children_of if cache is not None else None,
    )  # fmt: skip
    # Builtin-scaled pools: the live replicas, or a newer decision of the autoscaling loop.
    plan = live_plan(dm, [o for k, o in live.items() if k[1] in WORKLOAD_KINDS])
    if autoscaler is not None:
        plan, decisions = autoscaler.plan((dm.namespace, dm.name), dm, plan, pods_before)
        for decision in decisions:
            reason = "ScaledUp" if decision.direction == "up" else "ScaledDown"
            outcome.event("Normal", reason, decision.reason)
    gateway_key, key_warnings = await peer_key_for(dm, peer_master)
    for key_warning in key_warnings:
        # Its fix is the operator's environment: logged for whoever runs the operator, who may
        # read no model's status.
        warn_once(warned, dm, key_warning)
    warnings += key_warnings
    engine_sets = {k[2]: o for k, o in live.items() if k[1] in ("StatefulSet", "LeaderWorkerSet")}
    rollout = engine_rollout(dm, plan, engine_sets, pods_before)
    for step in rollout_steps(rollout, engine_sets):
        outcome.event("Normal", "EngineRolloutStep", step)
    built = build_all(
        dm,
        chat_template_digest=digest,
        network=network,
        plan=plan,
        peer_key=gateway_key,
        rollout=rollout,
        gateway_image=gateway_image,
    )
    built += preflight(dm, node_pairs(engine_pods(pods_before)))
    desired = [owned(body, obj) for obj in sorted(built, key=object_key)]
    drift = parity_drift(desired, live)
    if drift:
        outcome.event("Warning", PARITY_DRIFT, "repairing: " + "; ".join(drift))

    results: dict[ChildKey, Mapping[str, Any]] = dict(live)  # live state after this pass
    if gateway_key is None and had_peer_key(dm, live):
        # Before the Deployment drops the mount: a failed delete fails the pass while the
        # Deployment still tells that a Secret is left, so the retry deletes it.
        await kube.delete(SECRET, dm.namespace, peer_key_secret_name(dm.name))
        outcome.pruned.append(f"Secret/{peer_key_secret_name(dm.name)}")

    async def apply_changed(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The object as applied, or None when nothing was told (current already)."""
        if obj["kind"] in WRITE_ONLY_KINDS:
            # Never listed, so applied every pass; the same bytes each time, which the API
            # server does not write again. Not told as applied: it almost never changes.
            await kube.apply(obj, field_manager=FIELD_MANAGER, force=True)
            return None
        if is_current(live.get(key_of(obj)), obj):
            return None
        applied = await kube.apply(obj, field_manager=FIELD_MANAGER, force=True)
        if cache is not None:
            cache.observe(kind_of(obj), applied)
        return applied

    for wave in apply_waves(desired):
        # One round trip per wave, not per object: what a wave needs exists before it starts.
        answers = await asyncio.gather(*map(apply_changed, wave), return_exceptions=True)
        for obj, answer in zip(wave, answers, strict=True):
            if answer is not None and not isinstance(answer, BaseException):
                results[key_of(obj)] = answer
                outcome.applied.append(describe(obj))
        if failed := next((a for a in answers if isinstance(a, BaseException)), None):
            raise failed
    wanted = {key_of(obj) for obj in desired}
    for key, obj in live.items():
        owners = obj["metadata"].get("ownerReferences", [])
        if key not in wanted and any(o.get("uid") == meta["uid"] for o in owners):
            await kube.delete(kind_of(obj), dm.namespace, obj["metadata"]["name"])
            if cache is not None:
                cache.discard(kind_of(obj), dm.namespace, obj["metadata"]["name"])
            outcome.pruned.append(describe(obj))
            results.pop(key, None)
    if outcome.applied or outcome.pruned:
        log.info("%s/%s: applied %s; pruned %s", dm.namespace, dm.name, outcome.applied or "-",
                 outcome.pruned or "-")  # fmt: skip
    else:
        log.debug("%s/%s: children in sync", dm.namespace, dm.name)

    workloads: dict[Component, list[Mapping[str, Any]]] = {}
    components = {c.value for c in Component}
    for key, result in sorted(results.items()):
        component = result["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if key[1] in WORKLOAD_KINDS and component in components:
            workloads.setdefault(Component(component), []).append(result)
    pods = await model_pods(kube, cache, dm.namespace, dm.name)
    engines = engine_pods(pods)
    # The pods of the Jobs that exist now: a Job made again under the same name must not be
    # judged by its deleted predecessor's pods, which the garbage collector removes later.
    jobs = {o["metadata"].get("uid") for k, o in results.items() if k[1] == JOB.kind}
    probes = [
        p for p in component_pods(pods, Component.preflight)
        if p["metadata"].get("labels", {}).get(JOB_UID_LABEL) in jobs
    ]  # fmt: skip
    by_pair = pair_verdicts(dm, engines, probes)
    verdicts = [slice_verdict(pairs) for pairs in by_pair]
    for job in probe_jobs_to_rerun([p.verdict for pairs in by_pair for p in pairs], probes):
        # The next pass makes it again (the Job is one of the model's children).
        await kube.delete(JOB, dm.namespace, job)
        if cache is not None:
            cache.discard(JOB, dm.namespace, job)
        outcome.pruned.append(f"Job/{job} (a probe pod could not be scheduled: probing again)")
    for pod_name, value in pod_annotation_patches(verdicts, engines):
        annotation = {KV_TRANSPORT_ANNOTATION: value}
        if await annotate_pod(kube, dm.namespace, pod_name, annotation, cache):
            outcome.applied.append(f"Pod/{pod_name} {KV_TRANSPORT_ANNOTATION}={value}")
    mismatches = None
    if dm.spec.gateway.replica_check == "Enforce":
        gateway_events = cache.gateway_events(dm.namespace) if cache is not None else None
        if gateway_events is None:
            gateway_events = await kube.list(
                EVENT, dm.namespace, field_selector=f"source={GATEWAY_EVENT_REPORTER}"
            )
        mismatches = replica_mismatches(pods, gateway_events)
    seen = Observation(
        workloads=workloads, pods=pods, parity_drift=drift, warnings=warnings, transport=verdicts,
        health=watch_transport(health, dm, pods), replica_mismatches=mismatches,
        rollout_notes=rollout.notes, pod_security=await pod_security_refusal(kube, dm, cache),
    )  # fmt: skip
    status = compute_status(
        dm, seen, before, generation=generation, parity=parity_hash(dm, digest), now=now()
    )
    outcome.status = status
    outcome.status_written = await write_status(kube, body, status, cache)
    if outcome.status_written:
        transition_events(before, status, outcome)
