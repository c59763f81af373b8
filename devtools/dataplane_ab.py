"""Data plane binaries side by side: the figures a change to the data plane is judged by.

    python -m devtools.dataplane_ab OLD_BINARY NEW_BINARY [--router] [--plain] [--prompt 200KB]

Each binary runs behind its own Python gateway and stub engines, as `pdserve bench overhead`'s
`pdserve-dataplane` target does (`--render`: its render-route target), optionally beside
vllm-router (on PATH); the same layout (every proxy pinned to CPU 0). Per repeat, each target
takes one load point in turn: closed loop at --concurrency (streams of 64 tokens unless
--plain), or open loop at --rate (or, with --half-load, at half of each target's own closed-loop
rate, measured first). Prints per-core figures per run, the split of CPU between
the Python gateway and its data plane, what the data plane allocated per request and how often
it collected (from the gateway's /metrics), and the medians. Build a binary to compare with
`cd operator/pdserve/dataplane && go build -o /tmp/new .` (and the old one from a worktree).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve.bench import overhead
from pdserve.bench.native import native_tools

STREAM_TOKENS = 64
RUNTIME = ("allocated_bytes", "allocated_objects", "gc_cycles", "gc_cpu_seconds")
SETTLE_SECONDS = 10.0  # the gateway folds the data plane's counters in once a second


def data_plane_counters(target: overhead.Target) -> dict[str, float]:
    """The data plane's requests served and its Go runtime's counters, from the gateway's
    /metrics (what it last folded in from the data plane's /stats)."""
    base = target.url.split("/v1/", 1)[0]
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = {"requests": 0.0}
    for name, value in re.findall(r"^pdserve_gateway_dataplane_(\w+?)_total(?:{[^}]*})? (\S+)$",
                                  text, re.M):  # fmt: skip
        key = name if name in RUNTIME else "requests" if name == "requests" else None
        if key:
            found[key] = found.get(key, 0.0) + float(value)
    return found


def settled(target: overhead.Target, served_before: float, served: int) -> dict[str, float]:
    """The counters once the gateway has folded in the window's last request (polled)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        counters = data_plane_counters(target)
        if counters["requests"] - served_before >= served or time.monotonic() > deadline:
            return counters
        time.sleep(0.2)


def runtime_per_request(before: dict[str, float], after: dict[str, float]) -> str:
    served = after["requests"] - before["requests"]
    if served <= 0 or "allocated_bytes" not in after:
        return ""
    per = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / served for k in RUNTIME}
    collections = f"a collection per {1 / per['gc_cycles']:.0f}" if per["gc_cycles"] else "none"
    return (
        f", data plane per request: {per['allocated_bytes']:.0f} B in "
        f"{per['allocated_objects']:.1f} objects, collections: {collections} requests "
        f"(GC CPU {1e6 * per['gc_cpu_seconds']:.2f} µs per request)"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m devtools.dataplane_ab", description=__doc__)
    p.add_argument("binaries", nargs="+", type=Path, help="data plane binaries to compare")
    p.add_argument("--router", action="store_true", help="vllm-router beside them")
    p.add_argument("--render", action="store_true", help="the render route, not the OpenAI one")
    p.add_argument("--plain", action="store_true", help="non-streamed answers of 8 tokens")
    p.add_argument("--prompt", default="2KB", choices=list(overhead.PROMPTS))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, help="open loop at this many requests/s instead")
    p.add_argument(
        "--half-load",
        action="store_true",
        help="open loop at half of each target's own closed-loop rate (measured first, at "
        "--concurrency), the issue's half load; prints each target's median p99 over the repeats",
    )
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    missing = [str(b) for b in args.binaries if not b.is_file()]
    if missing:
        print(f"error: no such data plane binary: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.half_load and args.rate:
        print("error: --half-load sets each target's rate itself: drop --rate", file=sys.stderr)
        return 2
    tools = native_tools(None)
    layout = overhead.Layout.pinned(0)
    route = "pdserve-dataplane-render" if args.render else "pdserve-dataplane"
    unit = 1 if args.plain else STREAM_TOKENS
    per_core: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}
    rates: dict[str, float] = {}
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
        if args.half_load:
            for name, target in runs:
                full = driver.run(
                    target, body, args.seconds, concurrency=args.concurrency, stream=not args.plain
                )
                rates[name] = full.rate / 2
                print(f"{name}: {full.rate:.0f}/s at c={args.concurrency}, half load "
                      f"{rates[name]:.0f}/s", flush=True)  # fmt: skip
        for _ in range(args.repeats):
            for name, target in runs:
                assert target.pid is not None
                data_plane = name != "vllm-router"
                counted = data_plane_counters(target) if data_plane else {}
                before = {
                    pid: overhead.tree_cpu_seconds(pid) for pid in overhead.tree_pids(target.pid)
                }
                load = driver.run(
                    target,
                    body,
                    args.seconds,
                    concurrency=args.concurrency,
                    rate=rates.get(name, args.rate),
                    stream=not args.plain,
                )
                split = {
                    pid: round(overhead.tree_cpu_seconds(pid) - used, 2)
                    for pid, used in before.items()
                }
                figure = load.requests * unit / load.cpu_seconds if load.cpu_seconds else 0.0
                per_core.setdefault(name, []).append(figure)
                latency = load.latency_ms
                if "p99" in latency:
                    p99s.setdefault(name, []).append(latency["p99"])
                runtime = ""
                if data_plane:
                    after = settled(target, counted["requests"], load.requests)
                    runtime = runtime_per_request(counted, after)
                print(
                    f"{name}: {load.rate:.0f}/s, {figure:.0f} per core, CPU s by process "
                    f"(parent first, its tree included) {split}, p50/p99 "
                    f"{latency.get('p50')}/{latency.get('p99')} ms, errors {load.errors}"
                    f"{runtime}",
                    flush=True,
                )
    what = "requests" if args.plain else "streamed tokens"
    for name, figures in per_core.items():
        print(f"median {what} per core, {name}: {statistics.median(figures):.0f}")
    if args.half_load or args.rate:
        for name, tails in p99s.items():
            middle = statistics.median(tails)
            print(f"median p99 ms over {len(tails)} windows, {name}: {middle:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
