"""`pdserve bench overhead`: what a P/D proxy costs, pdserve's gateway beside vllm-router and
vLLM's toy proxy, measured side by side in one run.

Every proxy is pinned to one core (--proxy-cpu); the engines and the load generator share the
others, so engines never starve the proxy. The engines are stubs that answer in microseconds
(bench/native, Go), so the proxy is what saturates. Per target and prompt size:

- p50 / p99 latency at concurrency 1 (the engine direct is the floor);
- requests per proxy core, closed loop at each --concurrency: completed requests / CPU seconds
  the proxy's process tree used (fair when the proxy does not have a core of its own either);
- streamed tokens per proxy core (--stream-tokens per request, concurrency 32);
- p50 / p99 at half of the target's own maximum rate, open loop (Poisson arrivals) over at
  most as many connections as the largest --concurrency (a client's pool: unbounded, a pause
  of a few milliseconds makes the load generator open thousands);
- CPU ms per request and the proxy's RSS after the run.

pdserve's render route (render -> P/D -> derender) runs on the same stubs, which also answer
render, derender and the tokens engines' generate; its per-core figures count the gateway (and
its data plane) only. vllm-router is installed from PyPI (`pip install vllm-router`) and found on
PATH or given by --vllm-router; the toy proxy is given by path (--toy-proxy, with --toy-python:
an interpreter with fastapi, uvicorn and httpx). Neither is ever part of pdserve. Repeats run
the targets interleaved; the tables show medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.native import NativeTools, native_tools
from pdserve.bench.overhead_report import (
    MODES,
    PDSERVE_TARGETS,
    RENDER_ROUTES,
    ROUTER,
    Point,
    Settings,
    chart,
    combine,
    labelled,
    ratios,
    table,
)
from pdserve.gateway.dataplane import build_binary
from pdserve.gobuild import GoUnavailable
from pdserve.sim.procs import Processes, free_port

MODEL = "qwen"
SIM_MODEL = "Qwen/Qwen3-8B"
PROMPTS = {"2KB": 2_000, "200KB": 200_000}
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
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


def prompt_text(size: int) -> str:
    """`size` characters of words (the same every run)."""
    words = (WORDS[(i * 7) % len(WORDS)] for i in range(size))
    text = ""
    for word in words:
        if len(text) >= size:
            break
        text += word + " "
    return text[:size]


def chat_body(size: int, *, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(size)}],
        "max_tokens": max_tokens,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    return body


# ---- processes -----------------------------------------------------------------------------------
def tree_pids(pid: int) -> list[int]:
    """`pid` and every process below it (a launcher's server children count too)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = task / "children"
            if children.exists():
                todo += [int(c) for c in children.read_text().split()]
    return found


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for each in tree_pids(pid):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def tree_rss_mib(pid: int) -> float:
    total = 0
    for each in tree_pids(pid):
        try:
            status = Path(f"/proc/{each}/status").read_text()
        except FileNotFoundError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


@dataclass
class Target:
    name: str
    url: str  # the completion endpoint
    pid: int | None  # the proxy's process (None: the engine direct, no proxy)


@dataclass
class Layout:
    """Which CPUs the proxy and everything else (engines, the load generator) run on."""

    proxy: set[int] | None
    rest: set[int] | None

    @classmethod
    def pinned(cls, proxy_cpu: int) -> Layout:
        cpus = os.sched_getaffinity(0)
        if len(cpus) < 2 or proxy_cpu not in cpus:
            return cls(None, None)
        return cls({proxy_cpu}, cpus - {proxy_cpu})

    def describe(self) -> str:
        if self.proxy is None:
            return "not pinned (fewer than 2 CPUs)"
        others = sorted(self.rest or [])
        return f"proxy on CPU {sorted(self.proxy)}, engines and load generator on {others}"


@dataclass
class Load:
    requests: int
    errors: int
    seconds: float
    latency_ms: dict[str, float]
    events: int
    cpu_seconds: float | None
    first_error: str | None = None

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


class Driver:
    """Runs the native load generator, pinned away from the proxy."""

    def __init__(self, tools: NativeTools, layout: Layout, workdir: Path) -> None:
        self.tools, self.layout, self.workdir = tools, layout, workdir
        self.bodies: dict[str, Path] = {}

    def body(self, name: str, body: dict[str, Any]) -> Path:
        if name not in self.bodies:
            path = self.workdir / f"{name}.json"
            path.write_text(json.dumps(body))
            self.bodies[name] = path
        return self.bodies[name]

    def run(
        self,
        target: Target,
        body: Path,
        seconds: float,
        *,
        concurrency: int = 1,
        rate: float | None = None,
        max_conns: int = 0,
        stream: bool = False,
    ) -> Load:
        argv = [str(self.tools.loadgen), "-url", target.url, "-body", str(body)]
        argv += ["-seconds", f"{seconds:g}", "-concurrency", str(concurrency)]
        if rate:
            argv += ["-rate", f"{rate:.1f}", "-max-conns", str(max_conns)]
        if stream:
            argv.append("-stream")
        before = tree_cpu_seconds(target.pid) if target.pid else None
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            timeout=seconds + 180,
            preexec_fn=pin(self.layout.rest),
        )
        if done.returncode != 0:
            raise RuntimeError(f"loadgen failed: {done.stderr[-1000:]}")
        used = tree_cpu_seconds(target.pid) - before if target.pid and before is not None else None
        out = json.loads(done.stdout)
        return Load(
            requests=out["requests"],
            errors=out["errors"],
            seconds=out["seconds"],
            latency_ms=out.get("latency_ms") or {},
            events=out.get("events", 0),
            cpu_seconds=used,
            first_error=out.get("first_error"),
        )


