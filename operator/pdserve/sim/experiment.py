"""`pdserve sim experiment article`: the seed article's experiment on simulated engines.

Two engines serve as DP=2 aggregated (requests alternate between them) and as 1P1D (prefill
produces KV, decode pulls it: ~1.3 s for 8k tokens of Qwen2.5-7B KV, as measured in the article).
~8k-token prompts, 256 output tokens, Poisson arrivals; prefix caching off, as the article did.
Times run scaled (--time-scale) and are reported in simulated seconds."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from pdserve.loadgen import Clock, drive
from pdserve.sim.procs import Processes
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.stats import percentile
from pdserve.vllm.protocol import prefill_handoff_params

# The article's figures (2x L40S, Qwen2.5-7B, ~8k in / 256 out): (rate, metric) -> (DP=2, 1P1D)
ARTICLE = {
    (0.4, "p99 ITL ms"): (169.0, 29.0),
    (2.0, "p99 ITL ms"): (263.0, 50.0),
    (0.2, "median TTFT s"): (0.7, 2.2),
}
ARTICLE_MEDIAN_ITL_MS = (21.0, 24.0)


@dataclass
class RequestTiming:
    ttft: float
    gaps: list[float] = field(default_factory=list)


ENGINE_MODEL = "Qwen/Qwen2.5-7B-Instruct"


def engine_flags(time_scale: float) -> list[str]:
    """The article's engines: no prefix caching, a 2048-token budget (L40S default)."""
    return [
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        "2048",
        "--sim-time-scale",
        str(time_scale),
    ]


async def stream_tokens(
    client: httpx.AsyncClient, url: str, body: dict[str, object], started: float, scale: float
) -> RequestTiming:
    """Token times from the engine's simulated clock (no client or event-loop jitter)."""
    times: list[float] = []
    headers = {"X-PDServe-Sim-Timing": "1"}
    async with client.stream(
        "POST", f"{url}/inference/v1/generate", json=body, headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                if "sim_time" in event:
                    times.append(float(event["sim_time"]))
    if not times:
        raise RuntimeError(f"{url} streamed no tokens")
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return RequestTiming(ttft=times[0] - started / scale, gaps=gaps)


async def one_request(
    client: httpx.AsyncClient,
    mode: str,
    urls: list[str],
    index: int,
    prompt: list[int],
    output_len: int,
    scale: float,
) -> RequestTiming:
    started = time.monotonic()
    params = {"max_tokens": output_len, "ignore_eos": True, "seed": index}
    body: dict[str, object] = {
        "request_id": f"r{index}",
        "token_ids": prompt,
        "stream": True,
        "sampling_params": params,
    }
    if mode == "DP=2":
        return await stream_tokens(client, urls[index % 2], body, started, scale)
    prefill = await client.post(
        f"{urls[0]}/inference/v1/generate",
        json={
            **body,
            "stream": False,
            "sampling_params": {**params, "max_tokens": 1},
            "kv_transfer_params": prefill_handoff_params(),
        },
    )
    prefill.raise_for_status()
    body["kv_transfer_params"] = prefill.json()["kv_transfer_params"]
    return await stream_tokens(client, urls[1], body, started, scale)


async def send_load(
    mode: str,
    urls: list[str],
    rate: float,
    requests: int,
    prompt_len: int,
    output_len: int,
    scale: float,
    seed: int,
) -> list[RequestTiming]:
    rng = random.Random(seed)
    words = SimTokenizer().word_ids()
    prompts: list[list[int]] = []
    offsets: list[float] = []  # Poisson arrivals, in simulated seconds
    arrival = 0.0
    for _ in range(requests):
        prompts.append([rng.choice(words) for _ in range(prompt_len)])
        offsets.append(arrival)
        arrival += rng.expovariate(rate)
    timings: dict[int, RequestTiming] = {}
    async with httpx.AsyncClient(timeout=None) as client:

        async def send(index: int) -> None:
            prompt = prompts[index]
            timings[index] = await one_request(client, mode, urls, index, prompt, output_len, scale)

        await drive(range(requests), send, offset=offsets.__getitem__, clock=Clock(scale))
    return [timings[index] for index in range(requests)]


def run_rate(
    mode: str,
    rate: float,
    requests: int,
    prompt_len: int,
    output_len: int,
    scale: float,
    seed: int,
) -> list[RequestTiming]:
    roles = ["both", "both"] if mode == "DP=2" else ["prefill", "decode"]
    with Processes() as procs:
        urls = [
            procs.engine(ENGINE_MODEL, role=role, tokens_only=True, extra=engine_flags(scale)).url
            for role in roles
        ]
        return asyncio.run(
            send_load(mode, urls, rate, requests, prompt_len, output_len, scale, seed)
        )


def summarize(timings: list[RequestTiming]) -> dict[str, float]:
    gaps = [g for t in timings for g in t.gaps]
    ttfts = [t.ttft for t in timings]
    return {
        "median ITL ms": statistics.median(gaps) * 1000,
        "p99 ITL ms": percentile(gaps, 99) * 1000,
        "median TTFT s": statistics.median(ttfts),
        "p99 TTFT s": percentile(ttfts, 99),
    }


def main(argv: Sequence[str]) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="pdserve sim experiment article", description=__doc__)
    parser.add_argument("--rates", default="0.2,0.4,1,2", help="requests per second")
    parser.add_argument("--requests", type=int, default=100, help="per rate and setup")
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[tuple[str, float], dict[str, float]] = {}
    started = time.monotonic()
    for rate in rates:
        for mode in ("DP=2", "1P1D"):
            timings = run_rate(
                mode,
                rate,
                args.requests,
                args.prompt_len,
                args.output_len,
                args.time_scale,
                args.seed,
            )
            results[(mode, rate)] = summarize(timings)
            print(
                f"  {mode:5} at {rate:g} req/s: "
                + ", ".join(f"{k} {v:.3g}" for k, v in results[(mode, rate)].items()),
                flush=True,
            )
    print(
        f"\n{args.requests} requests per point, ~{args.prompt_len} in / {args.output_len} out, "
        f"time scale {args.time_scale:g} ({time.monotonic() - started:.0f} s wall)\n"
    )
    print("| rate req/s | metric | DP=2 sim | DP=2 article | 1P1D sim | 1P1D article |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rate in rates:
        for metric in ("median ITL ms", "p99 ITL ms", "median TTFT s"):
            article = ARTICLE.get((rate, metric))
            if metric == "median ITL ms":
                article = ARTICLE_MEDIAN_ITL_MS
            a_dp, a_pd = (f"{article[0]:.3g}", f"{article[1]:.3g}") if article else ("", "")
            print(
                f"| {rate:g} | {metric} | {results[('DP=2', rate)][metric]:.3g} | {a_dp} | "
                f"{results[('1P1D', rate)][metric]:.3g} | {a_pd} |"
            )
    return 0
