"""The KV-compatibility digest of an engine pool (pdserve.io/kv-compat), stamped on its pods and
written into the routing config: the gateway hands a prefill's KV only to decode pods with the
same digest.

NIXL refuses a KV handshake between engines whose layout inputs differ (vLLM version, model,
dtype, parallelism, attention backend, block size, KV cache dtype, connector...). During an
engine upgrade prefill and decode roll separately, so the gateway must tell old pods from new
ones: the digest covers every such input the operator knows for the pool, and nothing that may
legitimately differ between prefill and decode (replicas, resources, scheduler knobs, GPU
memory share), so both roles of one spec get the same digest when their own inputs (dtype...)
match."""

from __future__ import annotations

import hashlib
from typing import Any

from pdserve.api import PARITY_KNOBS, DisaggregatedModel, EnginePoolSpec
from pdserve.api.parity import Scope, hashed_knobs
from pdserve.builders.parity import canonical_json
from pdserve.builders.vllm_args import kv_transfer_config, model_argument

# vLLM flags a pool may pass through extraArgs that change the KV cache's layout (what NIXL
# compares in its handshake): dtype, quantization, attention backend, pipeline stages, model
# config overrides and implementation. Other extraArgs (e.g. --enforce-eager) may differ
# between prefill and decode without breaking transfers, so they stay out.
KV_LAYOUT_FLAGS = (
    "--dtype",
    "--quantization",
    "--attention-backend",
    "--pipeline-parallel-size",
    "--hf-overrides",
    "--model-impl",
)
# Environment variables of a pool that choose the attention backend or the KV cache layout.
KV_LAYOUT_ENV = ("VLLM_ATTENTION_BACKEND", "VLLM_KV_CACHE_LAYOUT")


def flag_values(args: list[str], flags: tuple[str, ...]) -> dict[str, str]:
    """The value of each of `flags` in a command line (`--flag value` or `--flag=value`, names
    as vLLM's parser reads them: any case, `_` for `-`); the last one wins, as in argparse."""
    found: dict[str, str] = {}
    for index, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg.partition("=")
        name = name.lower().replace("_", "-")
        if name not in flags:
            continue
        if not equals:
            following = args[index + 1] if index + 1 < len(args) else ""
            value = "" if following.startswith("--") else following
        found[name] = value
    return found


def tensor_parallel_sizes(dm: DisaggregatedModel) -> dict[str, int]:
    """Both pools' tensor-parallel sizes, in both pools' digests. NIXL pairs engines of
    different TP sizes only in the ratios vLLM supports, and a spec may declare such a pair
    (prefill TP 2, decode TP 1): those engines must still pair, while a TP change on either
    side keeps the other side's older pods, a pairing no spec declared, apart from the new
    ones (it rolls both pools)."""
    spec = dm.spec
    sizes = {"decode": spec.decode.tensor_parallel_size}
    if spec.prefill is not None:
        sizes["prefill"] = spec.prefill.tensor_parallel_size
    return sizes


def kv_compat_set(dm: DisaggregatedModel, pool: EnginePoolSpec) -> dict[str, Any]:
    """Every input of NIXL's compatibility check the operator knows for `pool`'s engines."""
    spec = dm.spec
    # The role is the one thing the two sides' --kv-transfer-config must differ in.
    connector = kv_transfer_config(dm, "kv_producer")
    del connector["kv_role"]
    env = {
        var.name: var.value if var.value_from is None else var.value_from
        for var in pool.env
        if var.name in KV_LAYOUT_ENV
    }
    return {
        # As written, tag or digest included: the vLLM version comes with the image.
        "image": spec.image.engine,
        "model": {
            "name": spec.model.name,
            "argument": model_argument(dm),
            "revision": spec.model.revision,
        },
        # Engine-pair invariants (block size, KV cache dtype), from their parity declarations.
        "engines": hashed_knobs(PARITY_KNOBS, spec, None, Scope.engines),
        # The platform picks the attention backend (CPU engines use vLLM's CPU one).
        "accelerator": spec.placement.accelerator_resource,
        "tensorParallelSizes": tensor_parallel_sizes(dm),
        "kvTransfer": connector,
        "extraArgs": flag_values(list(pool.extra_args), KV_LAYOUT_FLAGS),
        "env": env,
    }


def kv_compat_digest(dm: DisaggregatedModel, pool: EnginePoolSpec) -> str:
    digest = hashlib.sha256(canonical_json(kv_compat_set(dm, pool)).encode())
    return digest.hexdigest()[:16]
