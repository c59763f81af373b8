"""The gateways' peer key, generated once: a pass reuses the key its Secret already holds and
makes a new one only when there is none (first pass, Secret deleted, key emptied). The key is
never logged and never written into status or an Event."""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders import wants_peer_key
from pdserve.contract.names import PEER_KEY_SECRET_KEY, peer_key_secret_name
from pdserve.controller.children import ChildKey
from pdserve.kube.client import KINDS

SECRET = KINDS[("v1", "Secret")]
KEY_BYTES = 32  # 256 bits, as URL-safe text: no newline or padding for the key file to trip on


def secret_key(dm: DisaggregatedModel) -> ChildKey:
    return SECRET.api_version, SECRET.kind, peer_key_secret_name(dm.name)


def stored_key(secret: Mapping[str, Any] | None) -> str | None:
    """The key a live Secret holds, as the gateway would read it; None when it holds nothing
    usable (the gateway would refuse to start on it): then a new key replaces it."""
    if secret is None:
        return None
    encoded = (secret.get("data") or {}).get(PEER_KEY_SECRET_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        text = base64.b64decode(encoded, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    # Kept as written (a key set by hand, several lines while rotating), so it is not rewritten.
    return text if text.strip() else None


def peer_key(dm: DisaggregatedModel, live: Mapping[ChildKey, Mapping[str, Any]]) -> str | None:
    """The key the model's gateways use; None when the model wants none (its Secret, if any,
    is then pruned). `live`: the model's children as listed this pass."""
    if not wants_peer_key(dm):
        return None
    existing = stored_key(live.get(secret_key(dm)))
    return existing if existing is not None else secrets.token_urlsafe(KEY_BYTES)
