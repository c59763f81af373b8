"""vLLM flags and environment variables a pool's extraArgs and env may not set: the parity knobs
(set once, in spec.serving or spec.model; PARITY_FLAGS and PARITY_ENV in api/spec.py) and what
the operator derives from other fields."""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.api.common import EnvVar
from pdserve.vllm.lora import SKIP_MODEL_NAME_CHECK

MULTI_NODE_FLAGS = (
    "--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-rank",
    "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb", "--data-parallel-multi-port-external-lb", "--nnodes",
    "--node-rank", "--headless",
)  # fmt: skip
# Flags and env the operator derives from other fields; setting them twice would silently fight.
OWNED_FLAGS: dict[str, str] = {
    "--model": "spec.model.name",
    "--served-model-name": "spec.model.servedModelName",
    "--max-model-len": "spec.model.maxModelLen",
    "--port": "the operator (engines listen on 8000)",
    "--host": "the operator",
    "--tokens-only": "spec.render.engineApi (TokensOnly)",
    "--enable-scale-out": "spec.render.engineApi (ScaleOut)",
    "--kv-transfer-config": "spec.kvTransfer",
    "--tensor-parallel-size": "spec.<pool>.tensorParallelSize",
    "--data-parallel-size": "spec.<pool>.dataParallelSize",
    "--gpu-memory-utilization": "spec.<pool>.gpuMemoryUtilization",
    "--enable-chunked-prefill": "spec.<pool>.scheduler.enableChunkedPrefill",
    "--max-num-batched-tokens": "spec.<pool>.scheduler.maxNumBatchedTokens",
    "--max-num-seqs": "spec.<pool>.scheduler.maxNumSeqs",
    "--long-prefill-token-threshold": "spec.<pool>.scheduler.longPrefillTokenThreshold",
    "--renderer-num-workers": "spec.render.workers",
    "--shutdown-timeout": "spec.<pool>.shutdownTimeoutSeconds",
    # LoRA: on with spec.model.adapters (their --lora-modules is a parity flag).
    "--enable-lora": "spec.model.adapters",
    "--max-lora-rank": "spec.model.lora.maxRank",
    "--max-loras": "spec.model.lora.maxLoras",
    "--max-cpu-loras": "spec.model.lora.maxCpuLoras",
    # Multi-node wiring: derived from nodesPerReplica and the LeaderWorkerSet's env.
    **dict.fromkeys(MULTI_NODE_FLAGS, "spec.<pool>.nodesPerReplica"),
}
# Owned only when spec.<pool>.expertParallel is set: single-node pools may still pass them in
# extraArgs as before it existed. Dotted forms (--eplb-config.num_redundant_experts) included.
EXPERT_PARALLEL_FLAGS: dict[str, str] = {
    "--enable-expert-parallel": "spec.<pool>.expertParallel",
    "--all2all-backend": "spec.<pool>.expertParallel.all2allBackend",
    "--enable-eplb": "spec.<pool>.expertParallel.loadBalancer",
    "--eplb-config": "spec.<pool>.expertParallel.loadBalancer",
}
OWNED_ENV: dict[str, str] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the operator (the pod IP)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "spec.kvTransfer.sideChannelPort",
    "UCX_NET_DEVICES": "spec.kvTransfer.ucxNetDevices",
    "UCX_TLS": "spec.kvTransfer.ucxTransports",
    "HF_TOKEN": "spec.model.source.hf.tokenSecretRef",
    # Set on the render pods with adapters (builders/render.py); on an engine, a misspelt model
    # name would be served silently by the base model.
    SKIP_MODEL_NAME_CHECK: "spec.model.adapters (the render pods get it)",
}


def normalize_flag(arg: str) -> str | None:
    """`--Tool_Call_Parser=x` -> `--tool-call-parser`; `--no-enable-x` -> `--enable-x`;
    None for values and short options."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].lower().replace("_", "-")
    if name.startswith("--no-"):
        name = "--" + name[len("--no-") :]
    return name


def check_extra_args(pool: str, args: list[str], parity_flags: Mapping[str, str]) -> None:
    """Refuse extraArgs that set a parity flag (flag -> the field to set instead) or a flag the
    operator owns, naming both."""
    for index, arg in enumerate(args):
        flag = normalize_flag(arg)
        if flag is not None and flag in parity_flags:
            raise ValueError(
                f"spec.{pool}.extraArgs[{index}] sets parity flag {flag}: it must be identical "
                f"in every pool, so set it once in {parity_flags[flag]}"
            )
        if flag in OWNED_FLAGS:
            # The render pool has none of the engine pools' fields: name where they live.
            engine_field = "{prefill,decode}" if pool == "render" else pool
            owner = OWNED_FLAGS[flag].replace("<pool>", engine_field)
            raise ValueError(
                f"spec.{pool}.extraArgs[{index}] sets {flag}, which is derived from {owner}; "
                "set it there instead"
            )


def check_env(pool: str, env: list[EnvVar], parity_env: Mapping[str, str]) -> None:
    """Refuse env that sets a parity variable (name -> the field to set instead) or one the
    operator derives."""
    for index, var in enumerate(env):
        if var.name in parity_env:
            raise ValueError(
                f"spec.{pool}.env[{index}] sets parity variable {var.name}: it must be identical "
                f"in every pool, so set it once in {parity_env[var.name]}"
            )
        if var.name in OWNED_ENV:
            raise ValueError(
                f"spec.{pool}.env[{index}] sets {var.name}, which is derived from "
                f"{OWNED_ENV[var.name]}; set it there instead"
            )


def check_expert_parallel_args(pool: str, args: list[str]) -> None:
    """With spec.<pool>.expertParallel set, refuse extraArgs that set what it derives."""
    for index, arg in enumerate(args):
        flag = normalize_flag(arg)
        owner = EXPERT_PARALLEL_FLAGS.get((flag or "").split(".", 1)[0])
        if owner is not None:
            raise ValueError(
                f"spec.{pool}.extraArgs[{index}] sets {flag}, which is derived from "
                f"{owner.replace('<pool>', pool)}; set it there instead"
            )
