"""The simulated engine speaks vLLM's generate contract, hands KV from prefill to decode with
kv_transfer_params, applies the failure policy, aborts, injects faults and exports vLLM metrics."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from devtools.localplane import free_port
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import EngineCore, SchedulerConfig, Sequence
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import prefill_handoff_params
from tests.support.serving import serving

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


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    """start(config) -> (server, client) on the config's own loopback port."""
    async with AsyncExitStack() as stack:

        async def start(config: EngineConfig) -> tuple[EngineServer, httpx.AsyncClient]:
            server = EngineServer(config)
            url = await stack.enter_async_context(serving(server.app(), port=config.port))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            return server, client

        yield start


def generate_body(**overrides: Any) -> dict[str, Any]:
    return {
        "request_id": "req-1",
        "token_ids": PROMPT,
        "model": "qwen",
        "stream": False,
        "sampling_params": {"max_tokens": 200, "seed": 7},
        **overrides,
    }


async def test_generate_is_deterministic_and_shaped_like_vllm(engines: Engines) -> None:
    _, client = await engines(engine_config())
    first = (await client.post("/inference/v1/generate", json=generate_body())).json()
    again = (
        await client.post("/inference/v1/generate", json=generate_body(request_id="req-2"))
    ).json()
    assert set(first) == {
        "request_id",
        "model",
        "created",
        "choices",
        "usage",
        "kv_transfer_params",
        "prompt_logprobs",
    }
    [choice] = first["choices"]
    assert set(choice) == {"index", "token_ids", "finish_reason", "logprobs"}
    assert choice["token_ids"] == again["choices"][0]["token_ids"]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"][-1] == TOKENIZER.im_end_token_id
    assert first["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(choice["token_ids"]),
        "total_tokens": len(PROMPT) + len(choice["token_ids"]),
    }
    assert first["kv_transfer_params"] is None


async def test_max_tokens_and_ignore_eos_control_the_length(engines: Engines) -> None:
    _, client = await engines(engine_config())
    short = (
        await client.post(
            "/inference/v1/generate",
            json=generate_body(sampling_params={"max_tokens": 3, "seed": 7}),
        )
    ).json()["choices"][0]
    assert (len(short["token_ids"]), short["finish_reason"]) == (3, "length")
    exact = (
        await client.post(
            "/inference/v1/generate",
            json=generate_body(sampling_params={"max_tokens": 256, "ignore_eos": True}),
        )
    ).json()["choices"][0]
    assert (len(exact["token_ids"]), exact["finish_reason"]) == (256, "length")


async def test_streaming_sends_one_token_per_event_usage_and_done(engines: Engines) -> None:
    _, client = await engines(engine_config())
    body = generate_body(
        stream=True,
        stream_options={"include_usage": True},
        sampling_params={"max_tokens": 5, "seed": 7},
    )
    async with client.stream("POST", "/inference/v1/generate", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    tokens = [e for e in events if e["choices"]]
    assert len(tokens) == 5
    assert all(len(e["choices"][0]["token_ids"]) == 1 for e in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5


async def test_bad_token_ids_are_refused_naming_the_position(engines: Engines) -> None:
    _, client = await engines(engine_config())
    response = await client.post(
        "/inference/v1/generate", json=generate_body(token_ids=[1, 2, 10**9])
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "token_ids[2] = 1000000000 is not in the vocabulary"
    )


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
    assert "no KV blocks held for request req-1" in message
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


async def test_abort_releases_a_producers_lease(engines: Engines) -> None:
    producer, prefill = await engines(engine_config("prefill"))
    handoff = {"do_remote_decode": True}
    await prefill.post("/inference/v1/generate", json=generate_body(kv_transfer_params=handoff))
    assert producer.core.held_blocks > 0
    await prefill.post("/abort_requests", json={"request_ids": ["req-1"]})
    assert producer.core.held_blocks == 0


async def test_injected_5xx_happens_once(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"http_5xx": 1})
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 500
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 200
    unknown = await client.post("/sim/faults", json={"melt": True})
    assert unknown.status_code == 400


async def test_reasoning_and_tools_in_openai_mode(engines: Engines) -> None:
    render = RenderConfig(
        model="Qwen/Qwen3-8B",
        served_model_name="qwen",
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    _, client = await engines(
        engine_config(api="openai", render=render, behaviour=ModelBehaviour(reasoning=True))
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": tools,
        "tool_choice": "auto",
        "max_tokens": 300,
    }
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert set(json.loads(message["tool_calls"][0]["function"]["arguments"])) == {"city"}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"

    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks)
    assert streamed == message["reasoning"]


async def test_vllm_metric_names_are_exported(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/inference/v1/generate", json=generate_body())
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:request_prompt_tokens_sum",  # prompt lengths: queued prompt tokens for autoscaling
    ):
        assert name in text, name
    assert 'model_name="qwen"' in text


async def test_prefix_cache_hits_on_a_repeated_prompt(engines: Engines) -> None:
    server, client = await engines(engine_config())
    long_prompt = PROMPT * 8
    for request_id in ("a", "b"):
        await client.post(
            "/inference/v1/generate",
            json=generate_body(request_id=request_id, token_ids=long_prompt),
        )
    assert server.core.prefix_hits >= len(long_prompt) - server.config.scheduler.block_size


async def test_a_long_prefill_stalls_the_decodes_batched_with_it() -> None:
    """The step-time model (no wall clock): 8k prompt chunks of 2048 under the article's budget."""
    core = EngineCore(SchedulerConfig(time_scale=0.0))
    decode = Sequence("d", [1] * 10, [5] * 50, "length", arrival=0.0, computed=10)
    core.add(decode)
    await core.step()
    core.add(Sequence("p", [2] * 8192, [6] * 2, "length", arrival=0.0))
    for _ in range(5):
        await core.step()
    first, *chunked = core.steps
    assert (first.prefill_tokens, first.decodes) == (0, 1)
    assert first.seconds == pytest.approx(0.0201, rel=1e-3)
    assert [s.prefill_tokens for s in chunked[:4]] == [2047, 2047, 2047, 2047]
    assert chunked[0].seconds == pytest.approx(0.020 + 2047 * 0.00007 + 0.0001, rel=1e-3)
    total_prefill = sum(s.seconds for s in core.steps if s.prefill_tokens)
    assert 0.6 < total_prefill < 0.7  # ~0.65 s to prefill 8k tokens, as in the article


async def test_simulated_token_times_only_on_request(engines: Engines) -> None:
    _, client = await engines(engine_config())
    body = generate_body(stream=True, sampling_params={"max_tokens": 4, "seed": 1})
    for headers, expected in (({}, False), ({"X-PDServe-Sim-Timing": "1"}, True)):
        async with client.stream(
            "POST", "/inference/v1/generate", json=body, headers=headers
        ) as response:
            events = [
                json.loads(line.removeprefix("data: "))
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]
        assert all(("sim_time" in e) is expected for e in events)
        if expected:
            times = [e["sim_time"] for e in events]
            assert times == sorted(times)
            gaps = [b - a for a, b in itertools.pairwise(times)]
            assert all(g == pytest.approx(0.0201, rel=1e-3) for g in gaps)  # one decode step each


async def test_bidirectional_reuses_decodes_kv_as_far_as_token_ids_agree(engines: Engines) -> None:
    bidirectional = TransferConfig(bidirectional=True)
    producer, prefill = await engines(engine_config("prefill", transfer=bidirectional))
    _, decode = await engines(engine_config("decode", transfer=bidirectional))
    _, turn1 = await prefill_then_decode(prefill, decode)
    held = turn1.json()["kv_transfer_params"]
    answer = turn1.json()["choices"][0]["token_ids"]
    assert held["remote_num_tokens"] == len(PROMPT) + len(answer)

    next_turn = PROMPT + answer + TOKENIZER.encode("\n<|im_start|>user\nand then what<|im_end|>\n")
    before = sum(s.prefill_tokens for s in producer.core.steps)
    reuse = {**held, "do_remote_decode": True, "do_remote_prefill": False}
    response = await prefill.post(
        "/inference/v1/generate",
        json=generate_body(
            request_id="turn-2",
            token_ids=next_turn,
            kv_transfer_params=reuse,
            sampling_params={"max_tokens": 1},
        ),
    )
    assert response.status_code == 200
    computed = sum(s.prefill_tokens for s in producer.core.steps) - before
    reused = len(next_turn) - computed
    assert reused >= len(PROMPT) + len(answer) - 16  # all but the last partial block
    assert "pdserve_sim_bidirectional_reused_tokens_total" in (await prefill.get("/metrics")).text


async def test_bidirectional_reuse_stops_where_the_history_was_rewritten(engines: Engines) -> None:
    bidirectional = TransferConfig(bidirectional=True)
    producer, prefill = await engines(engine_config("prefill", transfer=bidirectional))
    _, decode = await engines(engine_config("decode", transfer=bidirectional))
    _, turn1 = await prefill_then_decode(prefill, decode)
    held = turn1.json()["kv_transfer_params"]
    # A reasoning template strips <think> from history: the new prompt diverges right after
    # the first turn's prompt, so only that part can be reused.
    rewritten = PROMPT + TOKENIZER.encode(
        "It is sunny.<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
    )
    before = sum(s.prefill_tokens for s in producer.core.steps)
    reuse = {**held, "do_remote_decode": True}
    await prefill.post(
        "/inference/v1/generate",
        json=generate_body(
            request_id="turn-2",
            token_ids=rewritten,
            kv_transfer_params=reuse,
            sampling_params={"max_tokens": 1},
        ),
    )
    computed = sum(s.prefill_tokens for s in producer.core.steps) - before
    assert computed > len(rewritten) - len(PROMPT) - 1


async def test_dropped_stream_ends_without_done(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"drop_stream_after": 3})
    body = generate_body(stream=True, sampling_params={"max_tokens": 50, "ignore_eos": True})
    lines: list[str] = []
    with pytest.raises(httpx.HTTPError):
        async with client.stream("POST", "/inference/v1/generate", json=body) as response:
            lines.extend([line async for line in response.aiter_lines() if line])
    assert "data: [DONE]" not in lines
    assert len(lines) <= 3


async def test_hung_engine_never_answers(engines: Engines) -> None:
    _, client = await engines(engine_config())
    await client.post("/sim/faults", json={"hang": 1})
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/inference/v1/generate", json=generate_body(), timeout=0.5)
    assert (await client.post("/inference/v1/generate", json=generate_body())).status_code == 200
