"""`pdserve bench scenario NAME`: the articles' experiments, scripted on simulated engines behind
the pdserve gateway (see scenarios.cli for the whole story).

deployments: what runs; points: a point and its fingerprint; measure: measuring a point;
cache: reusing an identical point's records; tables, verdict, report: the report section;
article, routing: the scenarios; cli: `pdserve bench scenario`."""

from __future__ import annotations

from pdserve.bench.scenarios.article import (
    article,
    chunked,
)
from pdserve.bench.scenarios.cli import (
    SCENARIOS,
    SEEDED,
    main,
    parser,
    section_flags,
)
from pdserve.bench.scenarios.deployments import (
    AGGREGATED,
    AGGREGATED_AGAIN,
    ARTICLE_RATES,
    ARTICLE_SLO,
    AUTO_FAST,
    AUTO_SLOW,
    CHUNK_BUDGETS,
    FAST_KV,
    KV_BYTES_PER_TOKEN,
    MIX_RATE_TWO_ENGINES,
    MIX_RATES_ONE_ENGINE,
    MODEL,
    PD_FAST,
    PD_SLOW,
    SIMGATEWAY,
    SLOW_KV,
    UNCHUNKED,
    Deployment,
    KvPath,
    Mode,
    article_workload,
    budget_deployment,
    mix_workload,
)
from pdserve.bench.scenarios.measure import (
    gateway_counters,
    run_point,
    sweep,
)
from pdserve.bench.scenarios.points import (
    Interrupted,
    Options,
    Point,
)
from pdserve.bench.scenarios.report import (
    Section,
    minutes,
    render_section,
    write_section,
)
from pdserve.bench.scenarios.routing import (
    TIME_SCALES,
    routing,
    timescale,
)
from pdserve.bench.scenarios.tables import (
    MIX_HEADERS,
    article_cell,
    chart_dir,
    decisions,
    goodput_cell,
    goodput_cells,
    images,
    mix_description,
    mix_row,
    pair,
    stat,
    sweep_charts,
)
from pdserve.bench.scenarios.verdict import (
    met,
    noise_allowance,
    verdict,
)

__all__ = [
    "AGGREGATED",
    "AGGREGATED_AGAIN",
    "ARTICLE_RATES",
    "ARTICLE_SLO",
    "AUTO_FAST",
    "AUTO_SLOW",
    "CHUNK_BUDGETS",
    "FAST_KV",
    "KV_BYTES_PER_TOKEN",
    "MIX_HEADERS",
    "MIX_RATES_ONE_ENGINE",
    "MIX_RATE_TWO_ENGINES",
    "MODEL",
    "PD_FAST",
    "PD_SLOW",
    "SCENARIOS",
    "SEEDED",
    "SIMGATEWAY",
    "SLOW_KV",
    "TIME_SCALES",
    "UNCHUNKED",
    "Deployment",
    "Interrupted",
    "KvPath",
    "Mode",
    "Options",
    "Point",
    "Section",
    "article",
    "article_cell",
    "article_workload",
    "budget_deployment",
    "chart_dir",
    "chunked",
    "decisions",
    "gateway_counters",
    "goodput_cell",
    "goodput_cells",
    "images",
    "main",
    "met",
    "minutes",
    "mix_description",
    "mix_row",
    "mix_workload",
    "noise_allowance",
    "pair",
    "parser",
    "render_section",
    "routing",
    "run_point",
    "section_flags",
    "stat",
    "sweep",
    "sweep_charts",
    "timescale",
    "verdict",
    "write_section",
]
