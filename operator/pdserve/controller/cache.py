"""What the operator's watches last saw: every DisaggregatedModel, and every kind of child
pdserve makes (pods included), grouped by the model they belong to. A pass reads its model and
children here instead of asking the API server (one get and sixteen lists a pass, before), and
every change a watch sees wakes the pass of the model it belongs to.

A kind whose watch is not running (not yet listed, the operator may not watch it, the watch
failed and is re-listing) answers None: the pass lists that kind itself, as it always did."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdserve.api import API_VERSION, KIND
from pdserve.contract.names import GATEWAY_EVENT_REPORTER, INSTANCE_LABEL, MANAGED_SELECTOR
from pdserve.controller.children import MANAGED_KINDS
from pdserve.kube.client import KINDS, Kind, Kube
from pdserve.kube.informer import Informer

DM_KIND = KINDS[(API_VERSION, KIND)]
POD = KINDS[("v1", "Pod")]
EVENT = KINDS[("v1", "Event")]
NAMESPACE = KINDS[("v1", "Namespace")]
CACHED_CHILD_KINDS: tuple[Kind, ...] = (*MANAGED_KINDS, POD)

# (namespace, name) of a model; told with True when it was deleted.
ModelHandler = Callable[[str, str, bool], None]


def instance_of(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (namespace, model) a child belongs to, by the instance label pdserve stamps."""
    meta = obj["metadata"]
    owner = meta.get("labels", {}).get(INSTANCE_LABEL)
    return (meta.get("namespace", ""), owner) if owner else None


Scoped = dict[str | None, Informer]  # by namespace; None: all namespaces


def pick(informers: Scoped, namespace: str) -> Informer | None:
    return informers.get(namespace) or informers.get(None)


class ClusterCache:
    def __init__(self, kube: Kube, namespaces: Sequence[str], *, on_model: ModelHandler) -> None:
        """`namespaces`: those the operator serves (empty: all). `on_model`: told of every
        model that changed or was deleted, and of every model whose child changed."""
        self.on_model = on_model
        scopes: tuple[str | None, ...] = tuple(namespaces) or (None,)
        self.models: Scoped = {
            scope: Informer(kube, DM_KIND, scope, on_change=self._model_changed) for scope in scopes
        }
        self.children: dict[str, Scoped] = {
            kind.kind: {
                scope: Informer(
                    kube, kind, scope, label_selector=MANAGED_SELECTOR, group_by=instance_of,
                    on_change=self._child_changed,
                )
                for scope in scopes
            }
            for kind in CACHED_CHILD_KINDS
        }  # fmt: skip
        # The gateways' replica-check Events (on pods), read into ContractVerified.
        self.gateway_event_informers: Scoped = {
            scope: Informer(
                kube, EVENT, scope, field_selector=f"source={GATEWAY_EVENT_REPORTER}",
                group_by=lambda event: event["metadata"].get("namespace", ""),
                on_change=self._gateway_event,
            )
            for scope in scopes
        }  # fmt: skip
        # Namespaces' labels: their Pod Security level (controller/pod_security.py).
        self.namespaces = Informer(kube, NAMESPACE, None, on_change=self._namespace_changed)
        self._tasks: list[asyncio.Task[None]] = []

    def informers(self) -> list[Informer]:
        children = (i for scoped in self.children.values() for i in scoped.values())
        return [*self.models.values(), *children, *self.gateway_event_informers.values(),
                self.namespaces]  # fmt: skip

    def _namespace_changed(self, _event: str, obj: Mapping[str, Any]) -> None:
        """A namespace relabelled (its Pod Security level): the passes of its models."""
        namespace = obj["metadata"]["name"]
        informer = pick(self.models, namespace)
        if informer is None:
            return
        for key, model in list(informer.objects.items()):
            if key[0] == namespace:
                self.on_model(namespace, model["metadata"]["name"], False)

    def _model_changed(self, event: str, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self.on_model(meta.get("namespace", ""), meta["name"], event == "DELETED")

    def _child_changed(self, _event: str, obj: Mapping[str, Any]) -> None:
        if (owner := instance_of(obj)) is not None:
            self.on_model(*owner, False)

    def _gateway_event(self, _event: str, obj: Mapping[str, Any]) -> None:
        """An Event about a pod: the pass of the model the pod belongs to."""
        involved = obj.get("involvedObject") or {}
        namespace = involved.get("namespace") or obj["metadata"].get("namespace", "")
        pods = pick(self.children.get(POD.kind, {}), namespace)
        pod = pods.get(namespace, involved.get("name", "")) if pods is not None else None
        if pod is not None:
            self._child_changed("MODIFIED", pod)

    # -- reading ------------------------------------------------------------------------------

    def model(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(known, the model as last seen): known is False when the models' watch is not
        running (ask the API server); the model None when the watch holds none of that name."""
        informer = pick(self.models, namespace)
        if informer is None or not informer.synced:
            return False, None
        return True, informer.get(namespace, name)

    def children_of(self, kind: Kind, namespace: str, name: str) -> list[dict[str, Any]] | None:
        """The model's children of `kind` as last seen; None when that kind's watch is not
        running (list it). Not copies: readers must not change them."""
        informer = pick(self.children.get(kind.kind, {}), namespace)
        if informer is None or not informer.synced:
            return None
        return informer.group((namespace, name))

    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """The namespace's labels as last seen; None when namespaces are not watched now."""
        if not self.namespaces.synced:
            return None
        found = self.namespaces.get(None, namespace) or {}
        labels: Mapping[str, str] = found.get("metadata", {}).get("labels") or {}
        return labels

    def gateway_events(self, namespace: str) -> list[dict[str, Any]] | None:
        """The gateways' Events in `namespace` as last seen; None when not watched now."""
        informer = pick(self.gateway_event_informers, namespace)
        if informer is None or not informer.synced:
            return None
        return informer.group(namespace)

    # -- what a pass wrote --------------------------------------------------------------------

    def observe(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        """An object as a write answered it (apply, status patch, annotation)."""
        scoped = self.models if kind.kind == DM_KIND.kind else self.children.get(kind.kind, {})
        informer = pick(scoped, obj["metadata"].get("namespace", ""))
        if informer is not None:
            informer.observe(obj)

    def discard(self, kind: Kind, namespace: str, name: str) -> None:
        informer = pick(self.children.get(kind.kind, {}), namespace)
        if informer is not None:
            informer.discard(namespace, name)

    # -- running ------------------------------------------------------------------------------

    def start(self) -> None:
        for informer in self.informers():
            self._tasks.append(asyncio.create_task(informer.run(), name=repr(informer)))

    async def wait_listed(self, limit_seconds: float) -> bool:
        """Wait until every watch has listed once (or failed to); False after the limit."""
        waits = [informer.attempted.wait() for informer in self.informers()]
        try:
            async with asyncio.timeout(limit_seconds):
                await asyncio.gather(*waits)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
