"""The parity set and its canonical hash, stamped on every pod (pdserve.io/parity-hash).

Two pods may be combined in one request only if their hashes are equal: same model revision,
tokenizer, chat template (content included when known), template kwargs, parsers and
engine-pair invariants (block size, KV cache dtype, PYTHONHASHSEED, KV connector)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.api import DisaggregatedModel


def parity_set(dm: DisaggregatedModel, chat_template_digest: str | None = None) -> dict[str, Any]:
    spec = dm.spec
    serving = spec.serving
    template = serving.chat_template
    return {
        "model": spec.model.name,
        "revision": spec.model.revision,
        "tokenizer": serving.tokenizer or spec.model.name,
        "tokenizerRevision": serving.tokenizer_revision,
        "chatTemplate": None
        if template is None
        else {"configMap": template.name, "key": template.key, "digest": chat_template_digest},
        "defaultChatTemplateKwargs": serving.default_chat_template_kwargs,
        "reasoningParser": serving.reasoning_parser,
        "toolCallParser": serving.tool_call_parser,
        "enableAutoToolChoice": serving.enable_auto_tool_choice,
        "blockSize": serving.block_size,
        "kvCacheDtype": serving.kv_cache_dtype.value,
        "pythonHashSeed": serving.python_hash_seed,
        "kvConnector": spec.kv_transfer.connector.value,
    }


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parity_hash(dm: DisaggregatedModel, chat_template_digest: str | None = None) -> str:
    digest = hashlib.sha256(canonical_json(parity_set(dm, chat_template_digest)).encode())
    return digest.hexdigest()[:16]


def content_digest(text: str) -> str:
    """Digest of a chat template's text, so editing the ConfigMap changes the parity hash."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
