"""The gateway's routing modes under the article's load and the collision mix, and what the time
scale distorts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.bench.report import num, table
from pdserve.bench.scenarios.deployments import (
    AGGREGATED,
    AGGREGATED_AGAIN,
    ARTICLE_RATES,
    AUTO_FAST,
    AUTO_SLOW,
    MIX_RATE_TWO_ENGINES,
    PD_FAST,
    PD_SLOW,
    Deployment,
    article_workload,
    mix_workload,
)
from pdserve.bench.scenarios.measure import sweep
from pdserve.bench.scenarios.points import Options
from pdserve.bench.scenarios.report import Section
from pdserve.bench.scenarios.tables import (
    MIX_HEADERS,
    decisions,
    goodput_cell,
    goodput_cells,
    mix_description,
    mix_row,
    pair,
    stat,
    sweep_charts,
)
from pdserve.bench.scenarios.verdict import verdict
from pdserve.bench.summary import Slo


def routing(options: Options) -> Section:
    rates = options.rates or ARTICLE_RATES
    n = options.num_prompts or 60
    seeds = range(options.seeds)
    deployments = (AGGREGATED, AGGREGATED_AGAIN, PD_SLOW, AUTO_SLOW, PD_FAST, AUTO_FAST)
    runs = [
        sweep(deployments, article_workload(), rates, n + 5, 5, options, seed=seed)
        for seed in seeds
    ]
    points = runs[0]

    def over_seeds(deployment: Deployment, rate: float) -> list[dict[str, Any]]:
        return [run[(deployment.label, rate)] for run in runs]

    rows, why = [], []
    for rate in rates:
        agg, again = over_seeds(AGGREGATED, rate), over_seeds(AGGREGATED_AGAIN, rate)
        row = [f"{rate:g}", goodput_cells(agg), goodput_cells(again)]
        for pd, auto in ((PD_SLOW, AUTO_SLOW), (PD_FAST, AUTO_FAST)):
            p, a = over_seeds(pd, rate), over_seeds(auto, rate)
            row += [goodput_cells(p), goodput_cells(a), verdict(a, [agg, p])]
            seed0 = a[0]
            why.append(
                [
                    f"{rate:g}",
                    auto.kv.name,
                    decisions(seed0),
                    pair(seed0, "fixed", "ttft_ms"),
                    pair(seed0, "fixed", "itl_ms"),
                ]
            )
        rows.append(row)
    mix_rate = MIX_RATE_TWO_ENGINES
    mix_n = options.num_prompts or 200
    workload = mix_workload()
    fairness = (
        AGGREGATED,
        replace(PD_FAST, label="Disaggregated, fair queue on"),
        replace(PD_FAST, label="Disaggregated, fair queue off", fair_queue=False),
        replace(AUTO_FAST, label="Auto, fair queue on"),
        replace(AUTO_FAST, label="Auto, fair queue off", fair_queue=False),
        *(
            replace(d, label=f"{name}, render pool, fair queue {'on' if on else 'off'}",
                    render=True, fair_queue=on)
            for name, d in (("Disaggregated", PD_FAST), ("Auto", AUTO_FAST))
            for on in (True, False)
        ),
    )  # fmt: skip
    mix_rows = []
    for seed in seeds:
        mix = sweep(fairness, workload, [mix_rate], mix_n + 10, 10, options, slo=Slo(), seed=seed)
        for d in fairness:
            label = d.label if len(seeds) == 1 else f"{d.label}, seed {seed}"
            mix_rows.append([label, *mix_row(mix[(d.label, mix_rate)])])
    charted = [p for (label, _), p in points.items() if label != AGGREGATED_AGAIN.label]
    charts = sweep_charts(charted, options, "routing_")
    repeated = (
        ""
        if len(seeds) == 1
        else f" Every point ran with {len(seeds)} seeds (other arrival times and prompts): "
        "goodput cells are the mean (lowest-highest), the verdict sums the requests that met "
        "the SLO over the seeds and lists Auto minus the better mode seed by seed; the "
        "decisions table and the charts show seed 0."
    )
    body = [
        "The article's load (as above) through each routing mode of the gateway; Disaggregated "
        "and Auto run on one prefill + one decode engine, Aggregated on two engines. Goodput = "
        "requests/s with TTFT <= 2000 ms and TPOT <= 30 ms (share of requests); 'Auto >= best' "
        "compares the number of requests that met the SLO under Auto with the better of "
        "Aggregated and Disaggregated on the same KV path (the same planned requests in each). "
        "TPOT sits near its 30 ms limit at these rates, so where each request lands decides its "
        "fate, and any difference in placement early in a run reshuffles which requests meet "
        "the SLO: a shortfall within two standard errors of the per-seed differences is "
        "reported as seed noise, not as a win. 'Aggregated, other order' lists the same two "
        "engines the other way round: a mirror image of the first (identical engines), so "
        "their distance is the run-to-run jitter of one deployment, not placement noise."
        + repeated,
        "",
        table(
            [
                "rate req/s",
                "Aggregated",
                "Aggregated, other order",
                "Disaggregated slow",
                "Auto slow",
                "Auto >= best (slow)",
                "Disaggregated fast",
                "Auto fast",
                "Auto >= best (fast)",
            ],
            rows,
        ),
        "",
        "What Auto decided (gateway counters, warm-up included) and what it got, median / p99 "
        "simulated ms:",
        "",
        table(["rate req/s", "KV path", "Auto decisions", "TTFT", "ITL"], why),
        "",
        "Fair prefill admission on the collision mix (fast KV path; Aggregated for reference, "
        "where no request goes through a prefill pool). The render pool rows put a render "
        "server in front and engines speaking token ids: the gateway then classes and routes "
        "by exact prompt token counts; without it, it estimates them from characters. "
        + mix_description(workload, [mix_rate], mix_n),
        "",
        table(["deployment", *MIX_HEADERS], mix_rows),
    ]
    return Section("routing", "Routing modes: Aggregated, Disaggregated, Auto", body, charts)


TIME_SCALES = (1.0, 0.5, 0.25, 0.1)


def timescale(options: Options) -> Section:
    n = options.num_prompts or 40
    rate = (options.rates or (1.0,))[0]
    rows = []
    default_scale = options.time_scale
    try:
        for scale in TIME_SCALES:
            options.time_scale = scale
            for deployment in (AGGREGATED, PD_SLOW, AUTO_SLOW, PD_FAST):
                [summary] = sweep(
                    [deployment], article_workload(), [rate], n + 3, 3, options
                ).values()
                rows.append(
                    [f"{scale:g}", deployment.label, pair(summary, "fixed", "ttft_ms"),
                     f"{num(stat(summary, 'fixed', 'itl_ms', 'median'))} / "
                     f"{num(stat(summary, 'fixed', 'itl_ms', 'p95'))} / "
                     f"{num(stat(summary, 'fixed', 'itl_ms', 'p99'))}",
                     num(stat(summary, "fixed", "tpot_ms", "median")),
                     goodput_cell(summary),
                     num(summary["pdserve"]["wall_seconds"])]
                )  # fmt: skip
    finally:
        options.time_scale = default_scale
    body = [
        f"The same load ({n} requests of the article's workload at {rate:g} req/s, same seed) "
        "at several time scales. Real CPU work (HTTP, JSON, tokenizing 8k-token prompts, event "
        "loop delays) is not scaled, so the smaller the scale the more of it shows up as "
        "simulated time: in TTFT and in ITL tails. Scale 1 is the reference.",
        "",
        table(
            [
                "time scale",
                "deployment",
                "TTFT median / p99",
                "ITL median / p95 / p99",
                "TPOT median",
                "goodput (share)",
                "wall s of the load",
            ],
            rows,
        ),
    ]
    scales = "time scales " + ", ".join(f"{t:g}" for t in TIME_SCALES)
    return Section("timescale", "What the time scale distorts", body, time_scales=scales)
