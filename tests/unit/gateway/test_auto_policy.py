"""Auto mode's decision rules, one by one, with an injected clock."""

from __future__ import annotations

import pytest

from pdserve.gateway.policy import AutoPolicy, PolicySettings, QueueState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(**settings: float) -> tuple[AutoPolicy, Clock]:
    clock = Clock()
    return AutoPolicy(PolicySettings(**settings), clock), clock  # type: ignore[arg-type]


def test_no_prefill_endpoint_means_local() -> None:
    auto, _ = policy()
    assert (
        auto.decide(prompt_tokens=8000, prefill_available=False, ttft_budget=2.0).reason
        == "no_prefill"
    )


def test_short_prompts_prefill_locally_long_ones_disaggregate() -> None:
    auto, _ = policy(short_prompt_tokens=512)
    assert (
        auto.decide(prompt_tokens=100, prefill_available=True, ttft_budget=2.0).reason
        == "short_prompt"
    )
    long = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0)
    assert (long.disaggregated, long.reason) == (True, "long_prompt")


def test_a_handoff_predicted_over_the_ttft_budget_goes_local() -> None:
    auto, _ = policy()
    # 8k tokens took 1.3 s: ~0.16 ms per token, as in the article.
    auto.health.observe(1.3, 8000, ttft_budget=2.0)
    assert auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0).disaggregated
    slow = auto.decide(prompt_tokens=16000, prefill_available=True, ttft_budget=2.0)
    assert (slow.disaggregated, slow.reason) == (False, "handoff_over_ttft_budget")
    assert auto.decide(prompt_tokens=16000, prefill_available=True, ttft_budget=None).disaggregated


def test_the_estimate_follows_the_handoffs_it_sees() -> None:
    auto, _ = policy(ewma_alpha=0.5)
    auto.health.observe(1.0, 1000, ttft_budget=None)
    auto.health.observe(3.0, 1000, ttft_budget=None)
    assert auto.health.predicted_handoff(1000) == 2.0


def test_repeated_failures_degrade_to_local_with_probes_and_recover() -> None:
    auto, clock = policy(failures_to_degrade=3, probe_every=4, recover_after_successes=2)
    for _ in range(3):
        auto.health.failure()
        clock.now += 1
    decisions = [auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0).reason
                 for _ in range(8)]  # fmt: skip
    assert decisions == ["degraded"] * 3 + ["probe"] + ["degraded"] * 3 + ["probe"]
    auto.health.observe(0.5, 8000, ttft_budget=2.0)
    assert auto.health.degraded
    auto.health.observe(0.5, 8000, ttft_budget=2.0)
    assert not auto.health.degraded
    assert (
        auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0).reason
        == "long_prompt"
    )


def test_failures_spread_beyond_the_window_do_not_degrade() -> None:
    auto, clock = policy(failures_to_degrade=3, failure_window_seconds=60)
    for _ in range(5):
        auto.health.failure()
        clock.now += 61
    assert not auto.health.degraded


def test_a_handoff_slower_than_the_budget_counts_as_a_failure() -> None:
    auto, _ = policy(failures_to_degrade=2)
    auto.health.observe(5.0, 8000, ttft_budget=2.0)
    auto.health.observe(5.0, 8000, ttft_budget=2.0)
    assert auto.health.degraded


def test_an_idle_decode_replica_prefills_locally() -> None:
    auto, _ = policy()
    idle = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                       queues=QueueState(decode_active=0, prefill_ahead=0))  # fmt: skip
    assert (idle.disaggregated, idle.reason) == (False, "decode_idle")
    busy = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                       queues=QueueState(decode_active=2, prefill_ahead=0))  # fmt: skip
    assert (busy.disaggregated, busy.reason) == (True, "long_prompt")
    off, _ = policy(local_when_decode_idle=False)
    assert off.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                      queues=QueueState(decode_active=0)).disaggregated  # fmt: skip


