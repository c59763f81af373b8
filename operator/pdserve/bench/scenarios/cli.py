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
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.bench.scenarios.article import article, chunked
from pdserve.bench.scenarios.points import Interrupted, Options
from pdserve.bench.scenarios.report import Section, minutes, render_section, write_section
from pdserve.bench.scenarios.routing import routing, timescale

SCENARIOS: dict[str, Callable[[Options], Section]] = {
    "article": article,
    "chunked": chunked,
    "routing": routing,
    "timescale": timescale,
}


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
    parser.add_argument(
        "--data-plane",
        action="store_true",
        help="routing mode Auto's deployments behind the gateway's compiled data plane, which "
        "decides Auto itself (their points keep no request log)",
    )
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
        data_plane=args.data_plane,
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
