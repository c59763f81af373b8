"""The order in which prefill and decode roll onto a new KV-compatibility digest.

NIXL refuses transfers between engines of different digests (builders/kv_compat.py), and
StatefulSets roll each pool on its own, so an unordered engine upgrade can leave ready prefill
pods with no decode pod they can hand KV to. The operator holds each engine StatefulSet's
rollout with `updateStrategy.rollingUpdate.partition` (pods with an ordinal at or above it run
the new template) and moves the partitions in lockstep, from what the pods run:

- decode leads by one pod, never rolling its last old pod while an old prefill pod is left, so
  every old prefill keeps an old decode;
- prefill follows decode in the P:D ratio, and starts only once a new decode pod is ready, so
  every new prefill finds a new decode (one decode pod cannot lead: prefill rolls first, and the
  decode pod prefills locally meanwhile);
- a new pod that never gets ready stops the other pool's rollout, so a broken engine image
  leaves the old pairs serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolProgress:
    """One engine StatefulSet on its way to the digest the builders write."""

    replicas: int
    updated: int  # pods running the new digest, ready or not
    updated_ready: int

    @property
    def done(self) -> bool:
        return self.updated >= self.replicas


@dataclass(frozen=True)
class RolloutPlan:
    """The partition of each engine StatefulSet (by name) whose rollout is held, and what a
    user reads about it in the Progressing condition."""

    partitions: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def partition(self, statefulset: str) -> int:
        return self.partitions.get(statefulset, 0)


def updated_targets(prefill: PoolProgress, decode: PoolProgress) -> tuple[int, int]:
    """How many prefill and decode pods may run the new digest now."""
    p, d = prefill.replicas, decode.replicas
    if p == 0 or d == 0 or (prefill.done and decode.done):
        return p, d
    if prefill.updated_ready >= p:
        decode_target = d
    else:
        # One decode pod ahead of the ratio, keeping the last old one for the old prefill pods.
        decode_target = min(d - 1, math.floor(prefill.updated_ready * d / p) + 1)
    if decode.updated_ready >= d - 1:
        prefill_target = p  # decode has led as far as it may
    else:
        prefill_target = min(p, math.ceil(decode.updated_ready * p / d))
    return prefill_target, decode_target


def partitions(prefill: PoolProgress, decode: PoolProgress) -> tuple[int, int]:
    """(prefill, decode) partitions: pods with an ordinal at or above them may roll."""
    prefill_target, decode_target = updated_targets(prefill, decode)
    return max(0, prefill.replicas - prefill_target), max(0, decode.replicas - decode_target)