def test_a_prefill_queue_that_would_break_the_ttft_slo_goes_local() -> None:
    auto, _ = policy()
    auto.health.observe_prefill(0.5, 8000)  # 8k tokens prefill in 0.5 s
    auto.health.observe(0.3, 8000, ttft_budget=2.0)
    busy = QueueState(decode_active=4, prefill_ahead=1)
    # One request ahead: 2 x 0.5 s + 0.3 s handoff = 1.3 s, within 2 s.
    assert auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                       queues=busy).disaggregated  # fmt: skip
    # Four ahead: 5 x 0.5 + 0.3 = 2.8 s; locally 0.5 s fits.
    queued = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                         queues=QueueState(decode_active=4, prefill_ahead=4))  # fmt: skip
    assert (queued.disaggregated, queued.reason) == (False, "prefill_queue_over_ttft_budget")
    # If even a local prefill cannot meet the SLO, keep P/D (it at least spares decode's ITL).
    assert auto.decide(prompt_tokens=40000, prefill_available=True, ttft_budget=2.0,
                       queues=QueueState(decode_active=4, prefill_ahead=4)).disaggregated  # fmt: skip


def test_a_kv_path_too_slow_for_the_slo_frees_the_prefill_pool_for_whole_requests() -> None:
    auto, _ = policy()
    auto.health.observe_prefill(0.65, 8000)  # the article: 8k tokens prefill in ~0.65 s
    auto.health.observe(1.3, 8000, ttft_budget=2.0)  # ... and move in ~1.3 s
    slow = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                       queues=QueueState(decode_active=3, prefill_ahead=0))  # fmt: skip
    assert (slow.disaggregated, slow.reason, slow.anywhere) == (
        False, "kv_path_over_ttft_budget", True,
    )  # fmt: skip
    fast, _ = policy()
    fast.health.observe_prefill(0.65, 8000)
    fast.health.observe(0.02, 8000, ttft_budget=2.0)
    congested = fast.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                            queues=QueueState(decode_active=3, prefill_ahead=3))  # fmt: skip
    # Congestion, not the path: local on decode only, the prefill pool stays with P/D.
    assert (congested.reason, congested.anywhere) == ("prefill_queue_over_ttft_budget", False)


def test_p_d_goes_only_through_prefill_replicas_whose_kv_path_fits_the_budget() -> None:
    """Each prefill replica's handoffs are learnt apart (its decode partners are in its slice):
    a slow slice is avoided, not the whole prefill pool; with every path slow, local."""
    auto, _ = policy()
    auto.health.observe_prefill(0.65, 8000)
    auto.health.observe(0.02, 8000, ttft_budget=2.0, prefill="http://p0")  # NVLink/RDMA
    auto.health.observe(1.3, 8000, ttft_budget=2.0, prefill="http://p1")  # TCP fallback
    busy = QueueState(decode_active=3, prefill_ahead=0)
    both = ["http://p0", "http://p1"]
    pd = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=busy,
                     prefill_replicas=both)  # fmt: skip
    assert (pd.disaggregated, pd.reason, pd.prefill) == (True, "long_prompt", ("http://p0",))
    # A replica not seen yet is judged by all handoffs so far (here: their average, fits).
    fresh = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                        queues=busy, prefill_replicas=["http://p1", "http://p2"])  # fmt: skip
    assert (fresh.disaggregated, fresh.prefill) == (True, ("http://p2",))
    slow = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=busy,
                       prefill_replicas=["http://p1"])  # fmt: skip
    assert (slow.disaggregated, slow.reason, slow.anywhere) == (
        False, "kv_path_over_ttft_budget", True,
    )  # fmt: skip
    # Every replica fits: no restriction.
    assert auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=busy,
                       prefill_replicas=["http://p0"]).prefill == ()  # fmt: skip
    auto.health.forget(["http://p0"])  # p1 was scaled away
    assert set(auto.health.by_prefill) == {"http://p0"}


def test_an_excluded_replicas_estimate_expires_so_it_is_tried_again() -> None:
    auto, clock = policy(failure_window_seconds=60)
    auto.health.observe_prefill(0.65, 8000)
    auto.health.observe(3.0, 8000, ttft_budget=2.0, prefill="http://p0")  # one slow first pull
    for _ in range(5):
        auto.health.observe(0.02, 8000, ttft_budget=2.0, prefill="http://p1")
    busy = QueueState(decode_active=3, prefill_ahead=0)
    both = ["http://p0", "http://p1"]
    now = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=busy,
                      prefill_replicas=both)  # fmt: skip
    assert now.prefill == ("http://p1",)
    clock.now += 61  # no news from p0 for a failure window: judged by all handoffs again
    later = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=busy,
                        prefill_replicas=both)  # fmt: skip
    assert (later.disaggregated, later.prefill) == (True, ())


