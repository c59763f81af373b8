"""The parity set and its canonical hash, stamped on every pod (pdserve.io/parity-hash).

Two pods may be combined in one request only if their hashes are equal: same model revision,
tokenizer, chat template (content included when known), template kwargs, parsers and
engine-pair invariants (block size, KV cache dtype, PYTHONHASHSEED, KV connector): every parity
knob declared on the spec (api/parity.py), plus the model and the KV connector."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.api import PARITY_KNOBS, DisaggregatedModel
from pdserve.api.parity import hashed_knobs


def parity_set(dm: DisaggregatedModel, chat_template_digest: str | None = None) -> dict[str, Any]:
    spec = dm.spec
    knobs = hashed_knobs(PARITY_KNOBS, spec, chat_template_digest)
    return {"model": spec.model.name, **knobs, "kvConnector": spec.kv_transfer.connector.value}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parity_hash(dm: DisaggregatedModel, chat_template_digest: str | None = None) -> str:
    digest = hashlib.sha256(canonical_json(parity_set(dm, chat_template_digest)).encode())
    return digest.hexdigest()[:16]


def content_digest(text: str) -> str:
    """Digest of a chat template's text, so editing the ConfigMap changes the parity hash."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
