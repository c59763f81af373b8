"""`spec.serving`: the parity set, written once and rendered identically into every pool. Each
parity knob is declared on its field with Parity (api/parity.py); nothing else lists them."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.common import ConfigMapKeyRef, PreservedObject
from pdserve.api.parity import Parity, Render, Scope

if TYPE_CHECKING:
    from pydantic import JsonValue

    from pdserve.api.spec import DisaggregatedModelSpec

Name = Annotated[str, Field(min_length=1)]
ParserName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]


class KvCacheDtype(StrEnum):
    auto = "auto"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"


def _auto_tool_choice_needs_parser(serving: ServingSpec) -> str | None:
    if serving.enable_auto_tool_choice and serving.tool_call_parser is None:
        return (
            "enableAutoToolChoice needs toolCallParser: set spec.serving.toolCallParser "
            "(e.g. hermes) or drop enableAutoToolChoice"
        )
    return None


AUTO_TOOL_CHOICE_NEEDS_PARSER = CrossFieldRule(
    "!has(self.enableAutoToolChoice) || !self.enableAutoToolChoice || has(self.toolCallParser)",
    "enableAutoToolChoice needs toolCallParser",
    ".enableAutoToolChoice",
    _auto_tool_choice_needs_parser,
)


# vLLM's block size when none is given: its CPU platform picks 128 (vllm/platforms/cpu.py) and
# its CPU attention backend only takes multiples of 32 (cpu_attn.py, MultipleOf(32)); the GPU
# backends default to 16. pdserve always passes the value it derives, so prefill and decode can
# never pick different ones.
CPU_BLOCK_SIZE = 128
CPU_BLOCK_MULTIPLE = 32
ACCELERATOR_BLOCK_SIZE = 16


def effective_block_size(spec: DisaggregatedModelSpec) -> int:
    """The engines' --block-size: spec.serving.blockSize, else vLLM's default for the backend the
    engines run on (128 on CPU, 16 on an accelerator)."""
    if spec.serving.block_size is not None:
        return spec.serving.block_size
    return CPU_BLOCK_SIZE if spec.placement.engines_on_cpu else ACCELERATOR_BLOCK_SIZE


def _hashed_tokenizer(spec: DisaggregatedModelSpec, _: str | None) -> JsonValue:
    return spec.serving.tokenizer or spec.model.name


def _hashed_chat_template(spec: DisaggregatedModelSpec, digest: str | None) -> JsonValue:
    """The ConfigMap key and, when known, its content's digest: editing the template counts."""
    template = spec.serving.chat_template
    if template is None:
        return None
    return {"configMap": template.name, "key": template.key, "digest": digest}


class ServingSpec(ApiModel):
    """Everything that changes how text becomes tokens and tokens become an answer, written once
    and rendered identically into the render, prefill and decode pools (the parity set)."""

    model_config = with_rules([AUTO_TOOL_CHOICE_NEEDS_PARSER])

    tokenizer: Annotated[Name | None, Parity("--tokenizer", hashed=_hashed_tokenizer)] = None
    """Tokenizer (--tokenizer). Default: the model's own."""
    tokenizer_revision: Annotated[Name | None, Parity("--tokenizer-revision")] = None
    """Tokenizer revision (--tokenizer-revision)."""
    chat_template: Annotated[
        ConfigMapKeyRef | None,
        Parity("--chat-template", render=Render.chat_template_file, hashed=_hashed_chat_template),
    ] = None
    """Chat template from a ConfigMap key (--chat-template). Default: the model's own."""
    default_chat_template_kwargs: Annotated[
        PreservedObject | None, Parity("--default-chat-template-kwargs", render=Render.json)
    ] = None
    """Default chat-template kwargs (--default-chat-template-kwargs), e.g. {"enable_thinking":
    false}. Request kwargs win."""
    reasoning_parser: Annotated[ParserName | None, Parity("--reasoning-parser")] = None
    """Reasoning parser (--reasoning-parser), e.g. qwen3, deepseek_r1."""
    tool_call_parser: Annotated[ParserName | None, Parity("--tool-call-parser")] = None
    """Tool-call parser (--tool-call-parser), e.g. hermes, llama3_json."""
    enable_auto_tool_choice: Annotated[
        bool, Parity("--enable-auto-tool-choice", render=Render.switch)
    ] = False
    """Let the model choose tools (--enable-auto-tool-choice); needs toolCallParser."""
    block_size: Annotated[
        Literal[1, 8, 16, 32, 64, 128] | None,
        Parity("--block-size", scope=Scope.engines, effective=effective_block_size),
    ] = None
    """KV cache block size in tokens (--block-size); must match between prefill and decode.
    Default: vLLM's for the engines' backend, 16 on accelerators and 128 on CPU engines
    (placement.acceleratorResource ""), which need a multiple of 32."""
    kv_cache_dtype: Annotated[KvCacheDtype, Parity("--kv-cache-dtype", scope=Scope.engines)] = (
        KvCacheDtype.auto
    )
    """KV cache dtype (--kv-cache-dtype); must match between prefill and decode."""
    python_hash_seed: Annotated[
        int, Field(ge=0, le=4294967295), Parity(env="PYTHONHASHSEED", scope=Scope.every_pool)
    ] = 0
    """PYTHONHASHSEED for every pool, so prefix-cache block hashes agree across pods."""
    trust_remote_code: Annotated[
        bool, Parity("--trust-remote-code", render=Render.switch, scope=Scope.every_pool)
    ] = False
    """Run the model repository's own Python (--trust-remote-code) in every pool: models with
    custom tokenizers or architectures need it, and a render pool without it would tokenize
    differently from the engines (or refuse to start)."""
