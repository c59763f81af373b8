"""The simulated engine on a loopback port, and what its contract tests send it: the prompt,
engine configs, generate bodies, and a prefill -> decode handoff."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from devtools.localplane import free_port
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import prefill_handoff_params

TOKENIZER = SimTokenizer()
PROMPT = TOKENIZER.encode(
    "<|im_start|>user\nhello there, what is the answer<|im_end|>\n<|im_start|>assistant\n"
)
FAST = 0.01  # 100x faster than real time


def engine_config(role: str = "both", **overrides: Any) -> EngineConfig:
    port = free_port()
    base: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "served_model_name": "qwen",
        "role": role,
        "port": port,
        "scheduler": SchedulerConfig(time_scale=FAST),
        "transfer": TransferConfig(lease_seconds=30),
    }
    return EngineConfig(**{**base, **overrides})


Engines = Callable[..., Any]


def generate_body(**overrides: Any) -> dict[str, Any]:
    return {
        "request_id": "req-1",
        "token_ids": PROMPT,
        "model": "qwen",
        "stream": False,
        "sampling_params": {"max_tokens": 200, "seed": 7},
        **overrides,
    }


async def prefill_then_decode(
    prefill: httpx.AsyncClient, decode: httpx.AsyncClient, **decode_overrides: Any
) -> tuple[dict[str, Any], httpx.Response]:
    handoff = prefill_handoff_params()
    first = (
        await prefill.post(
            "/inference/v1/generate",
            json=generate_body(
                kv_transfer_params=handoff, sampling_params={"max_tokens": 1, "seed": 7}
            ),
        )
    ).json()
    params = first["kv_transfer_params"]
    response = await decode.post(
        "/inference/v1/generate", json=generate_body(kv_transfer_params=params, **decode_overrides)
    )
    return first, response
