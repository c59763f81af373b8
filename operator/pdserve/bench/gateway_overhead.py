"""What the gateway costs, measured side by side on zero-latency simulated engines.

    python -m pdserve.bench.gateway_overhead [--toy-proxy PATH --toy-python PYTHON]

1. Added latency (p50/p99 at concurrency 1) and throughput (closed loop at --concurrency) for:
   the decode engine called directly; route 2 (OpenAI P/D) through pdserve and through vLLM's toy
   proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, given by path and run with
   an interpreter that has fastapi + uvicorn; it is never part of this repository); route 1
   (render + P/D) through pdserve. Requests/s per core = completed requests / CPU seconds the
   proxy process used, so proxies compare fairly on a machine the engines share.
2. Render CPU per streamed token with derender pipelining vs one derender call per token, under
   concurrent streams, with the TTFT each gives.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.loadgen import drive, first_event, timed_post
from pdserve.sim.procs import Proc, Processes, cpu_seconds, free_port
from pdserve.stats import percentile

ZERO_LATENCY = [
    "--sim-step-base-ms",
    "0",
    "--sim-per-prefill-token-ms",
    "0",
    "--sim-per-decode-seq-ms",
    "0",
    "--sim-per-decode-context-token-us",
    "0",
    "--sim-kv-overhead-ms",
    "0",
    "--sim-kv-bandwidth-gb-s",
    "1000000",
]
MODEL = "qwen"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


SIM_MODEL = "Qwen/Qwen3-8B"


def start_engine(procs: Processes, role: str, *, tokens: bool, reasoning: bool = False) -> Proc:
    extra = [*ZERO_LATENCY, *(["--sim-reasoning"] if reasoning else [])]
    return procs.engine(
        SIM_MODEL, role=role, tokens_only=tokens, served_model_name=MODEL, extra=extra
    )


def start_render(procs: Processes) -> Proc:
    return procs.render(SIM_MODEL, served_model_name=MODEL, extra=["--reasoning-parser", "qwen3"])


def start_gateway(procs: Processes, config: dict[str, object], *extra: str) -> Proc:
    return procs.gateway(config, "--max-inflight", "4096", *extra)


def routing(engine_api: str, endpoints: dict[str, list[str]]) -> dict[str, object]:
    pool = {"service": "x", "port": 8000}
    return {
        "model": MODEL,
        "engineApi": engine_api,
        "routing": {"mode": "Disaggregated"},
        "pools": {
            "render": pool if "render" in endpoints else None,
            "prefill": pool if "prefill" in endpoints else None,
            "decode": pool,
        },
        "endpoints": {k: [{"url": u} for u in v] for k, v in endpoints.items()},
    }


async def closed_loop(url: str, concurrency: int, seconds: float) -> tuple[list[float], int]:
    """`concurrency` clients sending CHAT one after another for `seconds`: the latency of each
    request answered 200."""
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def send(body: dict[str, object]) -> None:
            latency = await timed_post(client, f"{url}/v1/chat/completions", body)
            if latency is not None:
                latencies.append(latency)

        await drive(itertools.repeat(CHAT), send, clients=concurrency, deadline=stop_at)
    return latencies, len(latencies)


@dataclass
class Row:
    target: str
    p50_ms: float
    p99_ms: float
    rps: float
    rps_per_core: float | None


def measure(name: str, url: str, pid: int | None, concurrency: int, seconds: float) -> Row:
    light, _ = asyncio.run(closed_loop(url, 1, seconds / 2))
    before = cpu_seconds(pid) if pid else 0.0
    started = time.monotonic()
    _, done = asyncio.run(closed_loop(url, concurrency, seconds))
    wall = time.monotonic() - started
    used = (cpu_seconds(pid) - before) if pid else 0.0
    return Row(
        name,
        statistics.median(light) * 1000,
        percentile(light, 99) * 1000,
        done / wall,
        (done / used) if used > 0 else None,
    )


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
    parser.add_argument("--toy-proxy", type=Path, help="path to vLLM's toy_proxy_server.py")
    parser.add_argument(
        "--toy-python",
        default=sys.executable,
        help="interpreter with fastapi and uvicorn for the toy proxy",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    procs = Processes()
    rows: list[Row] = []
    try:
        prefill = start_engine(procs, "prefill", tokens=False)
        decode = start_engine(procs, "decode", tokens=False)
        direct = start_engine(procs, "both", tokens=False)
        rows.append(
            measure("decode engine, direct", direct.url, None, args.concurrency, args.seconds)
        )
        route2 = start_gateway(
            procs, routing("openai", {"prefill": [prefill.url], "decode": [decode.url]})
        )
        rows.append(
            measure(
                "route 2 via pdserve",
                route2.url,
                route2.process.pid,
                args.concurrency,
                args.seconds,
            )
        )
        if args.toy_proxy:
            port = free_port()
            toy = procs.start(
                [
                    args.toy_python,
                    str(args.toy_proxy),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--prefiller-hosts",
                    "127.0.0.1",
                    "--prefiller-ports",
                    prefill.url.rsplit(":", 1)[1],
                    "--decoder-hosts",
                    "127.0.0.1",
                    "--decoder-ports",
                    decode.url.rsplit(":", 1)[1],
                ],
                port,
                health="/healthcheck",
            )
            rows.append(
                measure(
                    "route 2 via vLLM toy proxy",
                    toy.url,
                    toy.process.pid,
                    args.concurrency,
                    args.seconds,
                )
            )
        render = start_render(procs)
        tprefill = start_engine(procs, "prefill", tokens=True)
        tdecode = start_engine(procs, "decode", tokens=True)
        route1 = start_gateway(
            procs,
            routing(
                "tokens",
                {"render": [render.url], "prefill": [tprefill.url], "decode": [tdecode.url]},
            ),
        )
        rows.append(
            measure(
                "route 1 via pdserve",
                route1.url,
                route1.process.pid,
                args.concurrency,
                args.seconds,
            )
        )

        print(
            f"\n| target | p50 ms (c=1) | p99 ms (c=1) | req/s (c={args.concurrency}) "
            "| req/s per proxy core |"
        )
        print("| --- | --- | --- | --- | --- |")
        for row in rows:
            per_core = f"{row.rps_per_core:.0f}" if row.rps_per_core else "-"
            latency = f"{row.p50_ms:.2f} | {row.p99_ms:.2f}"
            print(f"| {row.target} | {latency} | {row.rps:.0f} | {per_core} |")

        print(
            f"\nRender CPU per streamed token, {args.streams} concurrent streams x "
            f"{args.stream_tokens} tokens (reasoning parser on):"
        )
        print("| derender | render CPU ms per token | derender calls | median TTFT ms |")
        print("| --- | --- | --- | --- |")
        for label, extra in (
            ("pipelined", ()),
            ("one call per token", ("--no-derender-pipelining",)),
        ):
            stream_render = start_render(procs)
            engine = start_engine(procs, "both", tokens=True)
            gateway = start_gateway(
                procs,
                routing("tokens", {"render": [stream_render.url], "decode": [engine.url]}),
                *extra,
            )
            before = cpu_seconds(stream_render.process.pid)
            tokens, ttfts = asyncio.run(stream_load(gateway.url, args.streams, args.stream_tokens))
            used = cpu_seconds(stream_render.process.pid) - before
            metrics = httpx.get(f"{stream_render.url}/metrics").text
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
    finally:
        procs.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
