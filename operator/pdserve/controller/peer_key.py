"""The gateways' peer key, derived, never stored and read back: each model's key is
HMAC-SHA256(master key, "<namespace>/<name>/<uid>"), so every pass builds the same Secret
(server-side apply of the same bytes writes nothing) and the operator never lists or reads a
user's Secrets. The one Secret it reads is the master key's, in its own namespace (RBAC allows
`get` on that one name only). No key is ever logged or written into status or an Event."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders import wants_peer_key
from pdserve.builders.names import child_name
from pdserve.contract.names import (
    PEER_MASTER_SECRET_KEY,
    PEER_MASTER_SECRET_NAME,
    Component,
    peer_key_secret_name,
)
from pdserve.controller.children import ChildKey
from pdserve.kube.client import KINDS, Kube, written_or_theirs

DEPLOYMENT = KINDS[("apps/v1", "Deployment")]

log = logging.getLogger("pdserve.reconcile")

SECRET = KINDS[("v1", "Secret")]
MASTER_BYTES = 32  # 256 bits
# A master someone wrote by hand shorter than this would make every model's key guessable.
MIN_MASTER_BYTES = 16


class PeerMasterError(RuntimeError):
    """The master key cannot be had: no operator namespace, or its Secret holds no usable key."""


def secret_key(dm: DisaggregatedModel) -> ChildKey:
    return SECRET.api_version, SECRET.kind, peer_key_secret_name(dm.name)


def model_peer_key(master: bytes, namespace: str, name: str, uid: str) -> str:
    """The model's key. The uid makes a model re-created under the same name a new key, so a
    gateway of the old one is never a peer of the new one. Hex: one line, nothing to trip on."""
    message = f"{namespace}/{name}/{uid}".encode()
    return hmac.new(master, message, hashlib.sha256).hexdigest()


def master_secret(namespace: str, master: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": PEER_MASTER_SECRET_NAME,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "pdserve"},
        },
        "type": "Opaque",
        "data": {PEER_MASTER_SECRET_KEY: base64.b64encode(master).decode()},
    }


def stored_master(secret: Mapping[str, Any]) -> bytes | None:
    encoded = (secret.get("data") or {}).get(PEER_MASTER_SECRET_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        master = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        return None
    return master if len(master) >= MIN_MASTER_BYTES else None


async def load_master(kube: Kube, namespace: str) -> bytes:
    """The master key, made here when there is none yet. Two replicas may race to make it: the
    loser's create answers 409 and it reads the winner's, so both derive the same keys."""
    found = await kube.get(SECRET, namespace, PEER_MASTER_SECRET_NAME)
    if found is None:

        async def make() -> None:
            await kube.create(master_secret(namespace, secrets.token_bytes(MASTER_BYTES)))
            log.info("made the gateways' peer master key in Secret %s/%s", namespace,
                     PEER_MASTER_SECRET_NAME)  # fmt: skip

        found = await written_or_theirs(kube, make, SECRET, namespace, PEER_MASTER_SECRET_NAME)
    master = stored_master(found) if found is not None else None
    if master is None:
        raise PeerMasterError(
            f"Secret {namespace}/{PEER_MASTER_SECRET_NAME} holds no usable "
            f"{PEER_MASTER_SECRET_KEY!r} (at least {MIN_MASTER_BYTES} bytes, base64): delete it "
            "and restart the operator to make a new one"
        )
    return master


class PeerMaster:
    """The master key, read once per operator process and cached: a reconcile never reads a
    Secret. Lazy, so an operator serving only single-replica gateways without API keys never
    needs it. A new master (its Secret deleted, then the operator restarted) changes every
    model's key and rolls all gateways."""

    def __init__(self, kube: Kube, namespace: str | None) -> None:
        self.kube = kube
        self.namespace = namespace
        self._master: bytes | None = None
        self._lock = asyncio.Lock()

    async def master(self) -> bytes:
        async with self._lock:  # concurrent passes share one read (and at most one create)
            if self._master is None:
                if self.namespace is None:
                    raise PeerMasterError(
                        "the operator's namespace, which keeps the gateways' peer master key, "
                        "is unknown: set PDSERVE_OPERATOR_NAMESPACE in the operator's "
                        "environment to the namespace it runs in"
                    )
                self._master = await load_master(self.kube, self.namespace)
            return self._master

    async def peer_key(self, dm: DisaggregatedModel) -> str:
        uid = dm.metadata.uid
        if not uid:  # a model read from the API server always has one
            raise PeerMasterError(f"{dm.namespace}/{dm.name} has no uid to derive its peer key")
        return model_peer_key(await self.master(), dm.namespace, dm.name, uid)


async def peer_key_for(
    dm: DisaggregatedModel, master: PeerMaster | None
) -> tuple[str | None, list[str]]:
    """The key the model's gateways use (None: the model wants none, or cannot have one) and
    what its status warns of. Behind API keys a master that cannot be had fails the pass, as
    it always has: the replicas would fall back to sending each other a client's key. Without
    API keys the key only guards the replicas' holds on each other: the model still serves
    without it, each replica admitting long prefills alone, so it is served and warned of
    rather than left unreconciled."""
    if not wants_peer_key(dm):
        return None, []
    gateway = dm.spec.gateway
    try:
        if master is None:
            raise PeerMasterError(
                "the operator has no peer master key: run it with PDSERVE_OPERATOR_NAMESPACE "
                "set to its namespace"
            )
        return await master.peer_key(dm), []
    except PeerMasterError as error:
        if gateway.api_key_secret_ref is not None:
            raise
        return None, [
            f"spec.gateway.replicas: {gateway.replicas} gateway replicas and no peer key: "
            "each refuses the others' long-prefill holds, so they cannot share the "
            f"long-prefill limit and each admits alone; {error}"
        ]


def had_peer_key(dm: DisaggregatedModel, live: Mapping[ChildKey, Mapping[str, Any]]) -> bool:
    """Whether the live gateway still mounts a peer key, so its Secret is there to prune: the
    operator may not list Secrets, and the Deployment it made tells as much."""
    gateway = live.get((DEPLOYMENT.api_version, DEPLOYMENT.kind, child_name(dm, Component.gateway)))
    if gateway is None:
        return False
    template = (gateway.get("spec") or {}).get("template") or {}
    volumes = (template.get("spec") or {}).get("volumes") or []
    secret = peer_key_secret_name(dm.name)
    return any((v.get("secret") or {}).get("secretName") == secret for v in volumes)
