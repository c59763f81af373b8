"""The harness that runs the operator's pods as processes (tests/support/operator_commands.py)
reads a multi-node pool as LWS and the kubelet would start it: one command per worker, the
operator's arguments unchanged but for the `$(LWS_*)` references the kubelet expands, and on
this host the ports one process needs. Real vLLM cannot serve this pool on the CPU
(docs/design/multinode.md "What can run on CPU here"); the lines are pinned here."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all
from pdserve.builders.leaderworkerset import pod_template_of
from tests.support.operator_commands import (
    LEADER_ADDRESS,
    OperatorCommandError,
    kubelet_expand,
    pod_commands,
)
from tests.support.real_vllm import tiny_cpu_engine, tiny_cpu_model

SHAPE = {"parametersBillions": 0.001, "layers": 2, "kvHeads": 1, "headDim": 64,
         "contextLength": 4096, "experts": 4}  # fmt: skip


def two_node_model() -> DisaggregatedModel:
    """Prefill over two pods of two data-parallel ranks each (a MoE model: the operator spans
    nodes only for those), decode on one pod."""
    return tiny_cpu_model("tiny-mn", "/models/tiny-moe", {
        "model": {"shape": SHAPE},
        "prefill": {**tiny_cpu_engine(one_process=False), "nodesPerReplica": 2,
                    "dataParallelSize": 4},
        "decode": tiny_cpu_engine(),
        "kvTransfer": {"kvBufferDevice": "cpu"},
    })  # fmt: skip


def template_args(dm: DisaggregatedModel) -> list[str]:
    [lws] = [o for o in build_all(dm) if o["kind"] == "LeaderWorkerSet"]
    [container] = pod_template_of(lws)["spec"]["containers"]
    return list(container["args"])


def test_each_worker_runs_the_operators_line_with_the_kubelets_expansion() -> None:
    dm = two_node_model()
    pods = pod_commands(dm)
    assert sorted(pods) == ["decode", "prefill-0", "prefill-1", "render"]
    template = template_args(dm)
    for worker in (0, 1):
        pod = pods[f"prefill-{worker}"]
        substituted = {"$(LWS_WORKER_INDEX)": str(worker), "$(LWS_LEADER_ADDRESS)": LEADER_ADDRESS}
        assert pod.args == [substituted.get(arg, arg) for arg in template]
        assert pod.worker == worker
        assert pod.env["LWS_WORKER_INDEX"] == str(worker)
        assert pod.env["LWS_GROUP_SIZE"] == "2"
    assert pods["decode"].worker is None


def test_a_worker_on_this_host_gets_its_port_and_the_groups_rpc_port() -> None:
    pod = pod_commands(two_node_model())["prefill-1"]
    argv, env = pod.on_host("/venv/bin/vllm", 8123, 5700, rpc_port=29999)
    flags = dict(pairwise(argv))
    assert flags["--port"] == "8123"
    assert flags["--data-parallel-rpc-port"] == "29999"
    assert (flags["--nnodes"], flags["--node-rank"]) == ("2", "1")
    assert flags["--data-parallel-address"] == LEADER_ADDRESS
    # One side-channel base for the whole group: NIXL adds the global rank (2, 3 on node 1).
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    with pytest.raises(OperatorCommandError, match="data-parallel-rpc-port"):
        pod.on_host("/venv/bin/vllm", 8123, 5700)


def test_kubelet_expansion_leaves_unknown_references_and_unescapes_dollars() -> None:
    env = {"A": "1"}
    assert kubelet_expand("$(A)-$(B)", env) == "1-$(B)"
    assert kubelet_expand("$$(A)", env) == "$(A)"
