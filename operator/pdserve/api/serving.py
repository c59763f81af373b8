"""`spec.serving`: the parity set, written once and rendered identically into every pool."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.common import ConfigMapKeyRef, PreservedObject


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


class ServingSpec(ApiModel):
    """Everything that changes how text becomes tokens and tokens become an answer, written once
    and rendered identically into the render, prefill and decode pools (the parity set)."""

    model_config = with_rules([AUTO_TOOL_CHOICE_NEEDS_PARSER])

    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    """Tokenizer (--tokenizer). Default: the model's own."""
    tokenizer_revision: Annotated[str, Field(min_length=1)] | None = None
    """Tokenizer revision (--tokenizer-revision)."""
    chat_template: ConfigMapKeyRef | None = None
    """Chat template from a ConfigMap key (--chat-template). Default: the model's own."""
    default_chat_template_kwargs: PreservedObject | None = None
    """Default chat-template kwargs (--default-chat-template-kwargs), e.g. {"enable_thinking":
    false}. Request kwargs win."""
    reasoning_parser: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] | None = (
        None
    )
    """Reasoning parser (--reasoning-parser), e.g. qwen3, deepseek_r1."""
    tool_call_parser: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] | None = (
        None
    )
    """Tool-call parser (--tool-call-parser), e.g. hermes, llama3_json."""
    enable_auto_tool_choice: bool = False
    """Let the model choose tools (--enable-auto-tool-choice); needs toolCallParser."""
    block_size: Literal[1, 8, 16, 32, 64, 128] = 16
    """KV cache block size in tokens (--block-size); must match between prefill and decode."""
    kv_cache_dtype: KvCacheDtype = KvCacheDtype.auto
    """KV cache dtype (--kv-cache-dtype); must match between prefill and decode."""
    python_hash_seed: Annotated[int, Field(ge=0, le=4294967295)] = 0
    """PYTHONHASHSEED for every pool, so prefix-cache block hashes agree across pods."""
