"""A multi-node replica (a LeaderWorkerSet group) takes requests only while every pod of its group
is Ready: its vLLM ranks step together, so a pod whose group is short of a rank is kept out of
routing; pods of no group are routed as before."""

from __future__ import annotations

from typing import Any, cast

from pdserve.contract.groups import whole_groups
from pdserve.contract.names import (
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    LWS_SIZE_ANNOTATION,
)
from pdserve.gateway.discovery import PodDiscovery, pod_ready
from pdserve.gateway.endpoints import Endpoints
from pdserve.kube.client import Kube
from tests.support.gateway_fakes import config


def pod(name: str, pool: str, *, ready: bool, group: str | None = None) -> dict[str, Any]:
    labels = {"c": pool}
    annotations = {}
    if group is not None:
        labels |= {LWS_NAME_LABEL: f"m-{pool}", LWS_GROUP_INDEX_LABEL: group}
        annotations[LWS_SIZE_ANNOTATION] = "2"
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "status": {"podIP": f"10.0.{len(name)}.{ord(name[-1])}",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def discovery() -> tuple[PodDiscovery, Endpoints]:
    cfg = config()
    pools = {"prefill": {"service": "p", "port": 8000, "selector": {"c": "prefill"}},
             "decode": {"service": "d", "port": 8000, "selector": {"c": "decode"}}}  # fmt: skip
    discovered = type(cfg).model_validate({"model": "m", "pools": pools})
    endpoints = Endpoints(discovered)
    return PodDiscovery(cast(Kube, None), discovered, endpoints), endpoints


def names(endpoints: Endpoints, pool: str) -> set[str]:
    return {e.name or "" for e in endpoints.pools[pool]}


def test_a_group_is_routed_only_while_every_pod_of_it_is_ready() -> None:
    found, endpoints = discovery()
    found.pods = {
        "m-decode-0": pod("m-decode-0", "decode", ready=True, group="0"),
        "m-decode-0-1": pod("m-decode-0-1", "decode", ready=False, group="0"),
        "m-decode-1": pod("m-decode-1", "decode", ready=True, group="1"),
        "m-decode-1-1": pod("m-decode-1-1", "decode", ready=True, group="1"),
        "m-prefill-0": pod("m-prefill-0", "prefill", ready=True),  # a single-node pool
    }
    found.publish()
    assert names(endpoints, "decode") == {"m-decode-1", "m-decode-1-1"}
    assert names(endpoints, "prefill") == {"m-prefill-0"}
    found.pods["m-decode-0-1"] = pod("m-decode-0-1", "decode", ready=True, group="0")
    found.publish()
    assert names(endpoints, "decode") == {"m-decode-0", "m-decode-0-1", "m-decode-1",
                                          "m-decode-1-1"}  # fmt: skip
    del found.pods["m-decode-1-1"]  # a worker gone: LWS recreates the group
    found.publish()
    assert names(endpoints, "decode") == {"m-decode-0", "m-decode-0-1"}


def test_whole_groups_counts_against_each_groups_own_size() -> None:
    pods = [pod("a-0", "decode", ready=True, group="0"), pod("a-0-1", "decode", ready=True,
                                                             group="0")]  # fmt: skip
    assert whole_groups(pods, pod_ready) == {("m-decode", "0")}
    pods[1]["metadata"]["annotations"][LWS_SIZE_ANNOTATION] = "3"
    assert whole_groups(pods, pod_ready) == set()
