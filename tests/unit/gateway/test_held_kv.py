"""Bidirectional KV: decode holds every finished P/D request's blocks for the TTL (vLLM's NIXL
connector), so the gateway reckons those holds per decode replica and sends a request P/D only
while its hold fits the budget (a share of decode's KV blocks); past it the request prefills
locally on decode, which holds nothing (gateway/held_kv.py)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.held_kv import FALLBACK_REASON, DecodeHolds
from pdserve.gateway.load import parse_cache_config
from pdserve.gateway.tokens_route import TokensRoute
from tests.support.gateway_fakes import Rig, rig

KV = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e"}
ANSWER = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}
PROMPT = list(range(1, 65))  # 4 blocks of 16 (the fake config's block size)
MAX_TOKENS = 60  # with the prompt: 124 tokens, 8 blocks
REQUEST_IDS = itertools.count(1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def holds(clock: Clock, fraction: float = 0.5) -> DecodeHolds:
    return DecodeHolds(ttl=60, block_size=16, fraction=fraction, clock=clock)


def decode(url: str = "http://decode", blocks: int = 40) -> Endpoint:
    return Endpoint(url, "p1", kv_blocks=blocks, kv_block_size=16)


# ---- the reckoning ------------------------------------------------------------------------------
def test_a_hold_counts_its_blocks_until_the_ttl_then_nothing() -> None:
    clock = Clock()
    h = holds(clock)
    d = decode()
    h.reserve("r1", 8)
    h.finished("r1", d, [124])  # 124 tokens: 8 blocks of 16
    assert (h.held(d.url), h.pending()) == (8, 0)
    clock.now += 59.9
    assert h.held(d.url) == 8
    clock.now += 0.1
    assert h.held(d.url) == 0


def test_an_aborted_or_locally_prefilled_request_holds_nothing() -> None:
    h = holds(Clock())
    h.reserve("r1", 8)
    h.finished("r1", None, [124])
    assert (h.held("http://decode"), h.pending()) == (0, 0)


def test_room_counts_holds_and_requests_in_flight_against_the_budget() -> None:
    h = holds(Clock())
    d = decode(blocks=40)  # budget: 20 blocks
    assert h.room([d], 124, replicas=1) == [d]  # 8 blocks
    h.finished("r1", d, [124])
    h.reserve("r2", 8)
    assert h.room([d], 64, replicas=1) == [d]  # 8 + 8 + 4 = 20
    assert h.room([d], 65, replicas=1) == []  # 8 + 8 + 5 > 20
    # Two gateway replicas share the budget: 10 blocks each.
    assert h.room([d], 16, replicas=2) == []


def test_a_replica_of_unknown_capacity_takes_p_d_as_before() -> None:
    h = holds(Clock())
    unknown = Endpoint("http://new", "p1")
    assert h.room([unknown], 10**6, replicas=1) == [unknown]


def test_only_replicas_with_room_are_kept() -> None:
    h = holds(Clock())
    full, free = decode("http://full"), decode("http://free")
    h.finished("r1", full, [20 * 16])
    assert h.room([full, free], 16, replicas=1) == [free]


def test_a_hold_read_back_by_the_next_turn_is_freed() -> None:
    h = holds(Clock())
    d = decode()
    h.finished("r1", d, [124])
    h.released(d.url, "r1")
    assert h.held(d.url) == 0


def test_the_engines_capacity_comes_from_cache_config_info() -> None:
    text = (
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="31"} 1.0\n'
        'vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="29"} 1.0\n'
    )
    assert parse_cache_config(text) == (29, 128)
    assert parse_cache_config("vllm:num_requests_running 0\n") == (0, 0)
    assert parse_cache_config('vllm:cache_config_info{num_gpu_blocks="None"} 1.0') == (0, 0)


# ---- the tokens route ---------------------------------------------------------------------------
def bidirectional(blocks: int, stream: bool = False) -> tuple[Rig, TokensRoute, Clock]:
    r = rig("tokens", kv_transfer={"bidirectional": True, "decodeBlocksTtlSeconds": 60})
    assert isinstance(r.route, TokensRoute)
    clock = Clock()
    r.route.holds = holds(clock)
    for each in r.planner.endpoints.pools["decode"]:
        each.kv_blocks, each.kv_block_size = blocks, 16
    sampling = {"max_tokens": MAX_TOKENS}
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    r.upstream.script = {
        "render": lambda _: {"token_ids": PROMPT, "sampling_params": sampling},
        "prefill": lambda _: {"kv_transfer_params": KV},
        "decode": lambda _: {
            "choices": [{"index": 0, "token_ids": list(range(100, 160)), "finish_reason": "length"}]
        },
        "derender": lambda _: {"chunk": chunk} if stream else ANSWER,
    }
    events = [
        {"choices": [{"index": 0, "token_ids": [7] * 30, "finish_reason": reason}]}
        for reason in (None, "length")
    ]
    r.upstream.stream_lines = [
        *(f"data: {json.dumps(e)}\n".encode() for e in events),
        b"data: [DONE]\n",
    ]
    return r, r.route, clock


async def serve(r: Rig, stream: bool = False, **body: Any) -> list[str]:
    r.upstream.calls.clear()
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    exchange = r.exchange(chat)
    exchange.request_id = f"req-{next(REQUEST_IDS)}"
    response = await r.route.serve(exchange)
    assert response.status == 200
    return r.upstream.stages()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_p_d_requests_past_the_budget_prefill_on_decode_until_holds_expire(
    stream: bool,
) -> None:
    # 40 blocks, budget 20: each request may hold 64 + 60 tokens, 8 blocks.
    r, route, clock = bidirectional(40, stream)
    decode_stage = "decode_stream" if stream else "decode"
    assert await serve(r, stream) == ["render", "prefill", decode_stage, "derender"]
    assert await serve(r, stream) == ["render", "prefill", decode_stage, "derender"]
    assert route.holds.held("http://decode") == 16  # streamed turns are held all the same
    # A third hold would pass the budget: local prefill on decode, nothing held.
    stages = await serve(r, stream)
    assert "prefill" not in stages
    assert r.fallbacks(FALLBACK_REASON) == 1
    assert route.holds.held("http://decode") == 16
    assert route.holds.pending() == 0
    clock.now += 60
    assert "prefill" in await serve(r, stream)


async def test_a_decode_that_fell_back_to_local_prefill_holds_nothing() -> None:
    r, route, _ = bidirectional(40)
    r.upstream.script["prefill"] = lambda _: {"no": "kv_transfer_params"}
    stages = await serve(r)
    assert stages == ["render", "prefill", "decode", "derender"]
    assert (route.holds.held("http://decode"), route.holds.pending()) == (0, 0)


async def test_without_bidirectional_kv_nothing_is_reckoned() -> None:
    r = rig("tokens")
    assert isinstance(r.route, TokensRoute)
    r.route.holds = holds(Clock())
    for each in r.planner.endpoints.pools["decode"]:
        each.kv_blocks = 1
    r.upstream.script = {
        "render": lambda _: {"token_ids": PROMPT, "sampling_params": {"max_tokens": 60}},
        "prefill": lambda _: {"kv_transfer_params": KV},
        "decode": lambda _: {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]},
        "derender": lambda _: ANSWER,
    }
    assert "prefill" in await serve(r)
    assert r.route.holds.held("http://decode") == 0


async def test_a_turn_that_reads_back_the_last_turns_kv_frees_its_hold() -> None:
    r, route, _ = bidirectional(40)
    held = {"remote_request_id": "held-1", "remote_num_tokens": 124, "remote_block_ids": [1]}
    r.upstream.script["decode"] = lambda _: {
        "choices": [{"index": 0, "token_ids": list(range(100, 160)), "finish_reason": "stop"}],
        "kv_transfer_params": held,
    }
    await serve(r, conversation_id="c-1")
    assert route.holds.held("http://decode") == 8
    # Turn 2 (its prompt starts with turn 1's): prefill reads turn 1's KV back, then decode
    # holds turn 2's only.
    r.upstream.script["render"] = lambda _: {
        "token_ids": [*PROMPT, *range(100, 160), 5],
        "sampling_params": {"max_tokens": 3},
    }
    await serve(r, conversation_id="c-1")
    (sent,) = r.upstream.sent("prefill")
    assert sent["kv_transfer_params"]["remote_request_id"] == "held-1"
    assert route.holds.held("http://decode") == 12  # 125 + 60 tokens
