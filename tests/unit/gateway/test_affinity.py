"""Prefix- and conversation-aware picking."""

from __future__ import annotations

from pdserve.gateway.affinity import Conversations, DecodeKv, PrefixIndex, block_hashes
from pdserve.gateway.endpoints import Endpoint, Endpoints


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(16), 99, *range(17, 40)], 16)
    assert len(a) == 2  # 40 tokens = 2 full blocks of 16
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_prefix_index_counts_leading_cached_blocks_and_stays_bounded() -> None:
    index = PrefixIndex(max_blocks_per_engine=3)
    prompt = block_hashes(list(range(64)), 16)
    index.record("http://a", prompt[:2])
    assert index.cached_blocks("http://a", prompt) == 2
    assert index.cached_blocks("http://b", prompt) == 0
    index.record("http://a", block_hashes([7] * 64, 16))
    assert len(index.engines["http://a"]) == 3  # oldest evicted first


def test_the_engine_holding_the_prefix_wins_unless_much_busier() -> None:
    warm, cold = Endpoint("http://warm", running=3), Endpoint("http://cold")
    assert Endpoints.pick([warm, cold], affinity={"http://warm": 5}) is warm
    warm.waiting = 5
    assert Endpoints.pick([warm, cold], affinity={"http://warm": 5}) is cold


def test_conversations_remember_their_engine_per_stage() -> None:
    conversations = Conversations(max_conversations=2)
    conversations.remember("c1", "decode", "http://a")
    conversations.remember("c1", "prefill", "http://p")
    conversations.remember("c2", "decode", "http://b")
    assert conversations.endpoint("c1", "decode") is None  # evicted: the oldest of three
    assert conversations.endpoint("c1", "prefill") == "http://p"
    assert conversations.endpoint("c2", "decode") == "http://b"


def test_decode_kv_is_reused_only_while_held_and_as_far_as_tokens_match() -> None:
    now = [1000.0]
    store = DecodeKv(max_conversations=2, ttl=60, clock=lambda: now[0])
    params = {"remote_request_id": "r1", "remote_host": "10.0.0.5", "remote_port": 8000}
    store.keep("c1", params, list(range(100)))
    assert store.reuse("c1", [*range(100), 7, 8], min_tokens=16) == (params, "reused", 100)
    # A template that rewrote history: only 10 tokens agree, less than a block.
    assert store.reuse("c1", [*range(10), 999, *range(11, 100)], min_tokens=16) == (
        None, "prefix_mismatch", 10,
    )  # fmt: skip
    assert store.reuse("nobody", [1, 2], min_tokens=16) == (None, "none", 0)
    now[0] += 61
    assert store.reuse("c1", list(range(100)), min_tokens=16) == (None, "expired", 0)
    # The store stays bounded.
    store.keep("c2", params, [1])
    store.keep("c3", params, [1])
    store.keep("c4", params, [1])
    assert sorted(store.held) == ["c3", "c4"]


def test_decode_kv_goes_by_its_own_clock_not_the_engines_expiry_time() -> None:
    """vLLM's decode engine reports remote_blocks_expiry_time on its own monotonic clock
    (time.perf_counter() + decoder_kv_blocks_ttl, e.g. 4293.46): no deadline on the gateway's
    clock. The turn is held for the TTL from when the gateway kept it, and the engine's number
    goes on to the next prefill untouched."""
    now = [10_000.0]  # the gateway's monotonic clock, far past the engine's number
    store = DecodeKv(ttl=480, clock=lambda: now[0])
    params = {"remote_request_id": "r1", "remote_blocks_expiry_time": 4293.46}
    store.keep("c1", params, list(range(64)))
    now[0] += 479
    assert store.reuse("c1", list(range(80)), min_tokens=16) == (params, "reused", 64)
    now[0] += 2
    assert store.reuse("c1", list(range(80)), min_tokens=16) == (None, "expired", 0)

    # Nor does an engine clock far ahead of the gateway's keep a turn past the TTL.
    store.keep("c2", {**params, "remote_blocks_expiry_time": now[0] + 10_000}, [1] * 16)
    now[0] += 481
    assert store.reuse("c2", [1] * 16, min_tokens=16) == (None, "expired", 0)
