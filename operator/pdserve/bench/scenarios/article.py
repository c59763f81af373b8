"""The article's experiment (DP=2 vs 1P1D) and the chunked-prefill matrix."""

from __future__ import annotations

import sys

from pdserve.bench import plots
from pdserve.bench.report import table
from pdserve.bench.scenarios.deployments import (
    AGGREGATED,
    ARTICLE_RATES,
    CHUNK_BUDGETS,
    FAST_KV,
    MIX_RATES_ONE_ENGINE,
    PD_FAST,
    PD_SLOW,
    SLOW_KV,
    UNCHUNKED,
    article_workload,
    budget_deployment,
    mix_workload,
)
from pdserve.bench.scenarios.measure import sweep
from pdserve.bench.scenarios.points import Options
from pdserve.bench.scenarios.report import Section
from pdserve.bench.scenarios.tables import (
    MIX_HEADERS,
    article_cell,
    chart_dir,
    goodput_cell,
    mix_description,
    mix_row,
    pair,
    stat,
    sweep_charts,
)
from pdserve.bench.summary import Slo


def article(options: Options) -> Section:
    rates = options.rates or ARTICLE_RATES
    n = options.num_prompts or 60
    deployments = (AGGREGATED, PD_SLOW, PD_FAST)
    points = sweep(deployments, article_workload(), rates, n + 5, 5, options)
    labels = [d.label for d in deployments]
    headers = ["rate req/s", *labels, "article DP=2", "article 1P1D"]
    itl_rows, ttft_rows, good_rows = [], [], []
    for rate in rates:
        mine = [points[(label, rate)] for label in labels]
        itl_rows.append(
            [
                f"{rate:g}",
                *(pair(p, "fixed", "itl_ms") for p in mine),
                article_cell(rate, "ITL", 0),
                article_cell(rate, "ITL", 1),
            ]
        )
        ttft_rows.append(
            [
                f"{rate:g}",
                *(pair(p, "fixed", "ttft_ms") for p in mine),
                article_cell(rate, "TTFT", 0),
                article_cell(rate, "TTFT", 1),
            ]
        )
        good_rows.append([f"{rate:g}", *(goodput_cell(p) for p in mine)])
    charts = sweep_charts(list(points.values()), options, "article_")
    body = [
        f"{n} measured requests per point (+5 warm-up), ~8000 prompt tokens, 256 output "
        "tokens, Poisson arrivals, prefix caching off, `max_num_batched_tokens` 2048. The slow "
        f"KV path is {SLOW_KV.bandwidth_gb_s:g} GB/s + {SLOW_KV.overhead_ms:g} ms "
        f"({SLOW_KV.transfer_ms(8000) / 1000:.2f} s for 8k tokens, as the article measured), "
        f"the fast one {FAST_KV.bandwidth_gb_s:g} GB/s + {FAST_KV.overhead_ms:g} ms "
        f"({FAST_KV.transfer_ms(8000):.0f} ms). Aggregated DP=2 is two engines behind the "
        "gateway in Aggregated mode; 1P1D is one prefill and one decode engine in "
        "Disaggregated mode. The article's columns are the figures it printed (2x L40S).",
        "",
        "ITL, median / p99, simulated ms:",
        "",
        table(headers, itl_rows),
        "",
        "TTFT, median / p99, simulated ms:",
        "",
        table(headers, ttft_rows),
        "",
        "Goodput, requests/s meeting TTFT <= 2000 ms and TPOT <= 30 ms (share of requests):",
        "",
        table(["rate req/s", *labels], good_rows),
    ]
    return Section("article", "The article's experiment: DP=2 vs 1P1D", body, charts)


def chunked(options: Options) -> Section:
    n = options.num_prompts or 150
    rates = options.rates or MIX_RATES_ONE_ENGINE
    workload = mix_workload()
    deployments = [budget_deployment(b) for b in (*CHUNK_BUDGETS, UNCHUNKED)]
    points = sweep(deployments, workload, rates, n + 10, 10, options, slo=Slo())
    rows = [
        [f"{rate:g}", str(d.max_num_batched_tokens), *mix_row(points[(d.label, rate)])]
        for rate in rates
        for d in deployments
    ]
    budgets = [float(d.max_num_batched_tokens) for d in deployments]
    itl, throughput, wait = [], [], []
    for color, rate in enumerate(rates):
        mine = [points[(d.label, rate)] for d in deployments]
        at = f"at {rate:g} req/s"
        for q, dashed in (("p99", False), ("median", True)):
            itl.append(
                plots.Series(
                    f"chat ITL {q} {at}",
                    budgets,
                    [stat(p, "chat", "itl_ms", q) for p in mine],
                    color,
                    dashed,
                )
            )
        throughput.append(
            plots.Series(
                f"document input tokens/s {at}",
                budgets,
                [p["pdserve"]["classes"]["document"]["input_tokens_per_s"] for p in mine],
                color,
            )
        )
        wait += [
            plots.Series(
                f"oldest document wait {at}",
                budgets,
                [(p["pdserve"]["documents"] or {}).get("oldest_wait_ms") for p in mine],
                color,
            ),
            plots.Series(
                f"document E2E p95 {at}",
                budgets,
                [stat(p, "document", "e2e_ms", "p95") for p in mine],
                color,
                True,
            ),
        ]
    directory = chart_dir(options)
    charts = {
        "chunked_chat_itl.png": (itl, "Chat ITL vs token budget: p99 (solid), median (dashed)",
                                 "simulated ms", True),
        "chunked_documents.png": (throughput, "Document prefill throughput vs token budget",
                                  "input tokens per simulated second", False),
        "chunked_document_wait.png": (wait, "Document starvation vs token budget",
                                      "simulated ms", True),
    }  # fmt: skip
    for name, (series, title, ylabel, logy) in charts.items():
        reason = plots.line_chart(
            directory / name,
            series,
            title=f"{title} (rightmost: unchunked)",
            xlabel="max_num_batched_tokens",
            ylabel=ylabel,
            logx=True,
            logy=logy,
        )
        if reason:
            print(reason, file=sys.stderr)
    body = [
        "One aggregated engine behind the gateway; only `max_num_batched_tokens` changes (the "
        f"{UNCHUNKED} rows turn chunked prefill off). " + mix_description(workload, rates, n),
        "",
        "Times in simulated ms:",
        "",
        table(["rate req/s", "max_num_batched_tokens", *MIX_HEADERS], rows),
    ]
    return Section("chunked", "Chunked prefill: token budget vs chat ITL and documents", body,
                   [c for c in charts if (directory / c).exists()])  # fmt: skip
