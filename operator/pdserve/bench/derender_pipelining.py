"""Render CPU per streamed token with derender pipelining vs one derender call per token, under
concurrent streams, with the TTFT each gives (zero-latency simulated render and engine).

    python -m pdserve.bench.derender_pipelining [--streams 32 --stream-tokens 256]

What the gateway itself costs per request, beside vllm-router and vLLM's toy proxy, is
`pdserve bench overhead`."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
from collections.abc import Sequence

import httpx

from pdserve.bench.overhead import MODEL, SIM_MODEL, ZERO_LATENCY, routing
from pdserve.loadgen import drive, first_event
from pdserve.sim.procs import Processes, cpu_seconds

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


async def stream_load(url: str, streams: int, max_tokens: int) -> tuple[int, list[float]]:
    """`streams` streamed chats sent at once: the tokens asked for, each stream's TTFT."""
    body = {**CHAT, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(request: dict[str, object]) -> None:
            nonlocal tokens
            ttft = await first_event(client, f"{url}/v1/chat/completions", request)
            if ttft is not None:
                ttfts.append(ttft)
            tokens += max_tokens

        await drive(itertools.repeat(body, streams), send)  # open loop: all at once
    return tokens, ttfts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    print(
        f"Render CPU per streamed token, {args.streams} concurrent streams x "
        f"{args.stream_tokens} tokens (reasoning parser on):"
    )
    print("| derender | render CPU ms per token | derender calls | median TTFT ms |")
    print("| --- | --- | --- | --- |")
    with Processes() as procs:
        for label, extra in (
            ("pipelined", ()),
            ("one call per token", ("--no-derender-pipelining",)),
        ):
            render = procs.render(
                SIM_MODEL, served_model_name=MODEL, extra=["--reasoning-parser", "qwen3"]
            )
            engine = procs.engine(
                SIM_MODEL, tokens_only=True, served_model_name=MODEL, extra=ZERO_LATENCY
            )
            config = routing("tokens", {"render": [render.url], "decode": [engine.url]})
            gateway = procs.gateway(config, "--max-inflight", "4096", *extra)
            before = cpu_seconds(render.process.pid)
            tokens, ttfts = asyncio.run(stream_load(gateway.url, args.streams, args.stream_tokens))
            used = cpu_seconds(render.process.pid) - before
            metrics = httpx.get(f"{render.url}/metrics").text
            calls = next(
                (
                    float(line.split()[-1])
                    for line in metrics.splitlines()
                    if line.startswith('pdserve_sim_render_derender_calls_total{stream="true"}')
                ),
                0.0,
            )
            print(
                f"| {label} | {1000 * used / tokens:.3f} | {calls:.0f} | "
                f"{statistics.median(ttfts) * 1000:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
