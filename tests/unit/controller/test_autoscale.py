"""The Builtin autoscaler's decision rules with injected metrics and clocks: scale up, scale
down, flapping suppressed, steps, cooldowns and bounds; then the loop on fake /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from pdserve.builders import ReplicaPlan
from pdserve.controller.autoscale.behaviour import Behaviour, ScalerState, decide
from pdserve.controller.autoscale.loop import Autoscaler
from pdserve.controller.autoscale.plans import live_plan
from pdserve.controller.autoscale.rules import (
    recommend_decode,
    recommend_prefill,
    recommend_render,
    slices_for,
)
from tests.support.specs import autoscaled_model as model

# ---- raw recommendations -------------------------------------------------------------------


def render(busy: list[float], cpu: list[float] | None = None, current: int = 2) -> int:
    rec = recommend_render(
        current, busy, cpu or [], workers=2, cpu_request=2.0, target_busy=0.7, target_cpu=0.7
    )
    assert rec is not None
    return rec.replicas


def test_render_follows_parser_busy_per_worker() -> None:
    # A pod's target: 2 workers x 70% = 1.4 busy s/s; 2 pods carrying 5.6 need twice as many.
    assert render([2.8, 2.8]) == 4
    assert render([1.4, 1.5]) == 2  # within 10% of the target: no change
    assert render([0.3, 0.4]) == 1
    assert render([6.0, 6.0]) == 9  # 12 busy s/s / 1.4 per pod -> ceil(8.6)


def test_render_cpu_is_the_floor_signal() -> None:
    # Little parser time (templating-heavy traffic), but the CPU runs hot: CPU decides.
    assert render([0.2, 0.2], cpu=[1.9, 1.9]) == 3
    rec = recommend_render(2, [], [], workers=1, cpu_request=1, target_busy=0.7, target_cpu=0.7)
    assert rec is None  # no pod answered: no recommendation


def test_prefill_drains_the_queue_within_half_the_ttft_slo() -> None:
    # 3000 tokens/s arriving + 8000 queued to drain in 1 s, at 4000 tokens/s per replica x 80%.
    rec = recommend_prefill(
        1, token_rate=3000, queued_tokens=8000, throughput=4000, ttft_slo=2.0, target=0.8
    )
    assert rec is not None
    assert rec.replicas == 4  # (3000 + 8000) / 3200 = 3.4
    idle = recommend_prefill(3, token_rate=500, queued_tokens=0, throughput=4000, ttft_slo=2.0,
                             target=0.8)  # fmt: skip
    assert idle is not None
    assert idle.replicas == 1
    unknown = recommend_prefill(1, token_rate=0, queued_tokens=0, throughput=None, ttft_slo=2.0,
                                target=0.8)  # fmt: skip
    assert unknown is None  # no throughput measured yet


def test_prefill_adds_a_replica_while_measured_ttft_breaks_the_slo() -> None:
    rec = recommend_prefill(
        2, token_rate=1000, queued_tokens=0, throughput=4000, ttft_slo=1.0, target=0.8, ttft=1.6
    )
    assert rec is not None
    assert rec.replicas == 3
    assert "TTFT 1600 ms over the SLO 1000 ms" in rec.reason


@pytest.mark.parametrize(
    ("kv", "itl", "expected"),
    [
        (0.8, None, 2),  # at the KV target
        (0.96, None, 3),  # KV-cache nearly full
        (0.5, 0.020, 2),  # 0.5/0.8 = 0.625 -> ceil(1.25)
        (0.5, 0.075, 3),  # ITL 1.5x the SLO wins over a half-empty cache
        (0.1, 0.010, 1),
    ],
)
def test_decode_follows_kv_cache_and_itl(kv: float, itl: float | None, expected: int) -> None:
    rec = recommend_decode(2, kv_usage=kv, itl=itl, itl_slo=0.050, target_kv=0.8)
    assert rec is not None
    assert rec.replicas == expected


def test_slices_cover_both_pools_in_whole_groups() -> None:
    # 1 prefill + 2 decode per slice: 3 prefill wanted, 3 decode wanted -> 3 slices.
    assert slices_for({"prefill": 3, "decode": 3}, {"prefill": 1, "decode": 2}) == 3
    assert slices_for({"prefill": 1, "decode": 5}, {"prefill": 1, "decode": 2}) == 3


# ---- behaviour: windows, steps, cooldowns, bounds ------------------------------------------
RENDER_LIKE = Behaviour(1, 10, up_window=0, down_window=300, up_step=4, down_step=1, cooldown=30)


def run(
    recommendations: Sequence[tuple[float, int]], current: int, behaviour: Behaviour = RENDER_LIKE
) -> list[int]:
    """Replicas after each (time, recommendation), applying every decision."""
    state, seen = ScalerState(), []
    for now, recommended in recommendations:
        decision, state = decide(current, recommended, now, state, behaviour)
        current = decision.replicas
        seen.append(current)
    return seen


def test_scale_up_is_immediate_but_stepped_and_cooled_down() -> None:
    # Load for 9 replicas arrives: +4 at once, +4 after the 30 s cooldown, then the last one.
    assert run([(0, 9), (15, 9), (30, 9), (45, 9), (60, 9)], current=1) == [5, 5, 9, 9, 9]


def test_scale_down_waits_for_the_window_and_goes_one_at_a_time() -> None:
    times = [(t, 1) for t in range(0, 391, 15)]
    seen = run([(-1, 4), *times], current=4)
    # The high recommendation at t=-1 holds replicas until it leaves the 300 s window.
    assert seen[: 1 + 20] == [4] * 21
    assert seen[21:] == [3, 3, 2, 2, 1, 1, 1]  # t=300: one step, then one per 30 s cooldown


def test_flapping_load_changes_nothing() -> None:
    engines = Behaviour(1, 8, up_window=60, down_window=600, up_step=1, down_step=1, cooldown=300)
    alternating = [(t, 4 if (t // 15) % 2 else 1) for t in range(0, 900, 15)]
    assert set(run(alternating, current=2, behaviour=engines)) == {2}


def test_a_spike_shorter_than_the_up_window_adds_nothing() -> None:
    engines = Behaviour(1, 8, up_window=60, down_window=600, up_step=1, down_step=1, cooldown=0)
    assert run([(0, 2), (15, 6), (30, 2), (45, 2)], current=2, behaviour=engines) == [2, 2, 2, 2]
    sustained = [(t, 6) for t in range(0, 76, 15)]
    assert run(sustained, current=2, behaviour=engines)[-2:] == [3, 4]  # from t=60, one per step


def test_bounds_always_hold() -> None:
    bounded = Behaviour(2, 5, up_window=0, down_window=0, up_step=10, down_step=10, cooldown=0)
    assert run([(0, 50)], current=2, behaviour=bounded) == [5]
    assert run([(0, 0)], current=4, behaviour=bounded) == [2]
    # Bounds moved under a running pool (spec edit): back inside them at once, cooldown or not.
    decision, _ = decide(9, 9, 0, ScalerState(last_up=0), bounded)
    assert decision.replicas == 5


# ---- what the cluster holds ----------------------------------------------------------------
SLICED = model(
    prefill={"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    decode={"replicas": 2, "autoscaling": {"minReplicas": 2, "maxReplicas": 8}},
    placement={"slices": 4, "domain": {}},
)


def workload(component: str, replicas: int, slice_index: int | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": component}
    if slice_index is not None:
        labels["pdserve.io/slice"] = str(slice_index)
    return {
        "metadata": {"labels": labels},
        "spec": {"replicas": replicas, "template": {"metadata": {"labels": labels}}},
    }


def test_live_replicas_are_the_memory_across_restarts() -> None:
    live = [workload("prefill", int(i < 2), i) for i in range(4)] + [
        workload("decode", 2, 0), workload("decode", 2, 1), workload("decode", 0, 2),
        workload("decode", 0, 3), workload("render", 3),
    ]  # fmt: skip
    assert live_plan(SLICED, live) == ReplicaPlan(render=3, slices=2)
    plain = model(decode={"replicas": 1, "autoscaling": {}})
    assert live_plan(plain, [workload("decode", 3), workload("prefill", 1)]) == ReplicaPlan(
        render=None, prefill=1, decode=3
    )


# ---- the loop on fake /metrics -------------------------------------------------------------
class FakePods:
    """/metrics of render pods, gateways and engines, with counters the test advances."""

    def __init__(self) -> None:
        self.render_busy: dict[str, float] = {}
        self.gateway_busy: dict[str, float] = {}
        self.engine: dict[str, dict[str, float]] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host.startswith("render"):
            busy = self.render_busy[host]
            text = (
                'http_request_duration_seconds_sum{handler="/v1/chat/completions/derender",'
                f'method="POST"}} {busy}\n'
                'http_request_duration_seconds_sum{handler="/health",method="GET"} 99\n'
                "process_cpu_seconds_total 0\n"
            )
        elif host == "gateway":
            text = "".join(
                f'pdserve_gateway_render_call_seconds_sum{{render_pod="{pod}",stage="derender"}}'
                f" {value}\n"
                for pod, value in self.gateway_busy.items()
            )
        else:
            text = "".join(f"{name} {value}\n" for name, value in self.engine[host].items())
        return httpx.Response(200, text=text)


def pod(name: str, component: str, host: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
        "status": {"podIP": host},
    }


def resolve(pod: Any) -> str:
    return f"http://{pod['status']['podIP']}/metrics"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_loop_scales_render_on_the_higher_of_server_and_gateway_busy() -> None:
    dm = model(render={"autoscaling": {"engine": "Builtin", "minReplicas": 1, "maxReplicas": 6}})
    fake, clock = FakePods(), Clock()
    changed: list[tuple[str, str]] = []
    fake.render_busy = {"render-a": 0.0, "render-b": 0.0}
    fake.gateway_busy = {"qwen-render-a": 0.0, "qwen-render-b": 0.0}
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    scaler = Autoscaler(changed.append, client=client, resolve=resolve, clock=clock)
    pods = [pod("qwen-render-a", "render", "render-a"), pod("qwen-render-b", "render", "render-b"),
            pod("qwen-gateway-x", "gateway", "gateway")]  # fmt: skip
    key = ("llm", "qwen")
    plan, news = scaler.plan(key, dm, ReplicaPlan(render=2), pods)
    assert (plan.render, news) == (2, [])
    await scaler.scrape_once()  # the baseline
    # 10 s later: the servers saw 7 s of handler time each (0.7 s/s: on target for 1 worker),
    # but the gateways waited 25 s on pod a: derender calls queue there.
    clock.now = 10
    fake.render_busy = {"render-a": 7.0, "render-b": 7.0}
    fake.gateway_busy = {"qwen-render-a": 25.0, "qwen-render-b": 7.0}
    await scaler.scrape_once()
    assert changed == [key]
    plan, news = scaler.plan(key, dm, ReplicaPlan(render=2), pods)
    assert plan.render == 5  # (2.5 + 0.7) / 0.7 -> 4.6: +3 (within the 4-pod step)
    [decision] = news
    assert decision.direction == "up"
    assert decision.reason.startswith("render replicas 2 -> 5: parser busy 3.20 s/s over 2 pods")
    # Announced once; once live, forgotten.
    assert scaler.plan(key, dm, ReplicaPlan(render=2), pods)[1] == []
    assert scaler.plan(key, dm, ReplicaPlan(render=5), pods) == (ReplicaPlan(render=5), [])
    text = scaler.metrics.registry.get_sample_value(
        "pdserve_operator_autoscale_decisions_total",
        {"namespace": "llm", "model": "qwen", "pool": "render", "direction": "up"},
    )
    assert text == 1.0
    await client.aclose()


async def test_loop_scales_whole_slices_from_engine_metrics() -> None:
    fake, clock = FakePods(), Clock()
    changed: list[tuple[str, str]] = []
    engine = {
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:prompt_tokens_total": 0.0,
        "vllm:request_prefill_time_seconds_sum": 0.0,
        "vllm:num_requests_waiting": 0,
    }
    fake.engine = {"p0": dict(engine), "d0": dict(engine), "d1": dict(engine)}
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    scaler = Autoscaler(changed.append, client=client, resolve=resolve, clock=clock)
    pods = [pod("qwen-prefill-s0-0", "prefill", "p0"), pod("qwen-decode-s0-0", "decode", "d0"),
            pod("qwen-decode-s0-1", "decode", "d1")]  # fmt: skip
    key = ("llm", "qwen")
    scaler.plan(key, SLICED, ReplicaPlan(slices=1), pods)
    await scaler.scrape_once()
    # Decode KV caches fill (95% > 80% target: 2 -> 3 decode) and prefill runs 6000 tokens/s at
    # 4000 tokens per busy second (2 prefill at 80%): both fit in 2 slices.
    for _ in range(6):  # sustained past the 60 s up window
        clock.now += 15
        for name in ("d0", "d1"):
            fake.engine[name]["vllm:kv_cache_usage_perc"] = 0.95
        fake.engine["p0"]["vllm:prompt_tokens_total"] += 6000 * 15
        fake.engine["p0"]["vllm:request_prefill_time_seconds_sum"] += 6000 * 15 / 4000
        await scaler.scrape_once()
    plan, [decision] = scaler.plan(key, SLICED, ReplicaPlan(slices=1), pods)
    assert plan.slices == 2
    assert decision.reason.startswith("slices 1 -> 2: prefill: 6000 prompt tokens/s")
    await client.aclose()


async def test_loop_serves_the_bound_it_holds_a_pool_at_until_the_model_goes() -> None:
    """What PdserveAutoscalerAtMax reads: replicas held, the pool's maximum, the raw
    recommendation; gone with the model (a deleted model would alert for ever)."""
    dm = model(render={"autoscaling": {"engine": "Builtin", "minReplicas": 1, "maxReplicas": 3}})
    fake, clock = FakePods(), Clock()
    fake.render_busy = {"render-a": 0.0, "render-b": 0.0}
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    scaler = Autoscaler(lambda _: None, client=client, resolve=resolve, clock=clock)
    pods = [pod("qwen-render-a", "render", "render-a"), pod("qwen-render-b", "render", "render-b"),
            pod("qwen-gateway-x", "gateway", "gateway")]  # fmt: skip
    key = ("llm", "qwen")
    scaler.plan(key, dm, ReplicaPlan(render=2), pods)
    await scaler.scrape_once()
    clock.now = 10
    fake.render_busy = {"render-a": 20.0, "render-b": 20.0}  # 2 s/s each: 6 pods' worth
    await scaler.scrape_once()
    labels = {"namespace": "llm", "model": "qwen", "pool": "render"}

    def value(name: str) -> float | None:
        return scaler.metrics.registry.get_sample_value(
            f"pdserve_operator_autoscale_{name}", labels
        )

    assert (value("replicas"), value("max_replicas")) == (3, 3)
    recommended = value("recommendation")
    assert recommended is not None
    assert recommended > 3
    scaler.forget(key)
    assert (value("replicas"), value("max_replicas"), value("recommendation")) == (None,) * 3
    await client.aclose()


async def test_loop_reads_each_data_parallel_rank_and_scales_groups() -> None:
    """Engines with data-parallel ranks report KV-cache use and prefill time per rank
    (`engine="<rank>"`): the decode signal is the mean over ranks, not their sum, and a replica
    (here a group of two pods, 2 ranks each) prefills as fast as all its ranks. The plan is in
    groups, what the LeaderWorkerSet's replicas count."""
    groups = model(
        model={"name": "deepseek-ai/DeepSeek-R1-0528"},
        prefill={"replicas": 1, "nodesPerReplica": 2, "dataParallelSize": 4,
                 "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
        decode={"replicas": 2, "nodesPerReplica": 2, "dataParallelSize": 4,
                "autoscaling": {"minReplicas": 1, "maxReplicas": 6}},
    )  # fmt: skip
    fake, clock = FakePods(), Clock()
    changed: list[tuple[str, str]] = []

    def ranks(first: int, **values: float) -> dict[str, float]:
        return {f'{name}{{engine="{rank}"}}': value for rank in (first, first + 1)
                for name, value in values.items()}  # fmt: skip

    # Decode: every rank's cache 60% full (under the 80% target: a sum would read 120% and
    # scale up). Prefill: each rank prefills 4000 tokens per busy second.
    for host, first in (("d0", 0), ("d1", 2), ("d2", 0), ("d3", 2)):
        fake.engine[host] = ranks(first, **{"vllm:kv_cache_usage_perc": 0.6})
    prefill = {"vllm:prompt_tokens_total": 0.0, "vllm:request_prefill_time_seconds_sum": 0.0}
    for host, first in (("p0", 0), ("p1", 2)):
        fake.engine[host] = ranks(first, **prefill)
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    scaler = Autoscaler(changed.append, client=client, resolve=resolve, clock=clock)
    pods = [
        pod("qwen-prefill-0", "prefill", "p0"), pod("qwen-prefill-0-1", "prefill", "p1"),
        pod("qwen-decode-0", "decode", "d0"), pod("qwen-decode-0-1", "decode", "d1"),
        pod("qwen-decode-1", "decode", "d2"), pod("qwen-decode-1-1", "decode", "d3"),
    ]  # fmt: skip
    key = ("llm", "qwen")
    scaler.plan(key, groups, ReplicaPlan(prefill=1, decode=2), pods)
    await scaler.scrape_once()
    # 24000 prompt tokens/s over the group's 4 ranks at 4000 tokens per rank-busy-second: one
    # group prefills 16000 tokens/s, 12800 at the 80% target: 2 groups (4 if it were per pod).
    for _ in range(6):  # sustained past the 60 s up window
        clock.now += 15
        for host in ("p0", "p1"):
            for name, value in fake.engine[host].items():
                if name.startswith("vllm:prompt_tokens_total"):
                    fake.engine[host][name] = value + 6000 * 15
                else:
                    fake.engine[host][name] = value + 6000 * 15 / 4000
        await scaler.scrape_once()
    plan, [decision] = scaler.plan(key, groups, ReplicaPlan(prefill=1, decode=2), pods)
    assert (plan.prefill, plan.decode) == (2, 2)
    assert decision.reason.startswith("prefill replicas 1 -> 2: 24000 prompt tokens/s")
    assert "over 16000 tokens/s per replica" in decision.reason
    await client.aclose()
