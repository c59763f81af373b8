"""The kv_transfer_params that point prefill at decode's KV of a conversation's last turn:
prefill loads `remote_num_tokens` of its prompt from those blocks without comparing tokens,
so they must stop at the last whole block the new prompt shares with the held turn."""

from __future__ import annotations

from pdserve.vllm.protocol import reuse_decode_kv_params

HELD = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[7, 8, 9, 10]],
    "remote_engine_id": "decode-1",
    "remote_request_id": "turn-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "remote_num_tokens": 450,
}


def test_only_the_whole_blocks_of_the_shared_prefix_are_loaded() -> None:
    # The next prompt agrees with the held turn for 300 tokens (then the template drops the
    # reasoning): 2 blocks of 128 are safe, the third holds tokens the new prompt lacks.
    params = reuse_decode_kv_params(HELD, matched_tokens=300, block_size=128)
    assert params["remote_num_tokens"] == 256
    assert params["remote_block_ids"] == [[7, 8]]
    assert params["remote_request_id"] == "turn-1"
    assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)


def test_a_prompt_that_extends_the_whole_turn_loads_what_decode_holds() -> None:
    params = reuse_decode_kv_params(HELD, matched_tokens=600, block_size=128)
    assert params["remote_num_tokens"] == 384  # 450 held: 3 whole blocks
    assert params["remote_block_ids"] == [[7, 8, 9]]


def test_flat_block_lists_are_cut_too() -> None:
    held = {**HELD, "remote_block_ids": [7, 8, 9, 10]}
    assert reuse_decode_kv_params(held, 200, 128)["remote_block_ids"] == [7]
