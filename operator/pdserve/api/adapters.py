"""`spec.model.adapters` and `spec.model.lora`: LoRA adapters served beside the base model, each
under its own name in the OpenAI `model` field, and vLLM's LoRA capacity flags.

The adapters are part of the parity set (engine scope): a prefill and a decode engine combined in
one request must hold the same adapter from the same source, or the KV a prefill made under
adapter A is decoded under B. vLLM's NIXL connector does not check it (its kv_transfer_params
carry block ids only), so the operator and the gateway do."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.vllm.lora import DEFAULT_MAX_LORA_RANK, LORA_RANKS

LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # LORA_RANKS, as a schema enum
# Adapters batched together by default (vLLM's own default is 1: every batch would hold one
# adapter's requests only); each slot reserves GPU memory for a maxRank adapter.
DEFAULT_MAX_LORAS = 4
# Where every engine pod finds adapter <name>: the same path on every pod, because vLLM's prefix
# cache keys blocks by the adapter's path (v1/core/kv_cache_utils.py), so pods that mounted one
# adapter at different paths would never share a prefix hash.
ADAPTERS_DIR = "/pdserve/adapters"
# An adapter's name is a directory name under ADAPTERS_DIR and the OpenAI `model` clients send.
ADAPTER_NAME = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$"


class HfAdapterSource(ApiModel):
    """An adapter on the Hugging Face Hub, downloaded by each engine pod before vLLM starts (an
    init container; the model's tokenSecretRef is its token)."""

    repo: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s/]+/[^\s/]+$")]
    """The Hub repository, owner/name (e.g. org/sql-lora)."""
    revision: Annotated[str, Field(min_length=1, max_length=256)]
    """The commit (or tag) to download. Required: a branch moves, so pods started at different
    times would hold different adapters under one name. A commit hash pins it."""


class PvcAdapterSource(ApiModel):
    """An adapter in a PersistentVolumeClaim, mounted read-only into every engine pod."""

    claim_name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany for several pods)."""
    path: Annotated[str, Field(pattern=r"^[^/].*$")] = "."
    """The adapter's directory inside the claim (adapter_config.json and its weights), relative
    to its root."""


def _one_adapter_source(adapter: LoraAdapter) -> str | None:
    if (adapter.hf is None) == (adapter.pvc is None):
        return f"spec.model.adapters[{adapter.name}]: set exactly one of hf and pvc"
    return None


ONE_ADAPTER_SOURCE = CrossFieldRule(
    "has(self.hf) != has(self.pvc)",
    "set exactly one of hf and pvc",
    None,
    _one_adapter_source,
)


class LoraAdapter(ApiModel):
    """A LoRA adapter for the model: clients ask for it by name in the OpenAI `model` field."""

    model_config = with_rules([ONE_ADAPTER_SOURCE])

    name: Annotated[str, Field(pattern=ADAPTER_NAME)]
    """The name clients send as `model` (letters, digits, `.`, `_`, `-`; at most 64; not the
    served model's name). vLLM's /v1/models lists it with the served model as its parent."""
    hf: HfAdapterSource | None = None
    """Download it from the Hugging Face Hub."""
    pvc: PvcAdapterSource | None = None
    """Mount it from a PersistentVolumeClaim."""
    rank: Annotated[int, Field(ge=1, le=max(LORA_RANKS))] | None = None
    """The adapter's LoRA rank (`r` in its adapter_config.json), when known: checked against
    spec.model.lora.maxRank here, instead of an engine failing to start."""

    @property
    def path(self) -> str:
        """Where every engine pod finds it."""
        return f"{ADAPTERS_DIR}/{self.name}"


class LoraSpec(ApiModel):
    """vLLM's LoRA capacity, the same on every engine (used only when spec.model.adapters is
    set)."""

    max_rank: LoraRank | None = None
    """--max-lora-rank: the highest adapter rank the engines accept. Default: the smallest of
    vLLM's choices that holds every adapter's declared rank, else vLLM's default (16)."""
    max_loras: Annotated[int, Field(ge=1, le=64)] | None = None
    """--max-loras: adapters served in one batch; each reserves GPU memory for a maxRank adapter.
    Default: the number of adapters, at most 4."""
    max_cpu_loras: Annotated[int, Field(ge=1, le=1024)] | None = None
    """--max-cpu-loras: adapters kept in CPU memory, at least maxLoras. Default: every
    adapter."""


