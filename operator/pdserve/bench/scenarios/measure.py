"""Measuring a point: fresh processes for its deployment, its planned load through the
gateway, the gateway's counters; or its records of an earlier identical run. Then its summary."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.runner import Load, Progress, Target, run_load
from pdserve.bench.scenarios.cache import Measured, PointFiles, keep, keep_records, reuse
from pdserve.bench.scenarios.deployments import ARTICLE_SLO, MODEL, Deployment
from pdserve.bench.scenarios.points import Interrupted, Options, Point
from pdserve.bench.summary import Slo, compact, summarize
from pdserve.bench.workload import Workload, plan
from pdserve.sim.procs import Processes


def gateway_counters(text: str) -> dict[str, dict[str, float]]:
    """Auto decisions, fallbacks and requests per route and outcome, from the gateway's
    metrics."""
    wanted = {
        "pdserve_gateway_auto_decisions_total": ("auto_decisions", ("reason",)),
        "pdserve_gateway_fallbacks_total": ("fallbacks", ("reason",)),
        "pdserve_gateway_requests_total": ("routes", ("route", "outcome")),
    }
    out: dict[str, dict[str, float]] = {key: {} for key, _ in wanted.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                key, labels = wanted[sample.name]
                out[key][" ".join(sample.labels.get(label, "") for label in labels)] = sample.value
    return out


async def _measure(
    target: Target, point: Point, progress: Progress | None
) -> tuple[Any, dict[str, dict[str, float]]]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        requests = plan(
            point.workload,
            point.num_prompts,
            rate=point.rate,
            seed=point.seed,
            warmup=point.warmup,
            id_prefix="bench",
        )
        load = Load(rate=point.rate, time_scale=point.time_scale)
        result = await run_load(target, requests, load, stop=stop, progress=progress)
        async with httpx.AsyncClient(timeout=10) as client:
            counters = gateway_counters((await client.get(f"{target.base_url}/metrics")).text)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return result, counters


def measure(point: Point, files: PointFiles, options: Options) -> Measured:
    """Start the point's deployment afresh and send its load (Interrupted on Ctrl-C)."""
    label = f"{point.deployment.label} @ {point.rate:g} req/s"
    if point.seed:
        label += f", seed {point.seed}"
    progress = Progress(label, point.num_prompts) if options.progress else None
    started = time.monotonic()
    with Processes() as procs:
        files.gateway_log.unlink(missing_ok=True)
        url = point.deployment.start(procs, point.time_scale, files.gateway_log)
        target = Target(base_url=url, model=MODEL, metrics_url=f"{url}/metrics")
        result, counters = asyncio.run(_measure(target, point, progress))
    if result.interrupted:
        raise Interrupted
    return Measured(result, counters, time.monotonic() - started)


def run_point(point: Point, options: Options) -> dict[str, Any]:
    """A point's compact summary, measured now or from the records of an earlier identical run
    (summarized again, so the numbers always follow the current summary code)."""
    files = PointFiles.of(point, options.results)
    measured = reuse(point, files, fresh=options.fresh)
    if measured is not None:
        options.reused += 1
    else:
        measured = measure(point, files, options)
        keep_records(files, measured.result)
        options.measured += 1
    options.point_seconds += measured.seconds
    summary = summarize(
        measured.result,
        label=point.deployment.label,
        model=MODEL,
        rate=point.rate,
        burstiness=1.0,
        time_scale=point.time_scale,
        slo=point.slo,
        workload=point.workload.describe(),
    )
    keep(files, point, measured, summary)
    return compact(summary)


def sweep(
    deployments: Sequence[Deployment],
    workload: Workload,
    rates: Sequence[float],
    num_prompts: int,
    warmup: int,
    options: Options,
    slo: Slo = ARTICLE_SLO,
    seed: int = 0,
) -> dict[tuple[str, float], dict[str, Any]]:
    out = {}
    for deployment in deployments:
        if options.data_plane and deployment.mode == "Auto":
            deployment = replace(deployment, data_plane=True)
        for rate in rates:
            point = Point(
                deployment, workload, rate, num_prompts, warmup, options.time_scale, slo, seed
            )
            out[(deployment.label, rate)] = run_point(point, options)
    return out