def test_congestion_is_judged_on_the_replicas_p_d_may_use() -> None:
    """The replica excluded for its slow path is idle by construction: its empty queue must not
    hide that the replica P/D would use is swamped; and among fitting replicas, only those
    whose queue leaves room take P/D."""
    auto, _ = policy()
    auto.health.observe_prefill(0.5, 8000)
    auto.health.observe(1.5, 8000, ttft_budget=2.0, prefill="http://slow")
    auto.health.observe(0.05, 8000, ttft_budget=2.0, prefill="http://fast")
    swamped = QueueState(decode_active=3, prefill_ahead=0,
                         prefill_ahead_by={"http://slow": 0, "http://fast": 10})  # fmt: skip
    spill = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                        queues=swamped, prefill_replicas=["http://slow", "http://fast"])  # fmt: skip
    assert (spill.disaggregated, spill.reason) == (False, "prefill_queue_over_ttft_budget")
    auto.health.observe(0.05, 8000, ttft_budget=2.0, prefill="http://other")
    mixed = QueueState(decode_active=3, prefill_ahead=0,
                       prefill_ahead_by={"http://fast": 10, "http://other": 1})  # fmt: skip
    pd = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0, queues=mixed,
                     prefill_replicas=["http://fast", "http://other"])  # fmt: skip
    assert (pd.disaggregated, pd.prefill) == (True, ("http://other",))


def test_a_spill_that_would_push_decodes_streams_over_the_itl_slo_stays_p_d() -> None:
    """Local prefill on a busy decode replica stalls every stream there: 0.65 s spread over a
    256-token answer adds ~2.5 ms per token. Spill only while that keeps the replica's recent
    step time within 90% of the ITL SLO; otherwise one late first token beats many late
    streams."""
    from dataclasses import replace

    auto, _ = policy()
    auto.health.observe_prefill(0.65, 8000)
    auto.health.observe(0.02, 8000, ttft_budget=2.0)
    auto.observe_output(256)
    calm = QueueState(decode_active=8, prefill_ahead=3, decode_step_seconds=0.024)

    def decide(queues: QueueState, itl: float | None = 0.030) -> tuple[bool, str]:
        d = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0,
                        queues=queues, itl_budget=itl)  # fmt: skip
        return d.disaggregated, d.reason

    assert decide(calm) == (False, "prefill_queue_over_ttft_budget")  # 26.5 ms <= 27 ms
    strained = replace(calm, decode_step_seconds=0.026)  # 28.5 ms > 27 ms
    assert decide(strained) == (True, "local_would_break_itl")
    assert decide(strained, itl=None) == (False, "prefill_queue_over_ttft_budget")
    assert decide(replace(strained, decode_step_seconds=None)) == (
        False, "prefill_queue_over_ttft_budget",
    )  # fmt: skip  # nothing measured yet: TTFT decides


def test_step_meter_averages_gaps_per_window_and_starts_anew_after_quiet() -> None:
    from pdserve.gateway.endpoints import StepMeter

    meter = StepMeter()
    for i in range(10):
        meter.observe(0.02, now=i * 0.1, window=0.5)
    assert meter.seconds == pytest.approx(0.02)
    for i in range(10):
        meter.observe(0.06, now=1.0 + i * 0.1, window=0.5)
    assert 0.02 < (meter.seconds or 0) < 0.06  # smoothed across windows
    before = meter.seconds
    meter.observe(0.5, now=100.0, window=0.5)  # after a quiet spell a window starts anew:
    assert meter.seconds == before  # the gap across the pause is one sample of a new window


