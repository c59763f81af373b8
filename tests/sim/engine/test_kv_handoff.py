"""The simulated engine hands KV from prefill to decode with kv_transfer_params: the answer
matches the aggregated one, blocks are pulled once, the failure policy (fail, recompute),
expired and aborted leases, and bidirectional KV reused by the next turn. Expiry times are
vLLM's: null from prefill, decode's own time.perf_counter() plus its TTL from decode."""

from __future__ import annotations

import time

import pytest

from pdserve.sim.engine_config import TransferConfig
from pdserve.vllm.protocol import ABORT_PATH, abort_body
from tests.support.sim_engine import (
    FAST,
    PROMPT,
    TOKENIZER,
    Engines,
    bidirectional_first_turn,
    engine_config,
    generate_body,
    prefill_next_turn,
    prefill_then_decode,
)


async def test_prefill_hands_kv_to_decode_and_the_answer_matches_aggregated(
    engines: Engines,
) -> None:
    _, prefill = await engines(engine_config("prefill"))
    decode_server, decode = await engines(engine_config("decode"))
    _, aggregated = await engines(engine_config("both"))
    first, response = await prefill_then_decode(prefill, decode)
    params = first["kv_transfer_params"]
    assert len(first["choices"][0]["token_ids"]) == 1
    assert {
        "do_remote_prefill",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
    } <= set(params)
    assert params["do_remote_prefill"] is True
    assert params["remote_blocks_expiry_time"] is None  # vLLM's prefill: a lease, no time
    assert params["remote_num_tokens"] == len(PROMPT)
    expected = (await aggregated.post("/inference/v1/generate", json=generate_body())).json()
    assert response.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    metrics = (await decode.get("/metrics")).text
    assert 'vllm:nixl_xfer_time_seconds_count{engine="' in metrics
    assert decode_server.core.prefix_queries == 0  # the prompt was not computed on decode


async def test_blocks_are_pulled_once_and_fail_policy_errors(engines: Engines) -> None:
    _, prefill = await engines(engine_config("prefill"))
    _, decode = await engines(engine_config("decode"))
    first, response = await prefill_then_decode(prefill, decode)
    assert response.status_code == 200
    again = await decode.post(
        "/inference/v1/generate", json=generate_body(kv_transfer_params=first["kv_transfer_params"])
    )
    assert again.status_code == 500
    message = again.json()["error"]["message"]
    assert "no KV blocks held for request generate-tokens-req-1" in message  # vLLM's name
    assert "kv_load_failure_policy=fail" in message
    assert "vllm:nixl_num_failed_transfers_total" in (await decode.get("/metrics")).text


async def test_recompute_policy_answers_after_a_failed_transfer(engines: Engines) -> None:
    _, prefill = await engines(engine_config("prefill"))
    config = engine_config("decode", transfer=TransferConfig(load_failure_policy="recompute"))
    server, decode = await engines(config)
    await decode.post("/sim/faults", json={"fail_transfers": 1})
    _, response = await prefill_then_decode(prefill, decode)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert server.core.prefix_queries == len(PROMPT)  # computed locally


async def test_expired_lease_is_refused_and_counted(engines: Engines) -> None:
    producer, prefill = await engines(engine_config("prefill"))
    _, decode = await engines(engine_config("decode"))
    await prefill.post("/sim/faults", json={"expire_leases": True})
    _, response = await prefill_then_decode(prefill, decode)
    assert response.status_code == 500
    assert "expired" in response.json()["error"]["message"]
    assert "vllm:nixl_num_kv_expired_reqs_total" in (await prefill.get("/metrics")).text
    assert producer.core.held_blocks == 0


@pytest.mark.parametrize("api", ["tokens", "scale_out"])
async def test_abort_releases_a_producers_lease(engines: Engines, api: str) -> None:
    producer, prefill = await engines(engine_config("prefill", api=api))
    handoff = {"do_remote_decode": True}
    await prefill.post("/inference/v1/generate", json=generate_body(kv_transfer_params=handoff))
    held = producer.core.held_blocks
    assert held > 0
    await prefill.post(ABORT_PATH, json={"request_ids": ["req-1"]})  # not the engine's name
    assert producer.core.held_blocks == held
    await prefill.post(ABORT_PATH, json=abort_body("req-1"))
    assert producer.core.held_blocks == 0


async def test_bidirectional_reuses_decodes_kv_as_far_as_token_ids_agree(engines: Engines) -> None:
    producer, prefill, turn1 = await bidirectional_first_turn(engines)
    held = turn1.json()["kv_transfer_params"]
    answer = turn1.json()["choices"][0]["token_ids"]
    assert held["remote_num_tokens"] == len(PROMPT) + len(answer)

    next_turn = PROMPT + answer + TOKENIZER.encode("\n<|im_start|>user\nand then what<|im_end|>\n")
    reuse = {**held, "do_remote_decode": True, "do_remote_prefill": False}
    response, computed = await prefill_next_turn(producer, prefill, next_turn, reuse)
    assert response.status_code == 200
    reused = len(next_turn) - computed
    assert reused >= len(PROMPT) + len(answer) - 16  # all but the last partial block
    assert "pdserve_sim_bidirectional_reused_tokens_total" in (await prefill.get("/metrics")).text


async def test_decodes_held_turn_expires_by_decodes_own_monotonic_clock(engines: Engines) -> None:
    """As vLLM's decode engine: remote_blocks_expiry_time = time.perf_counter() + the TTL
    (decoder_kv_blocks_ttl, here in the simulator's scaled seconds), a reading of its own
    clock that only it can judge; nothing like a wall-clock time."""
    started = time.perf_counter()
    _, _, turn1 = await bidirectional_first_turn(engines)
    finished = time.perf_counter()
    expiry = turn1.json()["kv_transfer_params"]["remote_blocks_expiry_time"]
    ttl = TransferConfig().decoder_kv_ttl_seconds * FAST
    assert started + ttl <= expiry <= finished + ttl
    assert expiry < time.time() - 1e6  # far from any wall-clock deadline


async def test_bidirectional_reuse_stops_where_the_history_was_rewritten(engines: Engines) -> None:
    producer, prefill, turn1 = await bidirectional_first_turn(engines)
    held = turn1.json()["kv_transfer_params"]
    # A reasoning template strips <think> from history: the new prompt diverges right after
    # the first turn's prompt, so only that part can be reused.
    rewritten = PROMPT + TOKENIZER.encode(
        "It is sunny.<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
    )
    reuse = {**held, "do_remote_decode": True}
    _, computed = await prefill_next_turn(producer, prefill, rewritten, reuse)
    assert computed > len(rewritten) - len(PROMPT) - 1
