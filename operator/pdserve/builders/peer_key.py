"""The gateway replicas' peer key: the Secret that holds it and how the gateway pods read it.

The key itself is an input: the controller derives it from its master key and the model's
identity (controller.peer_key), so building stays pure and every pass builds the same Secret."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders.names import meta
from pdserve.contract.names import PEER_KEY_SECRET_KEY, Component, peer_key_secret_name
from pdserve.contract.pod_layout import PEER_KEY_DIR

PEER_KEY_FILE = f"{PEER_KEY_DIR}/{PEER_KEY_SECRET_KEY}"


def wants_peer_key(dm: DisaggregatedModel) -> bool:
    """A gateway with peers, or behind API keys. Its replicas hold long-prefill slots on each
    other (POST /admission/hold), which a gateway refuses unless the peer key (or an API key)
    comes with it: left open, anyone could hold every slot. A single replica holds on no peer,
    so without API keys it needs none (nor the master). Behind API keys, one whatever the
    replicas: the replicas never send each other a client's key, and operational readers may
    read /status with it instead of one. No autoscaler scales the gateway: its replicas are the
    spec's, so the pass that scales it to two also mounts the key, in the same Deployment
    write."""
    gateway = dm.spec.gateway
    return gateway.api_key_secret_ref is not None or gateway.replicas > 1


def peer_key_secret(dm: DisaggregatedModel, key: str) -> dict[str, Any]:
    # `data`, not `stringData`: the API server stores `data`, so applying the same key again
    # changes nothing and is not written (the controller applies it every pass, unread).
    encoded = base64.b64encode(key.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(dm, Component.gateway, peer_key_secret_name(dm.name)),
        "type": "Opaque",
        "data": {PEER_KEY_SECRET_KEY: encoded},
    }


def peer_key_digest(key: str) -> str:
    """What the gateway pod template carries so that a new key rolls the replicas (each reads
    the file once, at start-up). Domain-separated and cut short: it identifies a key, and a
    generated 256-bit key cannot be recovered from it."""
    return hashlib.sha256(b"pdserve-peer-key\0" + key.encode()).hexdigest()[:16]