def max_rank(adapters: list[LoraAdapter], lora: LoraSpec) -> int | None:
    """The engines' --max-lora-rank: as set, else the smallest choice holding every declared
    rank; None: vLLM's default."""
    if lora.max_rank is not None:
        return lora.max_rank
    declared = [a.rank for a in adapters if a.rank is not None]
    if not declared or max(declared) <= DEFAULT_MAX_LORA_RANK:
        return None
    return min(r for r in LORA_RANKS if r >= max(declared))


def max_loras(adapters: list[LoraAdapter], lora: LoraSpec) -> int:
    return lora.max_loras if lora.max_loras is not None else min(len(adapters), DEFAULT_MAX_LORAS)


def max_cpu_loras(adapters: list[LoraAdapter], lora: LoraSpec) -> int:
    return lora.max_cpu_loras if lora.max_cpu_loras is not None else len(adapters)


def adapter_problems(adapters: list[LoraAdapter], lora: LoraSpec) -> list[str]:
    """What in spec.model.adapters and spec.model.lora vLLM would refuse at start (it exits),
    each naming the field and the fix."""
    problems: list[str] = []
    limit = max_rank(adapters, lora) or DEFAULT_MAX_LORA_RANK
    seen: set[str] = set()
    for index, adapter in enumerate(adapters):
        if adapter.name in seen:
            problems.append(
                f"spec.model.adapters[{index}].name {adapter.name!r} is declared twice: a request "
                "names one adapter; remove or rename one"
            )
        seen.add(adapter.name)
        if adapter.rank is not None and adapter.rank > limit:
            problems.append(
                f"spec.model.adapters[{index}].rank {adapter.rank} is above "
                f"spec.model.lora.maxRank {limit}: vLLM refuses the adapter; raise maxRank to "
                f"one of {', '.join(str(r) for r in LORA_RANKS if r >= adapter.rank)}"
            )
    if adapters and max_cpu_loras(adapters, lora) < max_loras(adapters, lora):
        problems.append(
            f"spec.model.lora.maxCpuLoras {max_cpu_loras(adapters, lora)} is below maxLoras "
            f"{max_loras(adapters, lora)}: vLLM exits at start; raise maxCpuLoras or lower "
            "maxLoras"
        )
    if not adapters and lora != LoraSpec():
        problems.append(
            "spec.model.lora is set but spec.model.adapters is empty: the engines run without "
            "LoRA; declare the adapters, or remove spec.model.lora"
        )
    return problems


def served_name_clash(adapters: list[LoraAdapter], served: str) -> list[str]:
    """An adapter named as the served model: vLLM would serve its requests with the base."""
    return [
        f"spec.model.adapters[{index}].name {adapter.name!r} is the served model's name "
        "(spec.model.servedModelName, else metadata.name): its requests would get the base "
        "model; name the adapter otherwise"
        for index, adapter in enumerate(adapters)
        if adapter.name == served
    ]


def lora_modules(adapters: list[LoraAdapter]) -> list[dict[str, str]] | None:
    """--lora-modules' entries, in vLLM's JSON form (its `name=path` form is read as JSON when
    the path holds a comma); /v1/models names the served model as each one's parent."""
    if not adapters:
        return None
    return [{"name": a.name, "path": a.path} for a in adapters]


def adapters_hashed(adapters: list[LoraAdapter]) -> list[JsonValue] | None:
    """The adapters in the parity set: name and source (repository and revision, or claim and
    path), in the order declared; None (left out of the set) when there are none, so models
    without adapters keep the hash they had."""
    if not adapters:
        return None
    return [a.to_json() for a in adapters]
