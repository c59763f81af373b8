"""Parity drift: the parity flags, environment and hash of live workloads that differ from what
the spec says (a hand edit), which the next apply repairs and status reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.api import PARITY_ENV, PARITY_FLAGS
from pdserve.api.flags import normalize_flag
from pdserve.builders import Component
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.contract.names import COMPONENT_LABEL, PARITY_HASH_ANNOTATION
from pdserve.controller.children import ChildKey, describe, key_of


def _flag_values(args: list[str]) -> dict[str, str]:
    """Normalized flag -> its values, space-joined ("" for a bare switch; "false" for
    --no-<switch>)."""
    values: dict[str, str] = {}
    for index, arg in enumerate(args):
        flag = normalize_flag(arg)
        if flag is None:
            continue
        if "=" in arg:
            values[flag] = arg.split("=", 1)[1]
        elif arg.lower().startswith("--no-"):
            values[flag] = "false"
        else:
            # Every value up to the next flag: a list flag (--lora-modules a b) compares whole.
            end = index + 1
            while end < len(args) and not args[end].startswith("--"):
                end += 1
            values[flag] = " ".join(args[index + 1 : end])
    return values


def _container(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = pod_template_of(obj).get("spec", {}).get("containers", [])
    return containers[0] if containers else {}


def parity_drift(
    desired: list[dict[str, Any]], live: Mapping[ChildKey, Mapping[str, Any]]
) -> list[str]:
    """Parity flags, env and hashes of live workloads that differ from what the spec says."""
    found: list[str] = []
    for want in desired:
        if want["kind"] not in ("StatefulSet", "LeaderWorkerSet", "Deployment"):
            continue
        have = live.get(key_of(want))
        component = want["metadata"]["labels"].get(COMPONENT_LABEL)
        if have is None or component == Component.gateway.value:
            continue
        where = f"{component} {describe(want)}"
        wanted_flags = _flag_values(list(_container(want).get("args", [])))
        live_flags = _flag_values(list(_container(have).get("args", [])))
        for flag in sorted(PARITY_FLAGS):
            if wanted_flags.get(flag) != live_flags.get(flag):
                found.append(
                    f"{where}: {flag} is {live_flags.get(flag)!r}, spec says "
                    f"{wanted_flags.get(flag)!r}"
                )
        wanted_env = {e["name"]: e.get("value") for e in _container(want).get("env", [])}
        live_env = {e["name"]: e.get("value") for e in _container(have).get("env", [])}
        for name in sorted(PARITY_ENV):
            if wanted_env.get(name) != live_env.get(name):
                found.append(
                    f"{where}: {name} is {live_env.get(name)!r}, spec says {wanted_env.get(name)!r}"
                )
        want_hash = pod_template_of(want)["metadata"]["annotations"][PARITY_HASH_ANNOTATION]
        have_meta = pod_template_of(have).get("metadata", {})
        have_hash = have_meta.get("annotations", {}).get(PARITY_HASH_ANNOTATION)
        if have_hash != want_hash and not found:
            found.append(
                f"{where}: pod template parity hash is {have_hash!r}, spec says {want_hash!r}"
            )
    return found
