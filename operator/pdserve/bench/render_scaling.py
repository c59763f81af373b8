"""Render autoscaling on parser load, against request-rate and CPU-only policies.

    python -m pdserve.bench.render_scaling [--minutes 20] [--seed 7] [--markdown FILE] [--plot FILE]

1. Calibration on the simulator: a real `pdserve.sim` render server on loopback derenders
   streamed reasoning one chunk at a time; its own http_request_duration_seconds (the metric a
   real vLLM render server exposes) gives the cost of one derender call as a function of the
   history it re-parses: cost(n) = a + b x n, fitted by least squares.
2. Replay: a ramp of streamed reasoning requests (more of them, and longer reasoning) on a
   render pool, in virtual time: every stream's derender calls as the gateway makes them (one in
   flight per stream, tokens arriving meanwhile merged into the next call), each replica a
   single renderer worker serving its calls in order at the calibrated cost, new replicas ready
   after a start-up delay, removed replicas drained. Every 15 s each policy decides with the
   operator's own rules (pdserve.controller.autoscale: recommend_render, proportional, decide,
   with the render defaults: no up window, 300 s down window, +4/-1 per step, 30 s cooldown):
   - parser busy (pdserve's Builtin engine): busy seconds per second per pod, the higher of the
     server's handler time and the gateway's call time (queueing included), CPU as the floor;
   - CPU only (an HPA on CPU utilization): the pods' CPU against 70% of one core;
   - request rate: streams per second per pod against what one pod carried at 70% busy with the
     reasoning length at the start of the ramp.
   Two cores cannot run a dozen real render servers side by side, hence virtual time; the costs
   are the simulator's, measured at the start of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from pdserve.api.autoscaling import RenderAutoscaler, RenderAutoscalingSpec
from pdserve.bench.render_scaling_model import Cost, Replica, Run, Scenario, Stream, Window, p99
from pdserve.bench.render_scaling_report import calibration_text, draw, markdown, summarize
from pdserve.controller.autoscale.behaviour import Behaviour, ScalerState, decide
from pdserve.controller.autoscale.rules import proportional, recommend_render
from pdserve.vllm.metrics import sum_samples

DERENDER = "/v1/chat/completions/derender"
# The replay's model and report have modules of their own; their names stay importable here.
__all__ = [
    "DERENDER",
    "Cost",
    "Replica",
    "Run",
    "Scenario",
    "Signal",
    "Stream",
    "Window",
    "calibrate",
    "calibration_text",
    "draw",
    "main",
    "markdown",
    "p99",
    "policies",
    "replay",
    "summarize",
]


# ---- 1. calibration (the cost model: render_scaling_model.Cost) -------------------------------
def _handler_seconds(name: str, labels: Mapping[str, str]) -> str | None:
    if name == "http_request_duration_seconds_sum" and labels.get("handler") == DERENDER:
        return "seconds"
    if name == "http_request_duration_seconds_count" and labels.get("handler") == DERENDER:
        return "calls"
    return None


async def calibrate(points: Sequence[int] = (256, 1024, 2048, 4096, 8192), calls: int = 40) -> Cost:
    """Measure derender calls on a loopback simulator at several history lengths."""
    from pdserve.sim.http import serving
    from pdserve.sim.render_server import RenderConfig, RenderServer
    from pdserve.sim.tokenizer import SimTokenizer

    steps = " ".join(f"step {i}: weigh the option, check it, move on." for i in range(2500))
    ids = SimTokenizer().encode(f"<think>\n{steps}\n</think>\n\nDone.")
    server = RenderServer(RenderConfig(reasoning_parser="qwen3", tool_call_parser="hermes"))
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "think it over"}]}
    samples: list[tuple[int, float]] = []
    async with (
        serving(server.app()) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
    ):

        async def call(tokens: list[int], state: Any) -> Any:
            body = {"stream": True, "model": "sim-model", "stream_state": state,
                    "generate_chunk": {"request_id": "calibration", "choices": [
                        {"index": 0, "token_ids": tokens, "finish_reason": None}]},
                    "prompt_tokens": 4, "prompt_token_ids": [1, 2, 3, 4],
                    "chat_request": chat}  # fmt: skip
            response = await client.post(DERENDER, json=body)
            response.raise_for_status()
            return response.json()["stream_state"]

        for n in points:
            state = await call(ids[:n], None)  # the history, in one call
            before = sum_samples((await client.get("/metrics")).text, _handler_seconds)
            for i in range(calls):
                state = await call(ids[n + i : n + i + 1], state)
            after = sum_samples((await client.get("/metrics")).text, _handler_seconds)
            seconds = after["seconds"] - before["seconds"]
            samples.append((n + calls // 2, seconds / (after["calls"] - before["calls"])))
    xs, ys = [float(n) for n, _ in samples], [s for _, s in samples]
    slope, intercept = statistics.linear_regression(xs, ys)
    return Cost(base=max(intercept, 1e-6), per_token=max(slope, 0.0))


# ---- 2. the replay -----------------------------------------------------------------------------
Signal = Callable[[int, list[Replica], float, float], int]


def policies(cost: Cost, scenario: Scenario) -> dict[str, Signal]:
    """Each policy's recommendation from one window: (current, ready replicas, streams/s,
    window seconds) -> replicas."""
    target = 0.7  # busy share per worker, CPU share per core, as the render defaults
    _, length = scenario.shape(0)
    per_pod_rate = target / cost.stream(length)  # streams/s one pod carried at 70% busy

    def parser_busy(current: int, pods: list[Replica], streams: float, seconds: float) -> int:
        busy = [max(p.cpu, p.waited) / seconds for p in pods]
        cpu = [p.cpu / seconds for p in pods]
        rec = recommend_render(current, busy, cpu, workers=1, cpu_request=1.0,
                               target_busy=target, target_cpu=target)  # fmt: skip
        return current if rec is None else rec.replicas

    def cpu_only(current: int, pods: list[Replica], streams: float, seconds: float) -> int:
        cpu = [p.cpu / seconds for p in pods]
        rec = recommend_render(current, [0.0] * len(pods), cpu, workers=1, cpu_request=1.0,
                               target_busy=target, target_cpu=target)  # fmt: skip
        return current if rec is None else rec.replicas

    def request_rate(current: int, pods: list[Replica], streams: float, seconds: float) -> int:
        return proportional(current, streams / (current * per_pod_rate))

    return {"parser busy (pdserve)": parser_busy, "CPU only": cpu_only,
            "request rate": request_rate}  # fmt: skip


def replay(policy: str, signal: Signal, cost: Cost, scenario: Scenario, seed: int) -> Run:
    """One policy over the whole scenario, in virtual time (same arrivals for every policy)."""
    rng = random.Random(seed)
    spec = RenderAutoscalingSpec(engine=RenderAutoscaler.builtin,
                                 min_replicas=scenario.min_replicas,
                                 max_replicas=scenario.max_replicas)  # fmt: skip
    behaviour = Behaviour.of(spec)
    end = scenario.minutes * 60
    run = Run(policy)
    pods = [Replica(i, ready_at=0.0) for i in range(scenario.min_replicas)]
    counter = itertools.count()
    events: list[tuple[float, int, str, Any]] = []

    def push(t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(events, (t, next(counter), kind, payload))

    push(0.0, "arrival")
    push(scenario.interval, "tick")
    state = ScalerState()
    live: dict[int, Stream] = {}
    started = 0
    calls_in_window: list[float] = []
    delays_in_window: list[float] = []
    last_tick = 0.0

    def issue(sid: int, now: float) -> None:
        stream = live[sid]
        available = min(stream.length, int((now - stream.start) / scenario.itl + 1e-9) + 1)
        if available <= stream.sent:
            push(stream.start + stream.sent * scenario.itl, "token", sid)
            return
        ready = [p for p in pods if not p.draining and p.ready_at <= now]
        pod = min(ready, key=lambda p: (p.inflight, p.index))
        service = cost(available)
        finish = max(now, pod.free_at) + service
        pod.free_at = finish
        pod.inflight += 1
        first_token = stream.start + stream.sent * scenario.itl
        push(finish, "done", (sid, pod, now, available, service, first_token))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > end:
            break
        if kind == "arrival":
            rate, length = scenario.shape(now)
            sid = next(counter)
            live[sid] = Stream(now, max(16, int(rng.gauss(length, length * 0.2))))
            started += 1
            issue(sid, now)
            push(now + rng.expovariate(rate), "arrival")
        elif kind == "token":
            issue(payload, now)
        elif kind == "done":
            sid, pod, issued, tokens, service, first_token = payload
            pod.inflight -= 1
            pod.cpu += service
            pod.waited += now - issued
            latency = now - issued
            run.latencies.append((now, latency))
            calls_in_window.append(latency)
            delays_in_window.append(now - first_token)
            run.token_delays.append(now - first_token)
            stream = live[sid]
            stream.sent = tokens
            if tokens >= stream.length:
                del live[sid]
            else:
                issue(sid, now)
            if pod.draining and pod.inflight == 0:
                pods.remove(pod)
        elif kind == "tick":
            seconds = now - last_tick
            ready = [p for p in pods if not p.draining and p.ready_at <= now - seconds]
            current = len([p for p in pods if not p.draining])
            run.replica_seconds += len(pods) * seconds
            demand = sum(cost(int((now - s.start) / scenario.itl)) / scenario.itl
                         for s in live.values())  # fmt: skip
            recommended = signal(current, ready or pods, started / seconds, seconds)
            decision, state = decide(current, recommended, now, state, behaviour)
            if decision.replicas != current:
                run.decisions += 1
            for _ in range(decision.replicas - current):
                pods.append(Replica(max(p.index for p in pods) + 1, now + scenario.startup))
            for _ in range(current - decision.replicas):
                victim = min((p for p in pods if not p.draining),
                             key=lambda p: (p.inflight, -p.index))  # fmt: skip
                victim.draining = True
                if victim.inflight == 0:
                    pods.remove(victim)
            run.windows.append(Window(
                now, len([p for p in pods if not p.draining and p.ready_at <= now]),
                decision.replicas, demand, p99(calls_in_window), p99(delays_in_window),
                len(calls_in_window),
            ))  # fmt: skip
            for pod in pods:
                pod.cpu = pod.waited = 0.0
            calls_in_window, delays_in_window, started, last_tick = [], [], 0, now
            push(now + scenario.interval, "tick")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.render_scaling",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--minutes", type=float, default=20.0, help="virtual minutes (20)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument("--plot", type=Path, help="PNG of replicas and p99 (needs matplotlib)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    cost = asyncio.run(calibrate())
    print(f"calibrated: {cost.base * 1000:.3f} ms + {cost.per_token * 1e6:.3f} us/token",
          file=sys.stderr)  # fmt: skip
    text = calibration_text(cost, Scenario(minutes=args.minutes))
    for plan in ("ramp", "step"):
        scenario = Scenario(plan=plan, minutes=args.minutes)
        runs = [replay(name, signal, cost, scenario, args.seed)
                for name, signal in policies(cost, scenario).items()]  # fmt: skip
        plot = ""
        if args.plot is not None:
            path = args.plot.with_name(f"{args.plot.stem}-{plan}{args.plot.suffix}")
            if draw(runs, scenario, path):
                plot = path.name
            else:
                print("matplotlib is not installed: no plot", file=sys.stderr)
        summaries = [summarize(r, scenario) for r in runs]
        text += f"\n### Scenario: {plan}\n\n" + markdown(scenario, summaries, runs, plot)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    print(f"took {time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
