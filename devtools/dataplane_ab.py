"""Data plane binaries side by side: the figures a change to the data plane is judged by.

    python -m devtools.dataplane_ab OLD_BINARY NEW_BINARY [--router] [--plain] [--prompt 200KB]

Each binary runs behind its own Python gateway and stub engines, as `pdserve bench overhead`'s
`pdserve-dataplane` target does (`--render`: its render-route target), optionally beside
vllm-router (on PATH); the same layout (every proxy pinned to CPU 0). Per repeat, each target
takes one load point in turn: closed loop at --concurrency (streams of 64 tokens unless
--plain), or open loop at --rate. Prints per-core figures per run, the split of CPU between
the Python gateway and its data plane, and the medians. Build a binary to compare with
`cd operator/pdserve/dataplane && go build -o /tmp/new .` (and the old one from a worktree).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

from pdserve.bench import overhead
from pdserve.bench.native import native_tools

STREAM_TOKENS = 64


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m devtools.dataplane_ab", description=__doc__)
    p.add_argument("binaries", nargs="+", type=Path, help="data plane binaries to compare")
    p.add_argument("--router", action="store_true", help="vllm-router beside them")
    p.add_argument("--render", action="store_true", help="the render route, not the OpenAI one")
    p.add_argument("--plain", action="store_true", help="non-streamed answers of 8 tokens")
    p.add_argument("--prompt", default="2KB", choices=list(overhead.PROMPTS))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, help="open loop at this many requests/s instead")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    missing = [str(b) for b in args.binaries if not b.is_file()]
    if missing:
        print(f"error: no such data plane binary: {', '.join(missing)}", file=sys.stderr)
        return 2
    tools = native_tools(None)
    layout = overhead.Layout.pinned(0)
    route = "pdserve-dataplane-render" if args.render else "pdserve-dataplane"
    unit = 1 if args.plain else STREAM_TOKENS
    per_core: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        driver = overhead.Driver(tools, layout, Path(work))
        body = driver.body(
            "ab",
            overhead.chat_body(
                overhead.PROMPTS[args.prompt],
                max_tokens=8 if args.plain else unit,
                stream=not args.plain,
            ),
        )
        runs: list[tuple[str, overhead.Target]] = []
        for binary in args.binaries:
            chosen = overhead.parser().parse_args(["--targets", route, "--data-plane", str(binary)])
            runs.append(
                (str(binary), stack.enter_context(overhead.targets(chosen, tools, layout))[1])
            )
        if args.router:
            chosen = overhead.parser().parse_args(["--targets", "vllm-router"])
            started = stack.enter_context(overhead.targets(chosen, tools, layout))
            if len(started) < 2:
                print(
                    "error: vllm-router is not on PATH (pip install vllm-router)", file=sys.stderr
                )
                return 2
            runs.append(("vllm-router", started[1]))
        for _ in range(args.repeats):
            for name, target in runs:
                assert target.pid is not None
                before = {
                    pid: overhead.tree_cpu_seconds(pid) for pid in overhead.tree_pids(target.pid)
                }
                load = driver.run(
                    target,
                    body,
                    args.seconds,
                    concurrency=args.concurrency,
                    rate=args.rate,
                    stream=not args.plain,
                )
                split = {
                    pid: round(overhead.tree_cpu_seconds(pid) - used, 2)
                    for pid, used in before.items()
                }
                figure = load.requests * unit / load.cpu_seconds if load.cpu_seconds else 0.0
                per_core.setdefault(name, []).append(figure)
                latency = load.latency_ms
                print(
                    f"{name}: {load.rate:.0f}/s, {figure:.0f} per core, CPU s by process "
                    f"(parent first, its tree included) {split}, p50/p99 "
                    f"{latency.get('p50')}/{latency.get('p99')} ms, errors {load.errors}",
                    flush=True,
                )
    what = "requests" if args.plain else "streamed tokens"
    for name, figures in per_core.items():
        print(f"median {what} per core, {name}: {statistics.median(figures):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
