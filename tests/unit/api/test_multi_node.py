"""Replicas that span nodes (nodesPerReplica) and expert parallelism: what the API accepts and
what it refuses, each refusal naming the field and the fix."""

from __future__ import annotations

from typing import Any

from pdserve.api import parse_resource
from tests.unit.api.test_api import problems, resource

MOE = {"name": "deepseek-ai/DeepSeek-R1-0528"}  # no shape known: not judged
GB200 = {"gpuProducts": ["NVIDIA-GB200"]}


def wide(decode: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return resource(model=MOE, prefill={"replicas": 1}, decode=decode, **spec)


def test_a_replica_over_four_trays_runs_four_ranks_per_pod() -> None:
    decode = {"nodesPerReplica": 4, "dataParallelSize": 16, "expertParallel": {}}
    pool = parse_resource(wide(decode, placement=GB200)).spec.decode
    assert (pool.multi_node, pool.local_data_parallel_size, pool.gpus) == (True, 4, 4)


def test_one_rank_per_node_is_refused_with_the_sizes_that_work() -> None:
    [problem] = problems(wide({"nodesPerReplica": 2, "dataParallelSize": 2}))
    assert problem.startswith("spec.decode: nodesPerReplica 2 with dataParallelSize 2:")
    assert problem.endswith("set dataParallelSize to 4, or nodesPerReplica 1")


def test_ranks_that_do_not_divide_over_the_nodes_are_refused() -> None:
    [problem] = problems(wide({"nodesPerReplica": 4, "dataParallelSize": 10}))
    assert "must be a multiple of 4" in problem
    assert problem.endswith("set dataParallelSize to 12, or nodesPerReplica to a divisor of 10 "
                            "at most 5")  # fmt: skip


def test_a_pod_still_has_to_fit_one_node() -> None:
    decode = {"nodesPerReplica": 2, "dataParallelSize": 8, "tensorParallelSize": 2}
    [problem] = problems(wide(decode, placement=GB200))
    assert problem.startswith(
        "spec.decode: tensorParallelSize 2 x dataParallelSize 8 / nodesPerReplica 2 = 8 GPUs in "
        "one pod, but every NVIDIA-GB200 node has 4"
    )
    assert "raise spec.decode.nodesPerReplica for a MoE model" in problem


def test_a_known_dense_model_is_refused_a_multi_node_replica_and_expert_parallelism() -> None:
    dense = {"name": "meta-llama/Llama-3.1-70B-Instruct"}
    [spanning] = problems(resource(model=dense, decode={"nodesPerReplica": 2,
                                                        "dataParallelSize": 4}))  # fmt: skip
    assert spanning.startswith(
        "spec.decode.nodesPerReplica 2: meta-llama/Llama-3.1-70B-Instruct is a dense model "
        "(spec.model.shape.experts 0)"
    )
    assert spanning.endswith("Set nodesPerReplica 1 and raise spec.decode.replicas instead")
    [experts] = problems(resource(model=dense, decode={"expertParallel": {}}))
    assert experts.startswith("spec.decode.expertParallel: meta-llama/Llama-3.1-70B-Instruct is a "
                              "dense model")  # fmt: skip


def test_a_shape_given_with_experts_is_served_across_nodes() -> None:
    shape = {"parametersBillions": 30.5, "layers": 48, "kvHeads": 4, "headDim": 128,
             "contextLength": 40960, "experts": 128}  # fmt: skip
    model = {"name": "Qwen/Qwen3-30B-A3B", "shape": shape}
    decode = {"nodesPerReplica": 2, "dataParallelSize": 4, "expertParallel": {}}
    assert parse_resource(resource(model=model, decode=decode)).spec.decode.multi_node


def test_the_multi_node_wiring_is_the_operators_and_refused_in_extra_args() -> None:
    [problem] = problems(wide({"extraArgs": ["--node-rank", "1"]}))
    assert problem == (
        "spec.decode.extraArgs[0] sets --node-rank, which is derived from "
        "spec.decode.nodesPerReplica; set it there instead"
    )


def test_expert_flags_in_extra_args_are_refused_only_beside_expert_parallel() -> None:
    args = ["--enable-expert-parallel", "--eplb-config.num_redundant_experts", "32"]
    # Single-node pools that passed them before expertParallel existed keep working.
    assert parse_resource(wide({"extraArgs": args})).spec.decode.extra_args == args
    [problem] = problems(wide({"expertParallel": {}, "extraArgs": args[1:]}))
    assert problem == (
        "spec.decode.extraArgs[0] sets --eplb-config.num-redundant-experts, which is derived "
        "from spec.decode.expertParallel.loadBalancer; set it there instead"
    )


def test_every_global_ranks_side_channel_port_must_exist() -> None:
    decode = {"nodesPerReplica": 4, "dataParallelSize": 16}
    [problem] = problems(wide(decode, kvTransfer={"sideChannelPort": 65530}))
    assert "up to 65545 for spec.decode.dataParallelSize 16" in problem


def test_groups_without_a_domain_or_rdma_are_warned_of_and_gb200_without_imex_channels() -> None:
    from pdserve.api.advice import admission_warnings

    decode = {"nodesPerReplica": 2, "dataParallelSize": 16}
    h200 = parse_resource(wide(decode, placement={"gpuProducts": ["NVIDIA-H200"]})).spec
    [warning] = [w for w in admission_warnings(h200) if "nodesPerReplica" in w]
    assert warning.startswith("spec.decode.nodesPerReplica 2: a group's pods may land on any ")
    gb200 = parse_resource(wide({**decode, "dataParallelSize": 8}, placement=GB200)).spec
    [imex] = [w for w in admission_warnings(gb200) if "IMEX" in w]
    assert "spec.placement.resourceClaims" in imex


def test_groups_take_the_builtin_autoscaler_and_an_external_one() -> None:
    """Both count groups: the Builtin loop writes the LeaderWorkerSet's replicas, an HPA or
    KEDA scales it through /scale."""
    decode = {"nodesPerReplica": 2, "dataParallelSize": 8, "autoscaling": {"minReplicas": 1}}
    builtin = parse_resource(wide(decode, gateway={"slo": {"itlMs": 50}})).spec.decode
    assert builtin.autoscaling is not None
    assert builtin.autoscaling.engine.value == "Builtin"
    external = {**decode, "autoscaling": {"engine": "External", "minReplicas": 1}}
    assert parse_resource(wide(external)).spec.decode.autoscaling is not None
