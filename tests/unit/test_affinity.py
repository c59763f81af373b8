"""Prefix- and conversation-aware picking."""

from __future__ import annotations

from pdserve.gateway.affinity import Conversations, PrefixIndex, block_hashes
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
