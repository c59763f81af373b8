"""An engine image upgrade of a 2P2D model, reconciled pass by pass against an in-memory API
server whose StatefulSet controller honours the partitions: decode leads, prefill follows, the
last old decode pod waits for every prefill pod, and the model says so while it rolls."""

from __future__ import annotations

import copy

from pdserve.contract.names import KV_COMPAT_ANNOTATION
from tests.support.fakekube import NAME, NS, SPEC, FakeKube, model_in, one_pass, settled

TWO_BY_TWO = {**SPEC, "prefill": {"replicas": 2}, "decode": {"replicas": 2}}


def partition(kube: FakeKube, name: str) -> int:
    strategy = kube.objects[("StatefulSet", NS, name)]["spec"]["updateStrategy"]
    return int(strategy.get("rollingUpdate", {}).get("partition", 0))


def digests(kube: FakeKube, name: str) -> list[str]:
    replicas = kube.objects[("StatefulSet", NS, name)]["spec"]["replicas"]
    return [
        kube.objects[("Pod", NS, f"{name}-{i}")]["metadata"]["annotations"][KV_COMPAT_ANNOTATION]
        for i in range(replicas)
    ]


def statefulset_step(kube: FakeKube, name: str) -> bool:
    """The StatefulSet controller and kubelet: the highest pod at or above the partition that
    runs another template is replaced by a Ready pod of the current one."""
    workload = kube.objects[("StatefulSet", NS, name)]
    template = workload["spec"]["template"]["metadata"]
    wanted = template["annotations"][KV_COMPAT_ANNOTATION]
    for ordinal in reversed(range(partition(kube, name), workload["spec"]["replicas"])):
        pod = kube.objects[("Pod", NS, f"{name}-{ordinal}")]
        if pod["metadata"]["annotations"][KV_COMPAT_ANNOTATION] != wanted:
            pod["metadata"]["annotations"] = copy.deepcopy(template["annotations"])
            return True
    return False


def owned_pods(kube: FakeKube) -> None:
    """Engine pods as the StatefulSet controller makes them: owned by their StatefulSet."""
    for (kind, _, pod_name), pod in kube.objects.items():
        if kind == "Pod" and pod_name.rsplit("-", 1)[0] in ("qwen-prefill", "qwen-decode"):
            owner = pod_name.rsplit("-", 1)[0]
            pod["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "name": owner}]


async def test_an_engine_upgrade_rolls_decode_first_and_prefill_in_step() -> None:
    kube = FakeKube()
    model_in(kube, TWO_BY_TWO)
    await settled(kube)
    owned_pods(kube)
    old = digests(kube, "qwen-prefill")[0]
    model = kube.objects[("DisaggregatedModel", NS, NAME)]
    model["spec"] = {**TWO_BY_TWO, "image": {"engine": "registry.example/vllm-openai:next"}}
    model["metadata"]["generation"] = 2

    outcome = await one_pass(kube)
    # Decode may roll one pod; prefill waits for a ready decode pod of the new digest.
    assert (partition(kube, "qwen-prefill"), partition(kube, "qwen-decode")) == (2, 1)
    assert [e.reason for e in outcome.events].count("EngineRolloutStep") == 2
    assert outcome.status is not None
    progressing = next(c for c in outcome.status.conditions if c.type == "Progressing")
    assert "qwen-prefill holds 2 pod(s) on the old digest" in progressing.message
    assert not statefulset_step(kube, "qwen-prefill")  # held entirely

    assert statefulset_step(kube, "qwen-decode")
    new = digests(kube, "qwen-decode")[1]
    assert new != old
    await one_pass(kube)
    # One new decode pod ready: every prefill pod may roll; the last old decode pod serves the
    # old prefill pods until they are all gone.
    assert (partition(kube, "qwen-prefill"), partition(kube, "qwen-decode")) == (0, 1)
    assert statefulset_step(kube, "qwen-prefill")
    await one_pass(kube)
    assert partition(kube, "qwen-decode") == 1
    assert digests(kube, "qwen-prefill") == [old, new]
    assert statefulset_step(kube, "qwen-prefill")
    outcome = await one_pass(kube)
    assert partition(kube, "qwen-decode") == 0
    assert any("qwen-decode may roll every pod" in e.message for e in outcome.events)
    assert statefulset_step(kube, "qwen-decode")
    assert digests(kube, "qwen-decode") == [new, new]

    # Rolled out: nothing held, and the next pass writes nothing.
    outcome = await one_pass(kube)
    assert all(e.reason != "EngineRolloutStep" for e in outcome.events)
    writes = len(kube.writes)
    await one_pass(kube)
    assert len(kube.writes) == writes


async def test_a_model_without_an_upgrade_holds_nothing() -> None:
    kube = FakeKube()
    model_in(kube, TWO_BY_TWO)
    await settled(kube)
    owned_pods(kube)
    outcome = await one_pass(kube)
    assert (partition(kube, "qwen-prefill"), partition(kube, "qwen-decode")) == (0, 0)
    assert all(e.reason != "EngineRolloutStep" for e in outcome.events)