def pin(cpus: set[int] | None) -> Callable[[], None] | None:
    if cpus is None:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


# ---- the measurement -------------------------------------------------------------------------
def measure(driver: Driver, target: Target, prompt: str, settings: Settings) -> Point:
    size = PROMPTS[prompt]
    plain = driver.body(
        f"chat-{prompt}", chat_body(size, max_tokens=settings.max_tokens, stream=False)
    )
    point = Point(target.name, prompt)
    loads: list[Load] = []

    def run(**kwargs: Any) -> Load:
        load = driver.run(target, **kwargs)
        loads.append(load)
        return load

    light = run(body=plain, seconds=settings.seconds / 2, concurrency=1)
    point.c1_p50_ms, point.c1_p99_ms = light.latency_ms.get("p50"), light.latency_ms.get("p99")
    cpu_per_request: float | None = None
    for concurrency in settings.concurrency:
        load = run(body=plain, seconds=settings.seconds, concurrency=concurrency)
        point.rps[concurrency] = load.rate
        used = load.cpu_seconds
        point.per_core[concurrency] = load.requests / used if used else None
        if cpu_per_request is None and used and load.requests:
            cpu_per_request = 1000 * used / load.requests
    point.cpu_ms_per_request = cpu_per_request
    streamed = driver.body(
        f"stream-{prompt}", chat_body(size, max_tokens=settings.stream_tokens, stream=True)
    )
    load = run(
        body=streamed,
        seconds=settings.seconds,
        concurrency=settings.stream_concurrency,
        stream=True,
    )
    tokens = load.requests * settings.stream_tokens
    point.stream_tokens_per_s = tokens / load.seconds if load.seconds else None
    point.stream_tokens_per_core = tokens / load.cpu_seconds if load.cpu_seconds else None
    top = max(point.rps.values(), default=0.0)
    # The engine direct has no proxy core: its "maximum" is the load generator's, on the
    # engines' own core, and half of it measures that core, not a proxy.
    if top > 0 and target.pid is not None:
        point.half_rate = top / 2
        half = run(
            body=plain,
            seconds=settings.seconds,
            rate=point.half_rate,
            max_conns=max(settings.concurrency),
        )
        point.half_p50_ms, point.half_p99_ms = (
            half.latency_ms.get("p50"),
            half.latency_ms.get("p99"),
        )
    if target.pid:
        point.rss_mib = tree_rss_mib(target.pid)
    point.errors = sum(load.errors for load in loads)
    point.first_error = next((load.first_error for load in loads if load.first_error), None)
    return point


