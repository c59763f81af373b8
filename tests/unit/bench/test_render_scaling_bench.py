"""The render-scaling benchmark's replay runs the operator's own rules in virtual time: a pool
under parser load grows with the parser-busy policy and stays put with a request-rate policy
calibrated on cheap requests."""

from __future__ import annotations

from pdserve.bench.render_scaling import Cost, Scenario, p99, policies, replay, summarize


def test_replay_scales_on_parser_load_and_request_rate_lags() -> None:
    cost = Cost(base=0.0002, per_token=2e-6)  # a parser ten times dearer than the simulator's
    scenario = Scenario(minutes=3, max_replicas=12)
    signals = policies(cost, scenario)
    busy = summarize(replay("busy", signals["parser busy (pdserve)"], cost, scenario, 1), scenario)
    rate = summarize(replay("rate", signals["request rate"], cost, scenario, 1), scenario)
    assert busy.calls > 1000
    assert busy.max_replicas > scenario.min_replicas
    assert rate.max_replicas == scenario.min_replicas
    assert busy.p99_all < rate.p99_all


def test_p99_and_stream_cost() -> None:
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([]) is None
    assert Cost(base=1.0, per_token=0.5).stream(3) == 3 + 0.5 * 6
