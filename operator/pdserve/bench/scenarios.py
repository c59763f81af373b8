"""`pdserve bench scenario NAME`: the articles' experiments, scripted on simulated engines behind
the pdserve gateway, reproducible in minutes.

- article: aggregated DP=2 vs 1P1D with a slow (the article's ~1.3 s for 8k tokens) and a fast KV
  path, ~8k-token prompts and 256-token answers, Poisson arrivals at 0.2-2 req/s;
- chunked: the chunked-prefill article's matrix: one engine, several max_num_batched_tokens,
  chats colliding with a heavy-tailed document stream;
- routing: the gateway's Aggregated, Disaggregated and Auto modes under the article's load
  (goodput at TTFT <= 2 s and TPOT <= 30 ms), and the collision mix with and without the
  gateway's fair prefill admission;
- timescale: one load at several time scales, to show what scaling the simulation distorts.

Engines run scaled (--time-scale: real seconds per simulated second) and every time is reported
in simulated units, so the numbers read as the modelled hardware's (the article's 2x L40S with
Qwen2.5-7B: ~21 ms decode steps, ~0.65 s per 8k-token prefill). The engines speak OpenAI (no
render pool: the gateway forwards each token as it arrives and estimates prompt lengths from
characters), except in the routing mix's render-pool rows (a render server and token-id engines:
exact prompt token counts). Each point (deployment, workload,
rate) starts fresh processes and is kept in the results folder under a fingerprint of all its
parameters; a rerun reuses it unless --fresh. Sections of the report are rewritten in place
between `<!-- bench:NAME -->` markers."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import plots
from pdserve.bench.records import read_jsonl, write_jsonl
from pdserve.bench.report import num, share, table
from pdserve.bench.runner import Load, Progress, QueueSample, RunResult, Target, run_load
from pdserve.bench.summary import Slo, compact, summarize
from pdserve.bench.workload import Workload, collision_mix, fixed, plan
from pdserve.sim.experiment import ARTICLE, ENGINE_MODEL
from pdserve.sim.procs import Processes, free_port, sim_engine_argv, sim_render_argv

MODEL = "bench"
SIMGATEWAY = [sys.executable, "-m", "pdserve.bench.simgateway"]
ARTICLE_SLO = Slo(ttft_ms=2000, tpot_ms=30)
ARTICLE_RATES = (0.2, 0.4, 0.7, 1.0, 1.5, 2.0)
KV_BYTES_PER_TOKEN = 56 * 1024  # Qwen2.5-7B bf16 (the simulator's default)
Mode = Literal["Aggregated", "Disaggregated", "Auto"]


@dataclass(frozen=True)
class KvPath:
    name: str
    bandwidth_gb_s: float
    overhead_ms: float

    def transfer_ms(self, tokens: int) -> float:
        return tokens * KV_BYTES_PER_TOKEN / (self.bandwidth_gb_s * 1e9) * 1000 + self.overhead_ms


SLOW_KV = KvPath("slow", 0.4, 100.0)  # the article's PCIe path without P2P: ~1.3 s for 8k tokens
FAST_KV = KvPath("fast", 50.0, 10.0)  # RDMA / NVLink class (400 Gb/s): ~20 ms for 8k tokens


@dataclass(frozen=True)
class Deployment:
    label: str
    mode: Mode
    prefill: int = 0
    decode: int = 2
    kv: KvPath = SLOW_KV
    max_num_batched_tokens: int = 2048
    chunked: bool = True
    fair_queue: bool = True
    render: bool = False
    """A render pool in front (tokens API): the gateway knows every prompt's exact token
    count; without, engines speak OpenAI and the gateway estimates it from characters."""
    reversed_engines: bool = False
    """List the engines to the gateway in the other order: ties between equally loaded
    engines break the other way (an equally good deployment, for the noise of comparisons)."""

    def engine_flags(self, time_scale: float) -> list[str]:
        flags = [
            "--no-enable-prefix-caching",  # as the article: cached prefixes would hide prefill
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--sim-time-scale",
            str(time_scale),
            "--sim-kv-bandwidth-gb-s",
            str(self.kv.bandwidth_gb_s),
            "--sim-kv-overhead-ms",
            str(self.kv.overhead_ms),
        ]
        if not self.chunked:
            flags.append("--no-enable-chunked-prefill")
        return flags

    def start(self, procs: Processes, time_scale: float, request_log: Path | None = None) -> str:
        """Engines (and a render server) and a gateway over them (logging each request's
        engines and Auto reason to `request_log`); the gateway's URL."""
        roles = ["prefill"] * self.prefill + ["decode" if self.prefill else "both"] * self.decode
        engines = []
        for role in roles:
            port = free_port()
            argv = sim_engine_argv(
                ENGINE_MODEL,
                port,
                role=role,
                tokens_only=self.render,
                served_model_name=MODEL,
                extra=self.engine_flags(time_scale),
            )
            engines.append((role, procs.spawn(argv, port)))
        renders = []
        if self.render:
            port = free_port()
            renders.append(
                procs.spawn(sim_render_argv(ENGINE_MODEL, port, served_model_name=MODEL), port)
            )
        procs.wait_ready(*(proc for _, proc in engines), *renders)
        pool = {"service": "sim", "port": 8000}
        ordered = engines[::-1] if self.reversed_engines else engines
        config = {
            "model": MODEL,
            "engineApi": "tokens" if self.render else "openai",
            # The gateway's clock is real: its budgets are scaled like the engines' time.
            "routing": {
                "mode": self.mode,
                "slo": {"ttftMs": 2000 * time_scale, "itlMs": 30 * time_scale},
            },
            "pools": {
                "render": pool if self.render else None,
                "prefill": pool if self.prefill else None,
                "decode": pool,
            },
            "endpoints": {
                "render": [{"url": r.url} for r in renders],
                "prefill": [{"url": p.url} for role, p in ordered if role == "prefill"],
                "decode": [{"url": p.url} for role, p in ordered if role != "prefill"],
            },
        }
        extra = ["--time-scale", str(time_scale)]
        if not self.fair_queue:
            extra.append("--no-fair-queue")
        if request_log is not None:
            extra += ["--request-log", str(request_log)]
        return procs.gateway(config, *extra, module=SIMGATEWAY).url


