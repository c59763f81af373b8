"""The children of one DisaggregatedModel as the API server holds them: listing every kind
pdserve may have made for it (so what the spec dropped is pruned), and the ownership and applied
hash stamped on what it applies."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.api import API_VERSION, KIND
from pdserve.builders import KIND_ORDER
from pdserve.contract.names import children_selector
from pdserve.controller.diff import APPLIED_HASH_ANNOTATION, applied_hash
from pdserve.kube.client import KINDS, Kind, Kube, KubeError

log = logging.getLogger("pdserve.reconcile")

ChildKey = tuple[str, str, str]  # apiVersion, kind, name
# A model's children of one kind as the operator's watches hold them (kind, namespace, model);
# None when that kind is not watched now.
CachedChildren = Callable[[Kind, str, str], "list[dict[str, Any]] | None"]
# Applied every pass and never listed or read: the operator may not read Secrets (a user's hold
# credentials). Its only one, the gateways' peer key, is derived, so the same bytes are applied
# each pass (no write at the API server), and the gateway Deployment tells when it must go.
WRITE_ONLY_KINDS = frozenset({"Secret"})
# The kinds listed each pass (so what the spec dropped is pruned).
MANAGED_KINDS: list[Kind] = sorted(
    (k for k in KINDS.values() if k.kind in KIND_ORDER and k.kind not in WRITE_ONLY_KINDS),
    key=lambda k: KIND_ORDER.index(k.kind),
)
NETWORK_POLICY = KINDS[("networking.k8s.io/v1", "NetworkPolicy")]


def key_of(obj: Mapping[str, Any]) -> ChildKey:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def describe(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def owned(dm_body: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The desired object with its owner reference and the hash of what pdserve applies. It
    shares all but its metadata with `desired` (a builder's fresh output: copying the whole
    object was a tenth of the operator's CPU with 50 models at once)."""
    meta = dm_body["metadata"]
    obj = {**desired, "metadata": {**desired["metadata"], "ownerReferences": [{
        "apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
        "controller": True, "blockOwnerDeletion": True,
    }]}}  # fmt: skip
    stamp = applied_hash(obj)
    annotations = obj["metadata"].get("annotations", {})
    obj["metadata"]["annotations"] = {**annotations, APPLIED_HASH_ANNOTATION: stamp}
    return obj


async def list_children(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    optional: frozenset[Kind] = frozenset(),
    warned: set[str] | None = None,
    cached: CachedChildren | None = None,
) -> dict[ChildKey, dict[str, Any]]:
    """Every child pdserve labelled for this model, of every kind it may have made, including
    kinds the spec or settings dropped (so they are pruned). A kind in `optional` that the
    operator may not list (403) is skipped: none of it is wanted, and none can be pruned.
    `warned`: the kinds already warned about, kept by the caller so that each is warned about
    once (the operator's Reconciler keeps one set for its lifetime); None: warn every time.
    `cached`: the children the operator's watches hold, per kind (None for a kind: list it)."""
    warned = set() if warned is None else warned
    selector = children_selector(name)
    children: dict[ChildKey, dict[str, Any]] = {}

    async def read(kind: Kind) -> list[dict[str, Any]]:
        held = cached(kind, namespace, name) if cached is not None else None
        if held is not None:
            return held
        return await kube.list(kind, namespace, label_selector=selector)

    # All kinds at once: a pass waits for one round trip instead of one per kind.
    listed = await asyncio.gather(*map(read, MANAGED_KINDS), return_exceptions=True)
    for kind, items in zip(MANAGED_KINDS, listed, strict=True):
        if isinstance(items, BaseException):
            if not isinstance(items, KubeError) or items.status != 403 or kind not in optional:
                raise items
            if kind.kind not in warned:
                warned.add(kind.kind)
                log.warning("may not list %s (%s): any made earlier are not pruned", kind.kind,
                            items)  # fmt: skip
            continue
        for item in items:
            if "kind" not in item:  # a list's items carry neither
                item["apiVersion"], item["kind"] = kind.api_version, kind.kind
            children[key_of(item)] = item
    return children
