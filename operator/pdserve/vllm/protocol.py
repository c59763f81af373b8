"""Small pieces of vLLM's wire contract shared by the simulators, the gateway and the tests."""

from __future__ import annotations

from typing import Any


def prefill_handoff_params() -> dict[str, Any]:
    """kv_transfer_params of the request sent to a prefill engine (NixlConnector, P/D step 1):
    the prefill engine answers with where decode can pull the KV from."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