@contextmanager
def targets(args: argparse.Namespace, tools: NativeTools, layout: Layout) -> Iterator[list[Target]]:
    """Start the engines and every proxy asked for; stop them all on exit."""
    with Processes(startup_timeout=120) as procs:
        rest, proxy = pin(layout.rest), pin(layout.proxy)

        def stub(role: str) -> str:
            port = free_port()
            argv = [str(tools.stub_engine), "-port", str(port), "-role", role, "-model", MODEL]
            return procs.start(argv, port, preexec_fn=rest).url

        prefill, decode = stub("prefill"), stub("decode")
        found: list[Target] = [
            Target("engine direct (no proxy)", f"{decode}/v1/chat/completions", None)
        ]
        wanted = set(args.targets)
        if "pdserve" in wanted:
            gateway = procs.gateway(
                routing("openai", {"prefill": [prefill], "decode": [decode]}, args.mode),
                *GATEWAY_FLAGS,
                preexec_fn=proxy,
            )
            found.append(
                Target(
                    labelled(PDSERVE_TARGETS["pdserve"], args.mode),
                    f"{gateway.url}/v1/chat/completions",
                    gateway.process.pid,
                )
            )
        if "pdserve-dataplane" in wanted:
            gateway = procs.gateway(
                routing("openai", {"prefill": [prefill], "decode": [decode]}, args.mode),
                *GATEWAY_FLAGS,
                "--data-plane",
                str(args.data_plane or build_binary(args.go)),
                preexec_fn=proxy,
            )
            found.append(
                Target(
                    labelled(PDSERVE_TARGETS["pdserve --data-plane"], args.mode),
                    f"{gateway.url}/v1/chat/completions",
                    gateway.process.pid,
                )
            )
        router = args.vllm_router or shutil.which("vllm-router")
        if "vllm-router" in wanted and router:
            port = free_port()
            argv = [
                router,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--vllm-pd-disaggregation",
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--policy",
                "round_robin",
                "--log-level",
                "warning",
                "--max-concurrent-requests",
                "4096",
                "--queue-size",
                "4096",
                "--disable-retries",
                # Its own metrics port, not the default one another router may hold.
                "--prometheus-port",
                str(free_port()),
            ]
            proc = procs.start(argv, port, preexec_fn=proxy)
            found.append(Target(ROUTER, f"{proc.url}/v1/chat/completions", proc.process.pid))
        elif "vllm-router" in wanted:
            print(
                "vllm-router: not installed (pip install vllm-router, or --vllm-router PATH); "
                "skipped",
                file=sys.stderr,
            )
        if "toy-proxy" in wanted and args.toy_proxy:
            port = free_port()
            _, prefill_port = prefill.rsplit(":", 1)
            _, decode_port = decode.rsplit(":", 1)
            argv = [
                args.toy_python,
                str(args.toy_proxy),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prefiller-hosts",
                "127.0.0.1",
                "--prefiller-ports",
                prefill_port,
                "--decoder-hosts",
                "127.0.0.1",
                "--decoder-ports",
                decode_port,
            ]
            proc = procs.start(argv, port, health="/healthcheck", preexec_fn=proxy)
            found.append(
                Target("vLLM toy proxy, P/D", f"{proc.url}/v1/chat/completions", proc.process.pid)
            )
        elif "toy-proxy" in wanted:
            print("toy proxy: no --toy-proxy PATH given; skipped", file=sys.stderr)
        for name, label in RENDER_ROUTES.items():
            if name not in wanted:
                continue
            engines = {"render": [stub("render")], "prefill": [prefill], "decode": [decode]}
            flags = [*GATEWAY_FLAGS]
            if name == "pdserve-dataplane-render":
                flags += ["--data-plane", str(args.data_plane or build_binary(args.go))]
            config = routing("tokens", engines, args.mode)
            gateway = procs.gateway(config, *flags, preexec_fn=proxy)
            url = f"{gateway.url}/v1/chat/completions"
            found.append(Target(labelled(label, args.mode), url, gateway.process.pid))
        yield found


GATEWAY_FLAGS = ("--max-inflight", "4096")


