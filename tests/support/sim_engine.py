"""The simulated engine on a loopback port, and what its contract tests send it: the prompt,
engine configs, generate bodies, and a prefill -> decode handoff."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import prefill_handoff_params

TOKENIZER = SimTokenizer()
PROMPT = TOKENIZER.encode(
    "<|im_start|>user\nhello there, what is the answer<|im_end|>\n<|im_start|>assistant\n"
)
FAST = 0.01  # 100x faster than real time


def engine_config(role: str = "both", **overrides: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "served_model_name": "qwen",
        "role": role,
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


async def bidirectional_first_turn(
    engines: Engines,
) -> tuple[EngineServer, httpx.AsyncClient, httpx.Response]:
    """A prefill and a decode engine that hand KV both ways, and a conversation's first turn
    through them: the prefill engine (server and client) and decode's answer, whose KV decode
    holds for the next turn."""
    bidirectional = TransferConfig(bidirectional=True)
    producer, prefill = await engines(engine_config("prefill", transfer=bidirectional))
    _, decode = await engines(engine_config("decode", transfer=bidirectional))
    _, turn1 = await prefill_then_decode(prefill, decode)
    return producer, prefill, turn1


async def prefill_next_turn(
    producer: EngineServer,
    prefill: httpx.AsyncClient,
    token_ids: list[int],
    reuse: dict[str, Any],
) -> tuple[httpx.Response, int]:
    """Prefill the next turn's prompt with `reuse` as its kv_transfer_params: the answer, and
    how many prompt tokens the prefill engine computed for it (the rest it reused)."""
    before = sum(s.prefill_tokens for s in producer.core.steps)
    response = await prefill.post(
        "/inference/v1/generate",
        json=generate_body(
            request_id="turn-2",
            token_ids=token_ids,
            kv_transfer_params=reuse,
            sampling_params={"max_tokens": 1},
        ),
    )
    return response, sum(s.prefill_tokens for s in producer.core.steps) - before