def test_a_chat_behind_a_long_document_spills_even_with_one_request_ahead() -> None:
    """One request ahead on the prefill replica, but it is a 30k-token document: counted as a
    request like this 600-token chat it looks harmless; its prompt tokens say ~2.4 s."""
    auto, _ = policy(short_prompt_tokens=512)
    auto.health.observe_prefill(0.65, 8000)  # ~81 us per token
    auto.health.observe(0.02, 8000, ttft_budget=2.0, prefill="http://p0")
    queues = QueueState(decode_active=3, prefill_ahead=1, prefill_ahead_by={"http://p0": 1},
                        prefill_backlog_by={"http://p0": 30000})  # fmt: skip
    chat = auto.decide(prompt_tokens=600, prefill_available=True, ttft_budget=2.0,
                       queues=queues, prefill_replicas=["http://p0"])  # fmt: skip
    assert (chat.disaggregated, chat.reason) == (False, "prefill_queue_over_ttft_budget")
    light = QueueState(decode_active=3, prefill_ahead=1, prefill_ahead_by={"http://p0": 1},
                       prefill_backlog_by={"http://p0": 600})  # fmt: skip
    assert auto.decide(prompt_tokens=600, prefill_available=True, ttft_budget=2.0,
                       queues=light, prefill_replicas=["http://p0"]).disaggregated  # fmt: skip


def test_one_request_at_a_time_learns_the_kv_path_the_others_run_anywhere() -> None:
    auto, clock = policy(learning_timeout_budgets=2.0)

    def decide() -> tuple[bool, str, bool]:
        d = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0)
        return d.disaggregated, d.reason, d.anywhere

    assert decide() == (True, "long_prompt", False)  # measures the first handoff
    assert decide() == (False, "handoff_unknown", True)  # aggregated-like meanwhile
    clock.now += 3.9
    assert decide() == (False, "handoff_unknown", True)
    clock.now += 0.2  # the learner never reported (not streamed): the next one tries
    assert decide() == (True, "long_prompt", False)
    assert decide() == (False, "handoff_unknown", True)
    auto.health.failure()  # the learner failed: the next one tries at once
    assert decide() == (True, "long_prompt", False)
    auto.health.observe(0.5, 8000, ttft_budget=2.0)  # measured: every request decides on it
    assert [decide() for _ in range(2)] == [(True, "long_prompt", False)] * 2


def test_when_nothing_ever_measures_a_handoff_p_d_stops_waiting_for_one() -> None:
    """Non-streamed traffic on engines without NIXL metrics: after the failure window of
    learning in vain, every long prompt goes P/D again (judged by failures only)."""
    auto, clock = policy(failure_window_seconds=60, learning_timeout_budgets=2.0)

    def reason() -> str:
        return auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0).reason

    assert [reason(), reason()] == ["long_prompt", "handoff_unknown"]
    for _ in range(14):  # a learner every 4 s, none of which reports
        clock.now += 4.1
        assert [reason(), reason()] == ["long_prompt", "handoff_unknown"]
    clock.now += 4.1  # 61.5 s since the first learner
    assert [reason(), reason()] == ["long_prompt", "long_prompt"]


def test_without_a_ttft_budget_nothing_needs_learning() -> None:
    auto, _ = policy()
    for _ in range(3):
        assert auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=None).reason == (
            "long_prompt"
        )


def test_decode_engines_transfer_times_teach_the_kv_path_of_their_slice() -> None:
    """vllm:nixl_xfer_time_seconds covers requests the gateway did not stream (it times
    handoffs only from streams): 1.3 s per transfer of ~8k-token prompts is the slow path."""
    auto, _ = policy()
    auto.health.observe_transfers(1.3, 2.0, ["http://p1"])
    assert auto.health.seconds_per_token is None  # no P/D prompt of its own to scale them by
    auto.health.note_pd_prompt(8000)
    auto.health.observe_transfers(1.3, 2.0, ["http://p1"])
    assert auto.health.predicted_handoff(8000, "http://p1") == pytest.approx(1.3)
    assert "http://p0" not in auto.health.by_prefill  # another slice's replica learns nothing
    auto.health.observe_prefill(0.65, 8000)
    slow = auto.decide(prompt_tokens=8000, prefill_available=True, ttft_budget=2.0)
    assert (slow.disaggregated, slow.reason) == (False, "kv_path_over_ttft_budget")
    for _ in range(3):  # transfers slower than the whole TTFT budget count as failures
        auto.health.observe_transfers(2.5, 2.0, ["http://p1"])
    assert auto.health.degraded
