"""Deciding whether a live child already holds what pdserve wants, without writing.

A child is current when (1) it carries the hash of the exact desired object pdserve last applied
(so a field pdserve stopped setting is removed by the next apply) and (2) every field pdserve sets
still has the desired value (so a hand edit is repaired). Fields the server or other controllers
add (defaults, HPA-owned replicas) are not pdserve's business."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

APPLIED_HASH_ANNOTATION = "pdserve.io/applied-hash"


def applied_hash(desired: Mapping[str, Any]) -> str:
    text = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def contains(live: Any, desired: Any) -> bool:
    """True when every value in `desired` appears in `live` (lists: same length, item by item)."""
    if isinstance(desired, Mapping):
        # The API server drops empty lists and maps (omitempty): absent equals empty.
        return isinstance(live, Mapping) and all(
            contains(live[key], value) if key in live else value in ([], {})
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(lv, dv) for lv, dv in zip(live, desired, strict=True))
        )
    return bool(live == desired)


def is_current(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    if live is None:
        return False
    stamp = live.get("metadata", {}).get("annotations", {}).get(APPLIED_HASH_ANNOTATION)
    wanted = desired["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
    return stamp == wanted and contains(live, desired)


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 patch turning `old` into `new` (keys that disappear become null)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch
