"""The simulated engine's scheduler and the vLLM metrics it exports: the metric names, prefix
cache hits on a repeated prompt, and the step-time model (a long prefill stalling the decodes
batched with it)."""

from __future__ import annotations

import pytest

from pdserve.sim.engine_core import EngineCore, SchedulerConfig, Sequence
from tests.support.sim_engine import PROMPT, Engines, engine_config, generate_body


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
