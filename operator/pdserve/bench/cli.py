"""`pdserve bench run|scenario`: load any OpenAI-compatible endpoint and report tails per class,
goodput against SLOs and document starvation; or run one of the scripted scenarios on the
simulator."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench import plots
from pdserve.bench.records import write_jsonl
from pdserve.bench.report import text_block
from pdserve.bench.runner import Load, Progress, RunResult, Target, run_load
from pdserve.bench.summary import Slo, compact, summarize
from pdserve.bench.workload import (
    DOCUMENT_GROUPS,
    Lengths,
    Workload,
    collision_mix,
    fixed,
    parse_groups,
    plan,
)

USAGE = """usage: pdserve bench {run,scenario,overhead} ...

  run [flags]          load an OpenAI-compatible endpoint (a pdserve gateway, vLLM, the simulator)
  scenario NAME        a scripted scenario on simulated engines: article, chunked, routing,
                       timescale, all
  overhead [flags]     what a P/D proxy costs: pdserve beside vllm-router and vLLM's toy proxy,
                       on stub engines, side by side

`pdserve bench run --help` and `pdserve bench scenario --help` list the flags."""


def _numbers(text: str, kind: type[float] | type[int] = float) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers")
    return values


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _slo(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=["fixed", "mix"], default="fixed")
    group.add_argument(
        "--prompt",
        choices=["random", "filler"],
        default="random",
        help="random words, or a neutral filler sentence behind a unique head",
    )
    group.add_argument("--input-len", type=int, default=1024, help="fixed: prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="fixed: output tokens")
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times (1 = Poisson); chat's in a mix",
    )
    group.add_argument("--chat-share", type=float, default=0.7, help="mix: chat share of the rate")
    group.add_argument("--chat-input", type=_lengths, default=Lengths(200, 600))
    group.add_argument("--chat-output", type=_lengths, default=Lengths(100, 200))
    group.add_argument(
        "--doc-groups",
        default=",".join(f"{g.name}:{g.weight:g}:{g.input}" for g in DOCUMENT_GROUPS),
        help="mix: document groups NAME:WEIGHT:LOW-HIGH, lengths log-uniform (a heavy tail)",
    )
    group.add_argument("--doc-output", type=_lengths, default=Lengths(64, 128))
    group.add_argument("--doc-burstiness", type=float, default=1.0)
    group.add_argument("--num-prompts", type=int, default=100, help="per rate, warm-up included")
    group.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="the first N requests of each run are sent but not measured",
    )
    group.add_argument("--seed", type=int, default=0)  # fmt: skip


def workload_from(args: argparse.Namespace) -> Workload:
    if args.workload == "fixed":
        return fixed(
            args.input_len, args.output_len, prompt=args.prompt, burstiness=args.burstiness
        )
    return collision_mix(
        chat_share=args.chat_share,
        chat_input=args.chat_input,
        chat_output=args.chat_output,
        documents=parse_groups(args.doc_groups, args.doc_output),
        chat_burstiness=args.burstiness,
        document_burstiness=args.doc_burstiness,
        prompt=args.prompt,
    )


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve bench run",
        description="Load an OpenAI-compatible endpoint and report TTFT, ITL, TPOT, E2E per "
        "request class, goodput against SLOs, document throughput and waiting, errors. Writes "
        "per-request JSON Lines, a vLLM-bench-compatible JSON per rate, summary.json and PNGs.",
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="default: the first of GET /v1/models")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding a Bearer key (if set)",
    )
    target.add_argument(
        "--metrics-url",
        default="auto",
        help="the gateway's /metrics for its document queue: auto (BASE/metrics), none, or a URL",
    )
    target.add_argument(
        "--no-class-header",
        dest="class_header",
        action="store_false",
        help="do not send X-PDServe-Class: chat|document",
    )
    target.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    load = parser.add_argument_group("load")
    rates = load.add_mutually_exclusive_group()
    rates.add_argument(
        "--rate", type=_numbers, help="offered requests/s, a sweep: 0.2,0.4,1 (default 1)"
    )
    rates.add_argument(
        "--concurrency",
        type=lambda t: _numbers(t, int),
        help="closed loop with N requests in flight, a sweep: 1,8,32",
    )
    load.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per simulated second of a simulator target (its "
        "--sim-time-scale); times are reported in simulated units",
    )
    load.add_argument("--max-inflight", type=int, default=1024)
    load.add_argument("--request-timeout", type=float, default=600.0, help="real seconds")
    add_workload_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument(
        "--slo",
        type=_slo,
        default=Slo(),
        help="goodput limits in ms, e.g. ttft=2000,tpot=30 (also e2el=)",
    )
    out.add_argument("--label", default="run", help="the configuration's name in reports")
    out.add_argument("--out", type=Path, default=Path("bench-results"))
    out.add_argument("--no-plots", dest="plots", action="store_false")
    out.add_argument("--no-progress", dest="progress", action="store_false")  # fmt: skip
    return parser


def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def point_file(rate: float | None, concurrency: int | None) -> str:
    return f"rate-{rate:g}" if rate is not None else f"concurrency-{concurrency}"


async def run_points(
    target: Target,
    workload: Workload,
    points: Sequence[tuple[float | None, int | None]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """One run per rate or concurrency; Ctrl-C ends the current one and skips the rest."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        print(
            "\ninterrupted: writing what was measured (Ctrl-C again to quit now)", file=sys.stderr
        )
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, interrupted)
    summaries = []
    try:
        for rate, concurrency in points:
            if stop.is_set():
                break
            requests = plan(
                workload, args.num_prompts, rate=rate, seed=args.seed, warmup=args.warmup,
                id_prefix=args.label,
            )  # fmt: skip
            load = Load(
                rate=rate, concurrency=concurrency, time_scale=args.time_scale,
                max_inflight=args.max_inflight, request_timeout=args.request_timeout,
            )  # fmt: skip
            name = point_file(rate, concurrency)
            progress = Progress(f"{args.label} {name}", len(requests)) if args.progress else None
            result = await run_load(target, requests, load, stop=stop, progress=progress)
            summaries.append(write_point(result, target, workload, args, rate, concurrency))
            print(text_block(summaries[-1]), flush=True)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return summaries


