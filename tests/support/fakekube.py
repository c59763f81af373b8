"""An in-memory API server for reconcile passes: what Kube calls, every write recorded, and a
`settle` that plays the controllers and the kubelet (workloads rolled out, their pods bound,
addressed and Ready)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, cast

import httpx

from pdserve.controller.reconcile import DM_KIND, Outcome, reconcile
from pdserve.kube.client import Kind, Kube, KubeError

ObjKey = tuple[str, str, str]  # kind, namespace, name


def apply_merge(target: Any, patch: Any) -> Any:
    """RFC 7386: the document `patch` turns `target` into."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge(out.get(key), value)
    return out


def matches(obj: Mapping[str, Any], selector: str | None) -> bool:
    labels = obj["metadata"].get("labels", {})
    for term in (selector or "").split(","):
        if term:
            name, value = term.split("=", 1)
            if labels.get(name) != value:
                return False
    return True


# Field selectors that name another path than their own (an Event's `source`).
FIELD_PATHS = {"source": "source.component"}


def fields_match(obj: Mapping[str, Any], selector: str | None) -> bool:
    """Equality field selectors (`a.b=v,c=w`), as the API server reads them."""
    for term in (selector or "").split(","):
        if not term:
            continue
        path, _, wanted = term.partition("=")
        value: Any = obj
        for part in FIELD_PATHS.get(path, path).split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value != wanted:
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[ObjKey, dict[str, Any]] = {}
        self.writes: list[str] = []
        # Every read, "get Kind ns/name" or "list Kind ns": what the operator may see.
        self.reads: list[str] = []
        # Applies of exactly what was stored: the API server writes nothing for them.
        self.unchanged_applies: list[str] = []
        # Run before a create is stored: a racing replica's create that lands first.
        self.before_create: Callable[[], None] | None = None
        self.fail_on: str | None = None  # a write verb (apply, delete, ...) that fails with 500
        self.forbidden: set[str] = set()  # kinds whose list answers 403
        self.unserved: set[str] = set()  # kinds whose API is not served (CRD not installed)
        self.created: list[dict[str, Any]] = []  # Events
        self.closed = False

    def _fail(self, verb: str, path: str, status: int = 500) -> None:
        """Raise as the API server would when `verb` is the one to fail (always for 403)."""
        if verb == self.fail_on or status in (403, 404, 409):
            request = httpx.Request("GET", f"https://api.test{path}")
            raise KubeError(httpx.Response(status, json={"message": verb}, request=request))

    async def close(self) -> None:
        self.closed = True

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(dict(obj))
        meta = stored["metadata"]
        self.objects[(stored["kind"], meta.get("namespace", ""), meta["name"])] = stored
        return stored

    async def serves(self, kind: Kind) -> bool:
        self.reads.append(f"discover {kind.api_version}")
        return kind.kind not in self.unserved

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.reads.append(f"get {kind.kind} {namespace or ''}/{name}")
        found = self.objects.get((kind.kind, namespace or "", name))
        return copy.deepcopy(found) if found is not None else None

    async def list(
        self,
        kind: Kind,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        self.reads.append(f"list {kind.kind} {namespace or ''}")
        if kind.kind in self.forbidden:
            self._fail("list", kind.collection(namespace), 403)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in sorted(self.objects.items())
            if k == kind.kind
            # No namespace: a namespaced kind is listed across all of them, as the API does.
            and (ns == (namespace or "") or (namespace is None and kind.namespaced))
            and matches(obj, label_selector)
            and fields_match(obj, field_selector)
        ]

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True
    ) -> dict[str, Any]:
        meta = obj["metadata"]
        before = self.objects.get((obj["kind"], meta.get("namespace", ""), meta["name"]))
        stored = copy.deepcopy(dict(obj))
        if before is not None:
            # Fields others own (status, HPA-set replicas) survive an apply that omits them.
            stored = apply_merge(before, obj)
            if stored == before:  # server-side apply of what is there: nothing is written
                self.unchanged_applies.append(f"apply {obj['kind']}/{meta['name']}")
                self._fail("apply", meta["name"])
                return copy.deepcopy(before)
        self.writes.append(f"apply {obj['kind']}/{meta['name']}")
        self._fail("apply", meta["name"])
        stored["metadata"]["generation"] = (before or {}).get("metadata", {}).get(
            "generation", 0
        ) + 1
        return copy.deepcopy(self.put(stored))

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: 409 when metadata.resourceVersion is not the stored one (someone wrote since)."""
        meta = obj["metadata"]
        self.writes.append(f"replace {obj['kind']}/{meta['name']}")
        before = self.objects.get((obj["kind"], meta.get("namespace", ""), meta["name"]))
        if before is None:
            self._fail("replace", meta["name"], 404)
        elif meta.get("resourceVersion") != before["metadata"].get("resourceVersion"):
            self._fail("replace", meta["name"], 409)
        return copy.deepcopy(self.put(obj))

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Event":
            self.writes.append(f"create {obj['kind']} {obj.get('reason', '')}")
            self.created.append(copy.deepcopy(dict(obj)))
            return copy.deepcopy(dict(obj))
        meta = obj["metadata"]
        self.writes.append(f"create {obj['kind']}/{meta['name']}")
        self._fail("create", meta["name"])
        if self.before_create is not None:
            self.before_create()
        if (obj["kind"], meta.get("namespace", ""), meta["name"]) in self.objects:
            self._fail("create", meta["name"], 409)
        return copy.deepcopy(self.put(obj))

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        self.writes.append(f"delete {kind.kind}/{name}")
        self._fail("delete", name)
        self.objects.pop((kind.kind, namespace or "", name), None)

    async def patch_merge(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any],
        subresource: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        what = f"{kind.kind}/{name}" + (f"/{subresource}" if subresource else "")
        self.writes.append(f"patch {what} {patch}")
        self._fail("patch", name)
        key = (kind.kind, namespace, name)
        self.objects[key] = apply_merge(self.objects[key], patch)
        return copy.deepcopy(self.objects[key])

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.patch_merge(kind, namespace, name, {"status": dict(status)}, "status")

    # ---- the cluster's other actors -----------------------------------------------------------
    def settle(self, namespace: str) -> None:
        """Every workload rolled out with its pods Running, Ready, bound and addressed."""
        pods = 0
        for (kind, ns, name), obj in sorted(self.objects.items()):
            if ns != namespace or kind not in ("StatefulSet", "Deployment"):
                continue
            replicas = int(obj["spec"].get("replicas", 1))
            obj["status"] = {
                "observedGeneration": obj["metadata"].get("generation", 1),
                "replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
            }  # fmt: skip
            template = obj["spec"]["template"]
            for index in range(replicas):
                pods += 1
                pod_name = f"{name}-{index}"
                existing = self.objects.get(("Pod", namespace, pod_name))
                meta = copy.deepcopy(template["metadata"])
                meta.update(name=pod_name, namespace=namespace)
                if existing is not None:
                    meta["annotations"] = existing["metadata"].get("annotations", {})
                self.put({
                    "apiVersion": "v1", "kind": "Pod", "metadata": meta,
                    "spec": {"nodeName": f"node-{pods % 2}"},
                    "status": {
                        "phase": "Running", "podIP": f"10.1.0.{pods}",
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                })  # fmt: skip

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> None:
        """An autoscaler's write to /scale."""
        self.objects[(kind, namespace, name)]["spec"]["replicas"] = replicas


NS, NAME = "team", "qwen"
SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "render": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}},  # an HPA owns replicas
    "gateway": {"replicas": 1},
}


def model_in(kube: FakeKube, spec: Mapping[str, Any] = SPEC) -> None:
    kube.put({
        "apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
        "metadata": {"name": NAME, "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": spec,
    })  # fmt: skip


async def one_pass(kube: FakeKube, **options: Any) -> Outcome:
    body = await kube.get(DM_KIND, NS, NAME)
    assert body is not None
    return await reconcile(cast(Kube, kube), body, now=lambda: "2026-01-01T00:00:00Z", **options)


async def settled(kube: FakeKube, **options: Any) -> None:
    """Passes, with the cluster catching up after each, until one writes nothing."""
    for _ in range(6):
        kube.settle(NS)
        before = len(kube.writes)
        await one_pass(kube, **options)
        if len(kube.writes) == before:
            return
    raise AssertionError(f"never settled: {kube.writes[-5:]}")