def routing(
    engine_api: str, endpoints: dict[str, list[str]], mode: str = "Disaggregated"
) -> dict[str, object]:
    pool = {"service": "x", "port": 8000}
    return {
        "model": MODEL,
        "engineApi": engine_api,
        "routing": {"mode": mode},
        "pools": {
            "render": pool if "render" in endpoints else None,
            "prefill": pool if "prefill" in endpoints else None,
            "decode": pool,
        },
        "endpoints": {k: [{"url": u} for u in v] for k, v in endpoints.items()},
    }


TARGETS = ["pdserve", "pdserve-dataplane", "vllm-router", "toy-proxy", *RENDER_ROUTES]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--targets",
        nargs="+",
        default=TARGETS,
        choices=TARGETS,
    )
    p.add_argument(
        "--data-plane",
        type=Path,
        help="the data plane binary for pdserve-dataplane (default: built here with Go)",
    )
    p.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    p.add_argument(
        "--mode",
        default="Auto",
        choices=MODES,
        help="pdserve's routing mode (default Auto, a user's default: P/D or local prefill per "
        "request; Disaggregated: P/D on every request, as vllm-router)",
    )
    p.add_argument("--vllm-router", help="the vllm-router command (default: on PATH)")
    p.add_argument("--toy-proxy", type=Path, help="path to vLLM's toy_proxy_server.py")
    p.add_argument(
        "--toy-python",
        default=sys.executable,
        help="interpreter with fastapi, uvicorn and httpx for the toy proxy",
    )
    p.add_argument("--go", help="the Go command that builds the stub engine and load generator")
    p.add_argument("--proxy-cpu", type=int, default=0, help="the CPU every proxy is pinned to")
    p.add_argument("--seconds", type=float, default=5.0, help="per load point")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--max-tokens", type=int, default=8, help="non-streamed answers' tokens")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--stream-concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-results/overhead"))
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    problems = [
        f"--{name.replace('_', '-')} must be positive"
        for name in ("seconds", "max_tokens", "stream_tokens", "stream_concurrency", "repeats")
        if getattr(args, name) <= 0
    ]
    if any(c <= 0 for c in args.concurrency):
        problems.append("--concurrency values must be positive")
    if args.toy_proxy is not None and not args.toy_proxy.is_file():
        problems.append(f"--toy-proxy {args.toy_proxy}: no such file")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        tools = native_tools(args.go)
    except GoUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = Settings(
        args.seconds, args.concurrency, args.stream_tokens, args.stream_concurrency, args.max_tokens
    )
    layout = Layout.pinned(args.proxy_cpu)
    print(f"layout: {layout.describe()}", file=sys.stderr)
    runs: dict[tuple[str, str], list[Point]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-overhead-") as work:
        driver = Driver(tools, layout, Path(work))
        with targets(args, tools, layout) as started:
            for repeat in range(args.repeats):
                for prompt in args.prompts:
                    for target in started:
                        print(
                            f"repeat {repeat + 1}/{args.repeats}: {target.name}, {prompt}",
                            file=sys.stderr,
                        )
                        point = measure(driver, target, prompt, settings)
                        runs.setdefault((target.name, prompt), []).append(point)
    points = [combine(each) for each in runs.values()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "points.json").write_text(json.dumps([asdict(p) for p in points], indent=1) + "\n")
    report = [
        f"Layout: {layout.describe()}; pdserve in routing mode {args.mode}; "
        f"{args.repeats} repeats, medians; "
        f"{args.seconds:g} s per load point; non-streamed answers {args.max_tokens} tokens, "
        f"streams {args.stream_tokens}.",
        "",
        table(points, settings),
        "",
        *ratios(points, settings, args.mode),
    ]
    text = "\n".join(report) + "\n"
    (args.out / "overhead.md").write_text(text)
    print(text)
    reason = chart(points, settings, args.out / "overhead.png")
    if reason:
        print(reason, file=sys.stderr)
    failed = [p for p in points if p.errors]
    for p in failed:
        print(f"{p.target}, {p.prompt}: {p.errors} errors, first: {p.first_error}", file=sys.stderr)
    print(f"results in {args.out}/", file=sys.stderr)
    return 1 if failed else 0
