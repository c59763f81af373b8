"""The operator's watch-fed cache: which model a change wakes, and what a pass may read from it
(nothing of a kind whose watch is not running)."""

from __future__ import annotations

from typing import Any, cast

from pdserve.controller.cache import POD, ClusterCache
from pdserve.kube.client import KINDS, Kube

DEPLOYMENT = KINDS[("apps/v1", "Deployment")]


def child(kind: str, name: str, model: str | None, version: int = 1) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "pdserve"}
    if model:
        labels["app.kubernetes.io/instance"] = model
    return {"kind": kind, "metadata": {"name": name, "namespace": "llm", "labels": labels,
                                       "resourceVersion": str(version)}}  # fmt: skip


def cache_and_heard() -> tuple[ClusterCache, list[tuple[str, str, bool]]]:
    heard: list[tuple[str, str, bool]] = []
    cache = ClusterCache(cast(Kube, None), (), on_model=lambda *key: heard.append(key))
    return cache, heard


def test_a_childs_change_wakes_the_model_it_belongs_to() -> None:
    cache, heard = cache_and_heard()
    [deployments] = cache.children["Deployment"].values()
    deployments._tell("MODIFIED", child("Deployment", "qwen-gateway", "qwen"))
    deployments._tell("MODIFIED", child("Deployment", "stray", None))  # no instance label
    [models] = cache.models.values()
    models._tell("DELETED", {"metadata": {"name": "old", "namespace": "llm"}})
    assert heard == [("llm", "qwen", False), ("llm", "old", True)]


def test_a_gateway_event_on_a_pod_wakes_the_pods_model() -> None:
    cache, heard = cache_and_heard()
    [pods] = cache.children["Pod"].values()
    pods.observe(child("Pod", "qwen-render-0", "qwen"))
    [events] = cache.gateway_event_informers.values()

    def event(pod: str) -> dict[str, Any]:
        return {"metadata": {"name": f"{pod}.1", "namespace": "llm"},
                "involvedObject": {"kind": "Pod", "name": pod, "namespace": "llm"}}  # fmt: skip

    events._tell("ADDED", event("qwen-render-0"))
    events._tell("ADDED", event("gone-pod"))  # a pod the cache does not hold: nobody to wake
    assert heard == [("llm", "qwen", False)]


def test_a_pass_reads_a_kind_only_while_its_watch_runs() -> None:
    cache, _ = cache_and_heard()
    [deployments] = cache.children["Deployment"].values()
    assert cache.children_of(DEPLOYMENT, "llm", "qwen") is None  # not listed yet: list it
    assert cache.model("llm", "qwen") == (False, None)
    assert cache.gateway_events("llm") is None
    deployments.synced = True
    assert cache.children_of(DEPLOYMENT, "llm", "qwen") == []
    cache.observe(DEPLOYMENT, child("Deployment", "qwen-gateway", "qwen", version=5))
    cache.observe(DEPLOYMENT, child("Deployment", "other-gateway", "other"))
    [held] = cache.children_of(DEPLOYMENT, "llm", "qwen") or []
    assert held["metadata"]["resourceVersion"] == "5"
    cache.discard(DEPLOYMENT, "llm", "qwen-gateway")
    assert cache.children_of(DEPLOYMENT, "llm", "qwen") == []
    assert cache.children_of(POD, "llm", "qwen") is None  # each kind on its own


def test_a_relabelled_namespace_wakes_its_models_and_its_level_is_read_from_the_watch() -> None:
    cache, heard = cache_and_heard()
    [models] = cache.models.values()
    for namespace, name in (("llm", "qwen"), ("other", "llama")):
        models.observe({"metadata": {"name": name, "namespace": namespace}})
    assert cache.namespace_labels("llm") is None  # not watched yet: the pass asks
    relabelled: dict[str, Any] = {"metadata": {
        "name": "llm", "labels": {"pod-security.kubernetes.io/enforce": "baseline"},
    }}  # fmt: skip
    cache.namespaces.observe(relabelled)
    cache.namespaces.synced = True
    cache.namespaces._tell("MODIFIED", relabelled)
    assert heard == [("llm", "qwen", False)]
    assert cache.namespace_labels("llm") == {"pod-security.kubernetes.io/enforce": "baseline"}
    assert cache.namespace_labels("gone") == {}