AGGREGATED = Deployment("Aggregated DP=2", "Aggregated", decode=2)
PD_SLOW = Deployment("Disaggregated 1P1D, slow KV", "Disaggregated", 1, 1, SLOW_KV)
PD_FAST = Deployment("Disaggregated 1P1D, fast KV", "Disaggregated", 1, 1, FAST_KV)
AGGREGATED_AGAIN = replace(
    AGGREGATED, label="Aggregated DP=2, engines in the other order", reversed_engines=True
)
AUTO_SLOW = Deployment("Auto 1P1D, slow KV", "Auto", 1, 1, SLOW_KV)
AUTO_FAST = Deployment("Auto 1P1D, fast KV", "Auto", 1, 1, FAST_KV)


def article_workload() -> Workload:
    return fixed(8000, 256)


def mix_workload() -> Workload:
    return collision_mix()


@dataclass(frozen=True)
class Point:
    deployment: Deployment
    workload: Workload
    rate: float
    num_prompts: int
    warmup: int
    time_scale: float
    slo: Slo
    seed: int = 0

    def fingerprint(self) -> dict[str, Any]:
        """Every parameter of the point, as JSON would store it (tuples become lists)."""
        fingerprint: dict[str, Any] = json.loads(json.dumps(self._parameters()))
        return fingerprint

    def _parameters(self) -> dict[str, Any]:
        deployment = asdict(self.deployment)
        for later in ("render", "reversed_engines"):
            if not deployment[later]:
                del deployment[later]  # as before the field existed: those points stay reusable
        return {
            "deployment": deployment,
            "workload": asdict(self.workload),
            "rate": self.rate,
            "num_prompts": self.num_prompts,
            "warmup": self.warmup,
            "time_scale": self.time_scale,
            "slo": self.slo.to_json(),
            "seed": self.seed,
        }

    def path(self, results: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode())
        slug = re.sub(r"[^a-z0-9]+", "-", self.deployment.label.lower()).strip("-")
        return results / f"{slug}-{self.rate:g}-{digest.hexdigest()[:10]}"


@dataclass
class Options:
    results: Path
    docs: Path
    time_scale: float = 0.25
    num_prompts: int | None = None
    rates: tuple[float, ...] | None = None
    seeds: int = 1
    """Each point is measured with seeds 0..seeds-1 (other arrival times and prompts)."""
    fresh: bool = False
    progress: bool = True
    reused: int = 0
    measured: int = 0
    point_seconds: float = 0.0


class Interrupted(Exception):
    pass


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


