"""Prefill and decode rolling in step onto a new KV-compatibility digest: played pod by pod
against a StatefulSet controller that honours the partitions (one pod at a time per pool,
highest ordinal first), for several P:D shapes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.builders.rollout import PoolProgress, partitions


@dataclass
class Pool:
    """A StatefulSet's pods by ordinal: "old", "new" (ready) or "starting" (new, not ready)."""

    pods: list[str]

    def progress(self) -> PoolProgress:
        updated = [p for p in self.pods if p != "old"]
        return PoolProgress(len(self.pods), len(updated), updated.count("new"))

    def roll_one(self, partition: int, *, gets_ready: bool = True) -> bool:
        """The StatefulSet controller's next step: a starting pod gets ready (when its image
        works), else the highest old pod at or above the partition is replaced."""
        if "starting" in self.pods:
            if not gets_ready:
                return False
            self.pods[self.pods.index("starting")] = "new"
            return True
        for ordinal in reversed(range(partition, len(self.pods))):
            if self.pods[ordinal] == "old":
                self.pods[ordinal] = "starting"
                return True
        return False

    def ready(self, kind: str) -> int:
        return self.pods.count(kind)


def upgrade(
    p: int, d: int, *, decode_gets_ready: bool = True, prefill_gets_ready: bool = True
) -> list[tuple[list[str], list[str]]]:
    """Every state the two pools pass through, the operator recomputing the partitions after
    each step of either StatefulSet controller."""
    prefill, decode = Pool(["old"] * p), Pool(["old"] * d)
    states = [(list(prefill.pods), list(decode.pods))]
    for _ in range(4 * (p + d) + 4):
        prefill_partition, decode_partition = partitions(prefill.progress(), decode.progress())
        moved = decode.roll_one(decode_partition, gets_ready=decode_gets_ready)
        if not moved:
            prefill_partition, _ = partitions(prefill.progress(), decode.progress())
            moved = prefill.roll_one(prefill_partition, gets_ready=prefill_gets_ready)
        if not moved:
            break
        states.append((list(prefill.pods), list(decode.pods)))
    return states


SHAPES = [(2, 2), (4, 4), (4, 2), (2, 4), (3, 5), (1, 3), (6, 1), (1, 1)]


@pytest.mark.parametrize(("p", "d"), SHAPES)
def test_the_upgrade_completes(p: int, d: int) -> None:
    prefill, decode = upgrade(p, d)[-1]
    assert (prefill, decode) == (["new"] * p, ["new"] * d)


@pytest.mark.parametrize(("p", "d"), [s for s in SHAPES if s[1] > 1])
def test_every_ready_prefill_keeps_a_ready_decode_of_its_digest(p: int, d: int) -> None:
    for prefill, decode in upgrade(p, d):
        for digest in ("old", "new"):
            if digest in prefill:
                assert digest in decode, (prefill, decode)


@pytest.mark.parametrize(("p", "d"), [(4, 4), (2, 4), (3, 5)])
def test_the_pools_roll_in_the_p_to_d_ratio(p: int, d: int) -> None:
    for prefill, decode in upgrade(p, d):
        rolled_p = (p - prefill.count("old")) / p
        rolled_d = (d - decode.count("old")) / d
        # Each pool at most about one pod of either pool ahead of the other (rounding).
        assert abs(rolled_d - rolled_p) <= 1 / d + 1 / p + 1e-9, (prefill, decode)


def test_one_decode_pod_rolls_last_so_it_serves_while_prefill_rolls() -> None:
    states = upgrade(3, 1)
    first_decode_step = next(i for i, (_, decode) in enumerate(states) if decode != ["old"])
    prefill_then, _ = states[first_decode_step]
    assert prefill_then == ["new"] * 3


def test_a_decode_image_that_never_gets_ready_leaves_the_old_pairs_serving() -> None:
    prefill, decode = upgrade(4, 4, decode_gets_ready=False)[-1]
    assert prefill == ["old"] * 4
    assert decode == ["old"] * 3 + ["starting"]


def test_a_prefill_image_that_never_gets_ready_keeps_an_old_decode() -> None:
    prefill, decode = upgrade(2, 2, prefill_gets_ready=False)[-1]
    assert prefill == ["old", "starting"]
    assert decode == ["old", "new"]


def test_nothing_is_held_when_every_pod_runs_the_digest() -> None:
    assert partitions(PoolProgress(3, 3, 3), PoolProgress(2, 2, 2)) == (0, 0)
    assert partitions(PoolProgress(0, 0, 0), PoolProgress(2, 0, 0)) == (0, 0)
