"""Exact vLLM command lines: `vllm serve` for the engines, `vllm launch render` for the render pool
(the flags are in docs/reference/crd.md and docs/architecture.md, "Parity").

Text-side parity flags (tokenizer, chat template, parsers) go wherever text is handled: the
render pool, and the engines unless they run --tokens-only (spec.render.engineApi TokensOnly).
Engine-pair invariants (block size, KV cache dtype) go on every engine. Both come from the parity
knobs declared on the spec's fields (api/parity.py), in declaration order."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pdserve.api import PARITY_KNOBS, DisaggregatedModel, EnginePoolSpec
from pdserve.api.adapters import max_cpu_loras, max_loras, max_rank
from pdserve.api.kv_transfer import NIXL_CONNECTORS
from pdserve.api.parity import ParityKnob, Render, Scope
from pdserve.api.render import EngineApi
from pdserve.builders.parity import canonical_json
from pdserve.contract.names import DATA_PARALLEL_RPC_PORT
from pdserve.contract.pod_layout import CHAT_TEMPLATE_DIR, MODEL_MOUNT

CHAT_TEMPLATE_FILE = "template.jinja"
# Set in every container of a LeaderWorkerSet group by LWS's pod webhook; the kubelet expands
# $(NAME) in args from the container's env.
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"


def model_argument(dm: DisaggregatedModel) -> str:
    pvc = dm.spec.model.source.pvc
    if pvc is None:
        return dm.spec.model.name
    return MODEL_MOUNT if pvc.path in (".", "") else f"{MODEL_MOUNT}/{pvc.path.rstrip('/')}"


def knob_args(knob: ParityKnob, value: Any) -> list[str]:
    """A parity knob's flag with its value, as its declaration says to render it."""
    flag = knob.flag
    if flag is None:
        return []
    if knob.parity.render is Render.switch:
        return [flag] if value else []
    if value is None:
        return []
    if knob.parity.render is Render.json:
        return [flag, canonical_json(value)]
    if knob.parity.render is Render.json_each:
        return [flag, *(canonical_json(item) for item in value)]
    if knob.parity.render is Render.chat_template_file:
        return [flag, f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_FILE}"]
    return [flag, str(value.value if isinstance(value, Enum) else value)]


def parity_flags(dm: DisaggregatedModel, scope: Scope) -> list[str]:
    """The flags of the parity knobs that go to `scope`."""
    args: list[str] = []
    for knob in PARITY_KNOBS:
        if knob.flag is not None and knob.parity.scope is scope:
            args += knob_args(knob, knob.value(dm.spec))
    return args


def model_flags(dm: DisaggregatedModel, port: int) -> list[str]:
    model = dm.spec.model
    args = [model_argument(dm), "--port", str(port), "--served-model-name", dm.served_model_name]
    args += parity_flags(dm, Scope.every_pool)
    if model.max_model_len:
        args += ["--max-model-len", str(model.max_model_len)]
    return args


def text_parity_flags(dm: DisaggregatedModel) -> list[str]:
    return parity_flags(dm, Scope.text)


def engine_pair_flags(dm: DisaggregatedModel) -> list[str]:
    return parity_flags(dm, Scope.engines)


def pool_flags(pool: EnginePoolSpec) -> list[str]:
    args = [
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--data-parallel-size", str(pool.data_parallel_size),
        "--gpu-memory-utilization", f"{pool.gpu_memory_utilization:g}",
        # Always written: vLLM's default, 0, aborts every request in flight on SIGTERM.
        "--shutdown-timeout", str(pool.shutdown_timeout_seconds),
    ]  # fmt: skip
    args += multi_node_flags(pool) + expert_parallel_flags(pool)
    scheduler = pool.scheduler
    if scheduler.enable_chunked_prefill is not None:
        args.append(
            "--enable-chunked-prefill" if scheduler.enable_chunked_prefill
            else "--no-enable-chunked-prefill"
        )  # fmt: skip
    if scheduler.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(scheduler.max_num_batched_tokens)]
    if scheduler.max_num_seqs is not None:
        args += ["--max-num-seqs", str(scheduler.max_num_seqs)]
    if scheduler.long_prefill_token_threshold is not None:
        args += ["--long-prefill-token-threshold", str(scheduler.long_prefill_token_threshold)]
    return args