def run_point(point: Point, options: Options) -> dict[str, Any]:
    """A point's compact summary, measured now or from the records of an earlier identical run
    (summarized again, so the numbers always follow the current summary code)."""
    base = point.path(options.results)
    summary_path = base.parent / f"{base.name}.json"
    records_path = base.parent / f"{base.name}.jsonl"
    gateway_log = base.parent / f"{base.name}.gateway.jsonl"  # where each request ran, and why
    stored = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if (
        stored is not None
        and not options.fresh
        and records_path.exists()
        and stored["pdserve"].get("fingerprint") == point.fingerprint()
    ):
        view = stored["pdserve"]
        samples = view.get("queue_samples")
        result = RunResult(
            records=read_jsonl(records_path),
            samples=None if samples is None else [QueueSample(*s) for s in samples],
            wall_seconds=view["wall_seconds"],
        )
        counters, seconds = view["gateway"], view["point_seconds"]
        options.reused += 1
    else:
        label = f"{point.deployment.label} @ {point.rate:g} req/s"
        if point.seed:
            label += f", seed {point.seed}"
        progress = Progress(label, point.num_prompts) if options.progress else None
        started = time.monotonic()
        with Processes() as procs:
            gateway_log.unlink(missing_ok=True)
            url = point.deployment.start(procs, point.time_scale, gateway_log)
            target = Target(base_url=url, model=MODEL, metrics_url=f"{url}/metrics")
            result, counters = asyncio.run(_measure(target, point, progress))
        if result.interrupted:
            raise Interrupted
        seconds = time.monotonic() - started
        write_jsonl(records_path, result.records)
        options.measured += 1
    options.point_seconds += seconds
    summary = summarize(
        result,
        label=point.deployment.label,
        model=MODEL,
        rate=point.rate,
        burstiness=1.0,
        time_scale=point.time_scale,
        slo=point.slo,
        workload=point.workload.describe(),
    )
    summary["pdserve"].update(
        fingerprint=point.fingerprint(),
        gateway=counters,
        point_seconds=seconds,
        queue_samples=None
        if result.samples is None
        else [[s.at_ms, s.queue, s.oldest_wait_ms] for s in result.samples],
    )
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
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
        for rate in rates:
            point = Point(
                deployment, workload, rate, num_prompts, warmup, options.time_scale, slo, seed
            )
            out[(deployment.label, rate)] = run_point(point, options)
    return out


# ---- table helpers -------------------------------------------------------------------------------
def stat(summary: dict[str, Any] | None, cls: str, metric: str, name: str) -> float | None:
    if summary is None:
        return None
    stats = summary["pdserve"]["classes"].get(cls)
    value = None if stats is None else stats[metric].get(name)
    return value if isinstance(value, int | float) else None


def pair(summary: dict[str, Any] | None, cls: str, metric: str) -> str:
    return f"{num(stat(summary, cls, metric, 'median'))} / {num(stat(summary, cls, metric, 'p99'))}"


def goodput_cell(summary: dict[str, Any]) -> str:
    stats = summary["pdserve"]["classes"]["fixed"]
    return f"{num(stats['goodput_rps'], 2)} ({share(stats['slo_met_share'])})"


def images(names: Sequence[str], directory: str) -> str:
    return "\n".join(f"![{name}]({directory}/{name})" for name in names)


@dataclass
class Section:
    name: str
    title: str
    body: list[str]
    charts: list[str] = field(default_factory=list)
    time_scales: str | None = None
    """Overrides the run's time scale in the report's header."""


# ---- the scenarios -------------------------------------------------------------------------------
def chart_dir(options: Options) -> Path:
    return options.docs.parent / options.docs.stem


def sweep_charts(points: list[dict[str, Any]], options: Options, prefix: str) -> list[str]:
    directory = chart_dir(options)
    for reason in set(plots.sweep_charts(points, directory, prefix=prefix, unit="simulated ms")):
        print(reason, file=sys.stderr)
    return sorted(p.name for p in directory.glob(f"{prefix}*.png"))


def article_cell(rate: float, metric: str, side: int) -> str:
    """The article's printed figure, in ms, as 'median / p99' ('-' where it printed none)."""
    p99 = ARTICLE.get((rate, f"p99 {metric} ms"))
    median = ARTICLE.get((rate, f"median {metric} s"))
    left = "-" if median is None else num(median[side] * 1000)
    right = "-" if p99 is None else num(p99[side])
    return "" if median is None and p99 is None else f"{left} / {right}"


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


