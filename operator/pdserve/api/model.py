"""`spec.model`: the model being served and where its weights come from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field, JsonValue

from pdserve.api.adapters import LoraAdapter, LoraSpec, adapters_hashed, lora_modules
from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.common import SecretKeyRef
from pdserve.api.model_shape import ModelShape
from pdserve.api.parity import Parity, Render, Scope

if TYPE_CHECKING:
    from pdserve.api.spec import DisaggregatedModelSpec


def _lora_modules(spec: DisaggregatedModelSpec) -> list[dict[str, str]] | None:
    return lora_modules(spec.model.adapters)


def _adapters_hashed(spec: DisaggregatedModelSpec, _: str | None) -> JsonValue:
    return adapters_hashed(spec.model.adapters)


def _one_cache(cache: ModelCache) -> str | None:
    if (cache.claim_name is None) == (cache.host_path is None):
        return "set exactly one of claimName and hostPath"
    return None


ONE_CACHE = CrossFieldRule(
    "has(self.claimName) != has(self.hostPath)",
    "set exactly one of claimName and hostPath",
    None,
    _one_cache,
)


class ModelCache(ApiModel):
    """Where the engine pods keep the Hub download, so the weights are downloaded once instead
    of on every pod start into a pod's own emptyDir: exactly one of claimName and hostPath."""

    model_config = with_rules([ONE_CACHE])

    claim_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """A PersistentVolumeClaim mounted writable as every engine pod's Hugging Face cache
    (ReadWriteMany for pods on several nodes); the first pod downloads, the others find the
    files (the Hub client locks each file while it downloads it)."""
    host_path: Annotated[str, Field(pattern=r"^/.+")] | None = None
    """A directory on each node (created if missing) mounted as the cache: each node downloads
    once. A hostPath volume needs Pod Security privileged in the model's namespace."""


class HuggingFaceSource(ApiModel):
    """Download the model from the Hugging Face Hub when a pod starts."""

    token_secret_ref: SecretKeyRef | None = None
    """Secret key holding an HF token (exported as HF_TOKEN), for gated or private models. The
    token is only ever read from this Secret, never written into a manifest."""
    cache: ModelCache | None = None
    """Keep the engines' download in a cache shared across pod starts. Unset: each engine pod
    downloads into an emptyDir of its own, sized (and asked of the node as ephemeral-storage)
    from the model's shape when pdserve knows it. The render pods download the tokenizer files
    only, into their own HOME."""


class PvcSource(ApiModel):
    """Load the model from a PersistentVolumeClaim mounted read-only into every pod."""

    claim_name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany for several pods)."""
    path: Annotated[str, Field(pattern=r"^[^/].*$")] = "."
    """Directory of the model inside the claim, relative to its root."""


def _one_source(source: ModelSource) -> str | None:
    both = source.hf is not None and source.pvc is not None
    return "set only one of hf and pvc" if both else None


ONE_SOURCE = CrossFieldRule(
    "!(has(self.hf) && has(self.pvc))", "set only one of hf and pvc", None, _one_source
)


class ModelSource(ApiModel):
    """Where weights, config and tokenizer come from: exactly one of hf or pvc."""

    model_config = with_rules([ONE_SOURCE])

    hf: HuggingFaceSource | None = None
    """The Hugging Face Hub (the default when nothing is set)."""
    pvc: PvcSource | None = None
    """A PersistentVolumeClaim."""


class ModelSpec(ApiModel):
    """The model being served."""

    name: Annotated[str, Field(min_length=1, max_length=512)]
    """Hugging Face id (e.g. Qwen/Qwen2.5-7B-Instruct) or, with source.pvc, the name clients use
    when servedModelName is not set."""
    served_model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Model name in the OpenAI API. Default: the resource's metadata.name."""
    revision: Annotated[
        Annotated[str, Field(min_length=1, max_length=256)] | None,
        Parity("--revision", scope=Scope.every_pool),
    ] = None
    """Model revision (branch, tag or commit). Pinned revisions keep pools identical."""
    source: ModelSource = Field(default_factory=ModelSource)
    """Where the model is loaded from."""
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """Context length (--max-model-len). Default: the model's own."""
    shape: ModelShape | None = None
    """Parameter count and KV geometry, for the check that each engine pool fits the GPUs
    placement allows. Default: known for well-known models (pdserve's table); otherwise no
    check."""
    adapters: Annotated[
        list[LoraAdapter],
        Field(
            max_length=256,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            examples=[
                [{"name": "sql", "pvc": {"claimName": "adapters", "path": "sql"}}],
                [{"name": "chat", "hf": {"repo": "org/chat-lora", "revision": "v1"}}],
            ],
        ),
        Parity(
            "--lora-modules",
            scope=Scope.engines,
            render=Render.json_each,
            effective=_lora_modules,
            hashed=_adapters_hashed,
            hashed_when_unset=False,
        ),
    ] = Field(default_factory=list)
    """LoRA adapters served beside the model, each under its own name in the OpenAI `model`
    field, by every engine (prefill and decode hold the same set: part of the parity set). The
    render pool renders their requests with the model's tokenizer and chat template (vLLM uses
    the base model's for adapters too). Changing the list restarts the engines."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """vLLM's LoRA capacity on the engines (with adapters only)."""