def write_point(
    result: RunResult,
    target: Target,
    workload: Workload,
    args: argparse.Namespace,
    rate: float | None,
    concurrency: int | None,
) -> dict[str, Any]:
    summary = summarize(
        result,
        label=args.label,
        model=target.model,
        endpoint=target.endpoint,
        rate=rate,
        concurrency=concurrency,
        burstiness=args.burstiness,
        time_scale=args.time_scale,
        slo=args.slo,
        workload=workload.describe(),
    )
    directory = args.out / args.label
    name = point_file(rate, concurrency)
    write_jsonl(directory / f"{name}.jsonl", result.records)
    (directory / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def run(argv: Sequence[str]) -> int:
    args = run_parser().parse_args(argv)
    api_key = os.environ.get(args.api_key_env) or None
    try:
        workload = workload_from(args)
        model = args.model or discover_model(args.base_url, api_key)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:
        print(f"error: no --model given and GET /v1/models failed: {error}", file=sys.stderr)
        return 2
    metrics_url = {"auto": f"{args.base_url.rstrip('/')}/metrics", "none": None}.get(
        args.metrics_url, args.metrics_url
    )
    target = Target(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=api_key,
        metrics_url=metrics_url,
        class_header=args.class_header,
        ignore_eos=args.ignore_eos,
    )
    if args.concurrency:
        points: list[tuple[float | None, int | None]] = [(None, c) for c in args.concurrency]
    else:
        points = [(r, None) for r in (args.rate or [1.0])]
    summaries = asyncio.run(run_points(target, workload, points, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(
        json.dumps([compact(s) for s in summaries], indent=1) + "\n"
    )
    if args.plots:
        unit = "ms" if args.time_scale == 1 else "simulated ms"
        for reason in sorted(set(plots.sweep_charts(summaries, args.out, unit=unit))):
            print(reason, file=sys.stderr)
    print(f"results in {args.out}/", file=sys.stderr)
    return 130 if any(s["pdserve"]["interrupted"] for s in summaries) else 0


def main(argv: Sequence[str]) -> int:
    """`pdserve bench ARGV...` (argv without `pdserve bench`)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if argv[:1] == ["run"]:
        return run(argv[1:])
    if argv[:1] == ["overhead"]:
        from pdserve.bench.overhead import main as overhead

        return overhead(argv[1:])
    if argv[:1] == ["scenario"]:
        from pdserve.bench.scenarios import main as scenario

        return scenario(argv[1:])
    asked = list(argv[:1]) in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2