CHUNK_BUDGETS = (512, 1024, 2048, 4096, 8192)
UNCHUNKED = 32768
MIX_RATES_ONE_ENGINE = (2.0, 3.0)
MIX_RATE_TWO_ENGINES = 3.5


def budget_deployment(budget: int) -> Deployment:
    if budget >= UNCHUNKED:
        return Deployment(f"unchunked ({budget})", "Aggregated", decode=1,
                          max_num_batched_tokens=budget, chunked=False)  # fmt: skip
    return Deployment(f"max_num_batched_tokens {budget}", "Aggregated", decode=1,
                      max_num_batched_tokens=budget)  # fmt: skip


def mix_row(summary: dict[str, Any]) -> list[str]:
    view = summary["pdserve"]
    chat, documents = view["classes"].get("chat"), view["classes"].get("document")
    docs = view["documents"] or {}

    def s(cls: dict[str, Any] | None, metric: str, name: str) -> str:
        return "-" if cls is None else num(cls[metric][name])

    return [
        f"{s(chat, 'ttft_ms', 'median')} / {s(chat, 'ttft_ms', 'p99')}",
        f"{s(chat, 'itl_ms', 'median')} / {s(chat, 'itl_ms', 'p95')} / {s(chat, 'itl_ms', 'p99')}",
        f"{s(chat, 'tpot_ms', 'median')} / {s(chat, 'tpot_ms', 'p95')}",
        f"{s(documents, 'e2e_ms', 'median')} / {s(documents, 'e2e_ms', 'p95')}",
        "-" if documents is None else num(documents["input_tokens_per_s"]),
        share(docs.get("waiting_share")),
        num(docs.get("oldest_wait_ms")),
        f"{share(docs.get('gateway_queue_nonempty_share'))} / "
        f"{num(docs.get('gateway_oldest_wait_ms'))}",
        str(view["errors"]["count"]),
    ]


MIX_HEADERS = [
    "chat TTFT p50 / p99",
    "chat ITL p50 / p95 / p99",
    "chat TPOT p50 / p95",
    "document E2E p50 / p95",
    "document input tok/s",
    "documents waiting",
    "oldest document wait",
    "gateway queue non-empty / oldest",
    "errors",
]


def mix_description(workload: Workload, rates: Sequence[float], n: int) -> str:
    at = " and ".join(f"{rate:g}" for rate in rates)
    return (
        f"Collision mix at {at} req/s, {n} measured requests per point (+10 warm-up): "
        f"{workload.describe()}. Documents waiting = share of the time at least one document "
        "had no first token yet (client view); oldest document wait = the longest time to a "
        "document's first token (queue + prefill: the article's starvation signal); the "
        "gateway's queue is its fair-admission queue (empty when nothing is held back)."
    )


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


def met(summary: dict[str, Any]) -> int:
    """How many measured requests met the SLO."""
    stats = summary["pdserve"]["classes"]["fixed"]
    return round(float(stats["slo_met_share"] or 0) * int(stats["completed"]))


def verdict(autos: Sequence[dict[str, Any]], others: Sequence[Sequence[dict[str, Any]]]) -> str:
    """Auto against the better of the other modes, counted in requests that met the SLO (the
    same planned requests in each, summed over the seeds; goodput in req/s also divides by each
    run's own duration). `autos[i]` and `others[m][i]` ran with the same seed.

    TPOT sits near its limit at these rates, so where each request lands decides its fate and
    any change of placement early on reshuffles which requests meet the SLO: a shortfall within
    two standard errors of the per-seed differences (summed) is reported as seed noise."""
    best_mode = max(others, key=lambda mode: sum(map(met, mode)))
    auto, best = sum(map(met, autos)), sum(map(met, best_mode))
    diffs = [met(a) - met(b) for a, b in zip(autos, best_mode, strict=True)]
    allowance = noise_allowance(diffs)
    if auto >= best:
        text = "yes"
    elif allowance is not None and best - auto <= allowance:
        text = f"within seed noise ({auto - best}; 2 SE {num(allowance)})"
    else:
        text = f"**no** ({auto - best} requests)"
    if len(autos) > 1:
        per_seed = "/".join(f"{d:+d}" for d in diffs)
        text += f" ({auto} vs {best} met; per seed {per_seed})"
    return text


def noise_allowance(diffs: Sequence[int]) -> float | None:
    """Two standard errors of the sum of paired per-seed differences (None with one seed)."""
    if len(diffs) < 2:
        return None
    return 2 * statistics.stdev(diffs) * math.sqrt(len(diffs))