def multi_node_flags(pool: EnginePoolSpec) -> list[str]:
    """A replica over nodesPerReplica pods in hybrid load balancing: every pod serves HTTP for
    its own dataParallelSize / nodesPerReplica ranks; vLLM derives the local size and the start
    rank from --nnodes and --node-rank (the LWS worker index); rank 0's pod (the group's
    leader) coordinates (docs/design/multinode.md)."""
    if not pool.multi_node:
        return []
    return [
        "--nnodes", str(pool.nodes_per_replica),
        "--node-rank", f"$({LWS_WORKER_INDEX})",
        "--data-parallel-hybrid-lb",
        "--data-parallel-address", f"$({LWS_LEADER_ADDRESS})",
        "--data-parallel-rpc-port", str(DATA_PARALLEL_RPC_PORT),
    ]  # fmt: skip


def expert_parallel_flags(pool: EnginePoolSpec) -> list[str]:
    expert = pool.expert_parallel
    if expert is None:
        return []
    args = ["--enable-expert-parallel"]
    if expert.all2all_backend is not None:
        args += ["--all2all-backend", expert.all2all_backend.value]
    if expert.load_balancer is not None:
        config = {"num_redundant_experts": expert.load_balancer.num_redundant_experts}
        args += ["--enable-eplb", "--eplb-config", canonical_json(config)]
    return args


def kv_transfer_config(dm: DisaggregatedModel, role: str) -> dict[str, Any]:
    """--kv-transfer-config for one side: role is kv_producer (prefill) or kv_consumer (decode)."""
    kv = dm.spec.kv_transfer
    extra: dict[str, Any] = dict(kv.extra_config)
    config: dict[str, Any] = {"kv_connector": kv.connector.value, "kv_role": role}
    if kv.kv_buffer_device is not None:
        config["kv_buffer_device"] = kv.kv_buffer_device.value
    if kv.connector in NIXL_CONNECTORS:
        if kv.load_failure_policy is not None:
            config["kv_load_failure_policy"] = kv.load_failure_policy
        if kv.lease_duration_seconds is not None:
            extra["kv_lease_duration"] = kv.lease_duration_seconds
        if kv.bidirectional:
            extra["bidirectional_kv_xfer"] = True
            # Always set: vLLM's own default (480 s) holds every P/D answer's KV far too long.
            extra["decoder_kv_blocks_ttl"] = kv.decode_blocks_ttl
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def lora_flags(dm: DisaggregatedModel) -> list[str]:
    """vLLM's LoRA switch and capacity, with adapters (their --lora-modules is a parity knob)."""
    model = dm.spec.model
    if not model.adapters:
        return []
    args = ["--enable-lora"]
    rank = max_rank(model.adapters, model.lora)
    if rank is not None:
        args += ["--max-lora-rank", str(rank)]
    args += ["--max-loras", str(max_loras(model.adapters, model.lora))]
    return [*args, "--max-cpu-loras", str(max_cpu_loras(model.adapters, model.lora))]


def engine_args(
    dm: DisaggregatedModel, pool: EnginePoolSpec, role: str | None, port: int
) -> list[str]:
    """`vllm serve` arguments; role None means aggregated serving (no KV transfer)."""
    args = model_flags(dm, port) + pool_flags(pool) + engine_pair_flags(dm) + lora_flags(dm)
    render = dm.spec.render
    if render.enabled and render.engine_api is EngineApi.tokens_only:
        args.append("--tokens-only")  # no tokenizer: text is the render pool's alone
    else:
        if render.enabled:
            # The scale-out generate API, on an engine that loads the tokenizer (stop strings,
            # structured outputs): it handles text too, so it gets the text parity flags.
            args.append("--enable-scale-out")
        args += text_parity_flags(dm)
    if role is not None:
        args += ["--kv-transfer-config", canonical_json(kv_transfer_config(dm, role))]
    return args + list(pool.extra_args)


def render_args(dm: DisaggregatedModel, port: int) -> list[str]:
    """`vllm launch render` arguments."""
    render = dm.spec.render
    args = [*model_flags(dm, port), "--renderer-num-workers", str(render.worker_count)]
    return args + text_parity_flags(dm) + list(render.extra_args)
