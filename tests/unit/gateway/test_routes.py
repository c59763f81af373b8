"""Routes driven with a fake upstream client (no sockets): what each hop is sent, and how a
failed hop falls back."""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.errors import UpstreamFailed
from tests.support.gateway_fakes import rig

PROMPT_IDS = list(range(1, 9))
KV = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [3, 4],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def rendered() -> dict[str, Any]:
    return {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 5}, "stream": False}


def openai_answer() -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }


async def test_a_failed_prefill_falls_back_to_local_prefill_with_its_reason() -> None:
    r = rig("openai")
    r.upstream.script = {
        "prefill": [UpstreamFailed("prefill", "prefill at http://prefill: HTTP 500: boom")],
        "decode": [openai_answer()],
    }
    exchange = r.exchange(CHAT)
    response = await r.route.serve(exchange)
    assert response.status == 200
    assert r.fallbacks("prefill_failed") == 1
    assert r.upstream.stages() == ["prefill", "decode"]
    [decode] = r.upstream.sent("decode")
    assert "kv_transfer_params" not in decode  # decode prefills the prompt itself
    assert exchange.prefilled_on is None
    assert "prefill" not in exchange.served_by


async def test_decode_carries_the_kv_transfer_params_prefill_answered() -> None:
    r = rig("tokens")
    r.upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [{"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]}],
        "derender": [openai_answer()],
    }
    response = await r.route.serve(r.exchange(CHAT))
    assert response.status == 200
    assert r.upstream.stages() == ["render", "prefill", "decode", "derender"]
    [prefill] = r.upstream.sent("prefill")
    assert prefill["sampling_params"]["max_tokens"] == 1
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    [decode] = r.upstream.sent("decode")
    assert decode["kv_transfer_params"] == KV
    assert decode["sampling_params"]["extra_args"]["kv_transfer_params"] == KV
    assert decode["sampling_params"]["max_tokens"] == 5  # the client's, not prefill's
    assert r.fallbacks("prefill_failed") == 0


async def test_a_kv_load_failure_on_decode_reprefills_locally_and_frees_prefills_kv() -> None:
    r = rig("tokens")
    r.upstream.script = {
        "render": [rendered()],
        "prefill": [{"kv_transfer_params": KV}],
        "decode": [
            UpstreamFailed("decode", "decode at http://decode: HTTP 500: KV transfer failed"),
            {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "stop"}]},
        ],
        "derender": [openai_answer()],
    }
    assert (await r.route.serve(r.exchange(CHAT))).status == 200
    with_kv, local = r.upstream.sent("decode")
    assert with_kv["kv_transfer_params"] == KV
    assert "kv_transfer_params" not in local
    assert r.fallbacks("kv_load_failed") == 1
    assert r.upstream.aborted == [("http://prefill", ["generate-tokens-req-1"])]


async def test_a_streamed_decode_is_derendered_with_the_tokens_it_streamed() -> None:
    r = rig("tokens", mode="Aggregated")
    events = [
        {"choices": [{"index": 0, "token_ids": [10, 11], "finish_reason": None}]},
        {"choices": [{"index": 0, "token_ids": [12], "finish_reason": None}]},
        {"choices": [{"index": 0, "token_ids": [13], "finish_reason": "stop"}]},
    ]
    r.upstream.stream_lines = [
        *(f"data: {json.dumps(e)}\n".encode() for e in events),
        b"\n",
        b"data: [DONE]\n",
    ]
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    r.upstream.script = {"render": [rendered()], "derender": [{"chunk": chunk}] * 4}
    exchange = r.exchange({**CHAT, "stream": True})
    await r.route.serve(exchange)
    calls = r.upstream.sent("derender")
    assert calls, "the stream was never derendered"
    choices = [c["generate_chunk"]["choices"][0] for c in calls]
    # 13 ended the choice (finish "stop", no stop string): the EOS, which vLLM keeps in the
    # token ids and `vllm serve` never shows; derender would decode it into the content.
    assert [t for c in choices for t in c["token_ids"]] == [10, 11, 12]
    assert choices[-1]["finish_reason"] == "stop"
    assert all(c["prompt_token_ids"] == PROMPT_IDS for c in calls)
    assert exchange.output_tokens == 4