def goodput_cells(summaries: Sequence[dict[str, Any]]) -> str:
    """One run's goodput (share), or the mean over seeds (lowest-highest)."""
    if len(summaries) == 1:
        return goodput_cell(summaries[0])
    values = [float(s["pdserve"]["classes"]["fixed"]["goodput_rps"] or 0) for s in summaries]
    mean = sum(values) / len(values)
    return f"{num(mean, 2)} ({num(min(values), 2)}-{num(max(values), 2)})"


def decisions(summary: dict[str, Any]) -> str:
    counts = summary["pdserve"].get("gateway", {}).get("auto_decisions", {})
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) or "-"


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


SCENARIOS: dict[str, Callable[[Options], Section]] = {
    "article": article,
    "chunked": chunked,
    "routing": routing,
    "timescale": timescale,
}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def render_section(section: Section, command: str, options: Options) -> str:
    scales = section.time_scales or f"time scale {options.time_scale:g}"
    meta = (
        f"Reproduce: `{command}` ({scales}; times are simulated ms; from scratch about "
        f"{minutes(options.point_seconds)} of wall time on a 2-core machine shared with other "
        "work)."
    )
    parts = [f"## {section.title}", "", meta, "", *section.body]
    if section.charts:
        parts += ["", images(section.charts, chart_dir(options).name)]
    return "\n".join([f"<!-- bench:{section.name} -->", *parts, f"<!-- /bench:{section.name} -->"])


def write_section(path: Path, block: str, name: str) -> None:
    """Replace the scenario's block between its markers, or append it."""
    text = path.read_text() if path.exists() else "# pdserve benchmarks\n"
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve bench scenario",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=[*SCENARIOS, "all"])
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("bench-results/scenarios"),
        help="where each point's records and summary are kept (and reused)",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="Markdown report to update in place (charts go to a folder of its "
        "name beside it); default RESULTS/benchmarks.md",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.25,
        help="real seconds per simulated second (default 0.25: 4x faster)",
    )
    parser.add_argument("--num-prompts", type=int, help="measured requests per point")
    parser.add_argument("--rates", help="offered rates, comma-separated (the mix: its one rate)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="routing: measure every point with seeds 0..N-1 and report over them (default 1; "
        "the other scenarios use seed 0)",
    )
    parser.add_argument("--fresh", action="store_true", help="measure again, reuse nothing")
    parser.add_argument("--no-progress", dest="progress", action="store_false")  # fmt: skip
    return parser


SEEDED = ("routing",)


def section_flags(flags: Sequence[str], name: str) -> list[str]:
    """The flags that shaped this section's numbers (--seeds only shapes the routing one)."""
    if name in SEEDED:
        return list(flags)
    out: list[str] = []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--seeds":
            skip = True
        elif not flag.startswith("--seeds="):
            out.append(flag)
    return out


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    try:
        rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else None
    except ValueError:
        print(f"error: --rates {args.rates!r}: expected comma-separated numbers", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"error: --seeds {args.seeds}: expected 1 or more", file=sys.stderr)
        return 2
    options = Options(
        results=args.results,
        docs=args.docs or args.results / "benchmarks.md",
        time_scale=args.time_scale,
        num_prompts=args.num_prompts,
        rates=rates,
        seeds=args.seeds,
        fresh=args.fresh,
        progress=args.progress,
    )
    options.results.mkdir(parents=True, exist_ok=True)
    # The report's command: what changes the numbers (not --fresh or --no-progress).
    flags = [a for a in argv if a not in (args.name, "--fresh", "--no-progress")]
    names = list(SCENARIOS) if args.name == "all" else [args.name]
    for name in names:
        options.reused = options.measured = 0
        options.point_seconds = 0.0
        started = time.monotonic()
        try:
            section = SCENARIOS[name](options)
        except (Interrupted, KeyboardInterrupt):
            print(
                "interrupted: the point in progress was not kept; finished points are, and a "
                "rerun reuses them",
                file=sys.stderr,
            )
            return 130
        command = " ".join(["pdserve bench scenario", name, *section_flags(flags, name)])
        write_section(options.docs, render_section(section, command, options), name)
        print(
            f"{name}: {options.measured} points measured, {options.reused} reused, "
            f"{minutes(time.monotonic() - started)}; report: {options.docs}",
            file=sys.stderr,
        )
    return 0
