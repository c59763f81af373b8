"""Exact vLLM command lines (../shared/reference/vllm-disagg-api.md).

Text-side parity flags (tokenizer, chat template, parsers) go wherever text is handled: the
render pool, or the engines themselves when there is no render pool. Engine-pair invariants
(block size, KV cache dtype) go on every engine. Both come from spec.serving only."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel, EnginePoolSpec
from pdserve.api.kv_transfer import NIXL_CONNECTORS
from pdserve.builders.parity import canonical_json

CHAT_TEMPLATE_DIR = "/etc/pdserve/chat-template"
CHAT_TEMPLATE_FILE = "template.jinja"
MODEL_MOUNT = "/models"


def model_argument(dm: DisaggregatedModel) -> str:
    pvc = dm.spec.model.source.pvc
    if pvc is None:
        return dm.spec.model.name
    return MODEL_MOUNT if pvc.path in (".", "") else f"{MODEL_MOUNT}/{pvc.path.rstrip('/')}"


def model_flags(dm: DisaggregatedModel, port: int) -> list[str]:
    model = dm.spec.model
    args = [model_argument(dm), "--port", str(port), "--served-model-name", dm.served_model_name]
    if model.revision:
        args += ["--revision", model.revision]
    if model.max_model_len:
        args += ["--max-model-len", str(model.max_model_len)]
    return args


def text_parity_flags(dm: DisaggregatedModel) -> list[str]:
    serving = dm.spec.serving
    args: list[str] = []
    if serving.tokenizer:
        args += ["--tokenizer", serving.tokenizer]
    if serving.tokenizer_revision:
        args += ["--tokenizer-revision", serving.tokenizer_revision]
    if serving.chat_template is not None:
        args += ["--chat-template", f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_FILE}"]
    if serving.default_chat_template_kwargs is not None:
        args += [
            "--default-chat-template-kwargs",
            canonical_json(serving.default_chat_template_kwargs),
        ]
    if serving.reasoning_parser:
        args += ["--reasoning-parser", serving.reasoning_parser]
    if serving.tool_call_parser:
        args += ["--tool-call-parser", serving.tool_call_parser]
    if serving.enable_auto_tool_choice:
        args.append("--enable-auto-tool-choice")
    return args


def engine_pair_flags(dm: DisaggregatedModel) -> list[str]:
    serving = dm.spec.serving
    return [
        "--block-size",
        str(serving.block_size),
        "--kv-cache-dtype",
        serving.kv_cache_dtype.value,
    ]


def pool_flags(pool: EnginePoolSpec) -> list[str]:
    args = [
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--data-parallel-size", str(pool.data_parallel_size),
        "--gpu-memory-utilization", f"{pool.gpu_memory_utilization:g}",
    ]  # fmt: skip
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


def kv_transfer_config(dm: DisaggregatedModel, role: str) -> dict[str, Any]:
    """--kv-transfer-config for one side: role is kv_producer (prefill) or kv_consumer (decode)."""
    kv = dm.spec.kv_transfer
    extra: dict[str, Any] = dict(kv.extra_config)
    config: dict[str, Any] = {"kv_connector": kv.connector.value, "kv_role": role}
    if kv.connector in NIXL_CONNECTORS:
        if kv.load_failure_policy is not None:
            config["kv_load_failure_policy"] = kv.load_failure_policy
        if kv.lease_duration_seconds is not None:
            extra["kv_lease_duration"] = kv.lease_duration_seconds
        if kv.bidirectional:
            extra["bidirectional_kv_xfer"] = True
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def engine_args(
    dm: DisaggregatedModel, pool: EnginePoolSpec, role: str | None, port: int
) -> list[str]:
    """`vllm serve` arguments; role None means aggregated serving (no KV transfer)."""
    args = model_flags(dm, port) + pool_flags(pool) + engine_pair_flags(dm)
    if dm.spec.render.enabled:
        args.append("--tokens-only")
    else:
        args += text_parity_flags(dm)
    if role is not None:
        args += ["--kv-transfer-config", canonical_json(kv_transfer_config(dm, role))]
    return args + list(pool.extra_args)


def render_args(dm: DisaggregatedModel, port: int) -> list[str]:
    """`vllm launch render` arguments."""
    render = dm.spec.render
    args = [*model_flags(dm, port), "--renderer-num-workers", str(render.worker_count)]
    return args + text_parity_flags(dm) + list(render.extra_args)
