"""Auto mode: per request, disaggregated (prefill pool + KV handoff) or local prefill on decode.

The article's lesson: P/D cuts decode stalls (p99 ITL 169 -> 29 ms) but a slow KV path (1.3 s for
8k tokens) can break the TTFT SLO on its own. So the gateway measures the handoff it actually gets
and decides with it:
- no prefill endpoint, or the P/D path is degraded (recent transfer failures, expired leases,
  handoffs over the TTFT budget): local, except a small share of probes that detect recovery;
- short prompts: local (their prefill barely disturbs decode, and a handoff only adds latency);
- no handoff observed yet (start-up): one P/D request at a time learns the KV path, the others
  run whole on the least loaded engine of both pools, as aggregated serving would, until the
  first handoff is measured (a slow path would otherwise make every request of the first
  seconds miss the TTFT budget), or the failure window passes with nothing to measure it by;
- an idle decode replica (nothing running or queued): local, since no stream's ITL can suffer
  and the handoff is pure added latency (at low rates this gives aggregated serving's TTFT);
- a predicted handoff (EWMA seconds per prompt token x prompt tokens) over the TTFT budget: local;
- this prefill + the predicted handoff over the budget (the KV path itself is too slow):
  local, on the least loaded engine of both pools (the prefill pool cannot serve P/D usefully);
  the handoff is learnt per prefill replica (its decode partners sit in its slice, so one
  replica's path can be slow while another's is fast): P/D then goes only through the replicas
  whose path fits, and local only when none does; a replica's own estimate expires after the
  failure window without news, so an excluded replica is tried again on what all handoffs say;
- a predicted P/D TTFT (the prefill queue ahead of a replica, in requests and in prompt tokens
  still to prefill, + this prefill + its handoff) over
  the budget on every replica while local prefill would fit it: local on decode (congestion:
  keep the prefill pool for P/D), unless that prefill would push the decode replica's streams
  over the ITL SLO (its recent step time + this prefill spread over a typical answer's tokens
  over 90% of the budget): then P/D anyway, since one late first token costs less than every
  stream on decode missing its TPOT; otherwise P/D through the replicas predicted to fit;
- otherwise disaggregated.
Pure logic with an injected clock: every rule is tested deterministically."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PolicySettings:
    short_prompt_tokens: int = 512
    """Prompts shorter than this prefill locally."""
    ewma_alpha: float = 0.2
    """Weight of the newest handoff observation."""
    failure_window_seconds: float = 60.0
    failures_to_degrade: int = 3
    """This many P/D failures within the window routes everything local."""
    probe_every: int = 20
    """While degraded, every Nth eligible request still tries P/D to detect recovery."""
    recover_after_successes: int = 2
    """Consecutive successful probes that end the degraded state."""
    local_when_decode_idle: bool = True
    """Prefill locally on a decode replica with nothing running or queued."""
    local_on_prefill_pool: bool = True
    """A request Auto prefills locally may run whole on a prefill replica too (the least loaded
    of both pools): with a KV path too slow for the SLO, the prefill pool still serves."""
    pd_ttft_share: float = 0.9
    """P/D must be predicted to take at most this share of the TTFT budget (predictions are
    averages; a TTFT right at the budget misses it half the time)."""
    itl_share: float = 0.9
    """A local prefill must keep the decode replica's predicted step time within this share of
    the ITL budget."""
    learning_timeout_budgets: float = 2.0
    """While no handoff has been measured, a P/D request that has not reported one within this
    many TTFT budgets (it was not streamed, or it failed) lets the next one try. After the
    failure window with no measurement at all (non-streamed traffic, engines without NIXL
    metrics) P/D stops waiting for one: the path is then judged by failures only."""


@dataclass(frozen=True)
class QueueState:
    """The engines' queues as the gateway sees them (scraped metrics + its own in-flight)."""

    decode_active: float | None = None
    """Requests running or waiting on the least busy decode replica."""
    prefill_ahead: float | None = None
    """Requests running or waiting on the least busy prefill replica."""
    prefill_ahead_by: Mapping[str, float] = field(default_factory=dict)
    """The same per prefill replica URL."""
    decode_step_seconds: float | None = None
    """The recent time between tokens on the least busy decode replica's streams."""
    prefill_backlog_by: Mapping[str, float] = field(default_factory=dict)
    """Prompt tokens sent to each prefill replica and not prefilled yet (what a request count
    hides: a chat behind one 30k-token document waits as long as behind 30 chats)."""


@dataclass(frozen=True)
class Decision:
    disaggregated: bool
    reason: str
    anywhere: bool = False
    """Local, and the P/D path itself is unusable (too slow or failing): the request may run
    whole on a prefill replica too, so the prefill pool keeps serving."""
    prefill: tuple[str, ...] = ()
    """P/D only through these prefill replicas (the others' KV path is too slow); empty: any."""


def ewma(before: float | None, sample: float, alpha: float) -> float:
    return sample if before is None else alpha * sample + (1 - alpha) * before


class HandoffHealth:
    """What the gateway has observed of the P -> D handoff."""

    def __init__(
        self, settings: PolicySettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.seconds_per_token: float | None = None
        self.by_prefill: dict[str, tuple[float, float]] = {}
        """The same EWMA per prefill replica (the path from its slice), with when it was last
        observed."""
        self.prefill_seconds_per_token: float | None = None
        self.pd_prompt_tokens: float | None = None
        """EWMA of the prompt tokens of P/D requests (to read engines' transfer times per
        token)."""
        self.failures: deque[float] = deque()
        self.degraded = False
        self.successes_while_degraded = 0
        self.eligible_while_degraded = 0
        self.learning_since: float | None = None
        """When the P/D request that is to measure the first handoff was sent."""
        self.learning_began: float | None = None
        """When the first such request was sent."""

    def _ewma(self, before: float | None, sample: float) -> float:
        return ewma(before, sample, self.settings.ewma_alpha)

    def observe(
        self,
        handoff_seconds: float,
        prompt_tokens: int,
        ttft_budget: float | None,
        prefill: str | None = None,
    ) -> None:
        """A completed handoff: prefill (on replica `prefill`) answered -> first decode token."""
        self._learn(handoff_seconds / max(1, prompt_tokens), () if prefill is None else [prefill])
        self._judge(handoff_seconds, ttft_budget)

    def note_pd_prompt(self, prompt_tokens: int) -> None:
        """A prompt whose KV a decode engine is about to pull: what its transfers carry."""
        self.pd_prompt_tokens = self._ewma(self.pd_prompt_tokens, float(prompt_tokens))

    def observe_transfers(
        self, seconds_per_transfer: float, ttft_budget: float | None, prefills: Sequence[str]
    ) -> None:
        """A decode engine's own KV transfer times (vllm:nixl_xfer_time_seconds, averaged
        over a scrape interval) from the prefill replicas of its slice: learnt from every P/D
        request, streamed or not, taken to carry the typical P/D prompt."""
        if self.pd_prompt_tokens is None:
            return  # not this gateway's transfers (or not yet): nothing to scale them by
        self._learn(seconds_per_transfer / max(1.0, self.pd_prompt_tokens), prefills)
        self._judge(seconds_per_transfer, ttft_budget)

    def _learn(self, per_token: float, prefills: Sequence[str]) -> None:
        self.seconds_per_token = self._ewma(self.seconds_per_token, per_token)
        for prefill in prefills:
            before = self.by_prefill.get(prefill)
            estimate = self._ewma(None if before is None else before[0], per_token)
            self.by_prefill[prefill] = (estimate, self.clock())

    def _judge(self, handoff_seconds: float, ttft_budget: float | None) -> None:
        if ttft_budget is not None and handoff_seconds > ttft_budget:
            self.failure()  # a handoff slower than the whole TTFT budget is a failure for SLOs
            return
        if self.degraded:
            self.successes_while_degraded += 1
            if self.successes_while_degraded >= self.settings.recover_after_successes:
                self.degraded = False
                self.failures.clear()

    def observe_prefill(self, seconds: float, prompt_tokens: int) -> None:
        """A prefill call on the prefill pool: its speed predicts the queue ahead of the next."""
        per_token = seconds / max(1, prompt_tokens)
        self.prefill_seconds_per_token = self._ewma(self.prefill_seconds_per_token, per_token)

    def failure(self) -> None:
        """A failed transfer, an expired or expiring lease, or a handoff over budget."""
        now = self.clock()
        self.learning_since = None  # the learning request failed: the next one tries
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.settings.failure_window_seconds:
            self.failures.popleft()
        if len(self.failures) >= self.settings.failures_to_degrade:
            self.degraded = True
            self.successes_while_degraded = 0

    def replica_estimate(self, prefill: str) -> float | None:
        """Seconds per token through this prefill replica, unless too old to trust (a replica
        excluded for a slow path gets no traffic to update it: it is retried instead)."""
        known = self.by_prefill.get(prefill)
        if known is None or self.clock() - known[1] > self.settings.failure_window_seconds:
            return None
        return known[0]

    def predicted_handoff(self, prompt_tokens: int, prefill: str | None = None) -> float | None:
        """Through `prefill` when it has been seen lately, else what all handoffs said."""
        per_token = None if prefill is None else self.replica_estimate(prefill)
        if per_token is None:
            per_token = self.seconds_per_token
        return None if per_token is None else per_token * prompt_tokens

    def learning(self, ttft_budget: float | None) -> bool | None:
        """None: a handoff has been measured (or no TTFT budget needs one); True: a request
        is measuring the first one now; False: none is, the next P/D request may."""
        if ttft_budget is None or self.seconds_per_token is not None:
            return None
        now, began = self.clock(), self.learning_began
        if began is not None and now - began > self.settings.failure_window_seconds:
            return None  # nothing can measure it here: stop holding P/D back
        since = self.learning_since
        timeout = self.settings.learning_timeout_budgets * ttft_budget
        return since is not None and now - since < timeout

    def start_learning(self) -> None:
        """A P/D request is sent to measure the first handoff."""
        self.learning_since = self.clock()
        if self.learning_began is None:
            self.learning_began = self.learning_since

    def forget(self, prefill_replicas: Sequence[str]) -> None:
        """Keep per-replica estimates only for replicas that still exist."""
        for gone in set(self.by_prefill) - set(prefill_replicas):
            del self.by_prefill[gone]


@dataclass(frozen=True)
class AutoView:
    """What one decision reads of Auto mode's model, as of one moment: the settings it uses,
    the SLO budgets and what was learnt. The Python gateway decides from its own (AutoPolicy);
    the compiled data plane from the one pushed in its routing table (fastpath.routing_table).
    One decision, `decide_with` here and `decideAuto` in dataplane/auto.go, pinned on both
    sides by the cases in dataplane/testdata/auto_decision_cases.json."""

    short_prompt_tokens: int
    local_when_decode_idle: bool
    pd_ttft_share: float
    itl_share: float
    ttft_budget: float | None
    itl_budget: float | None
    degraded: bool
    learning: bool | None
    """HandoffHealth.learning: None, no measurement needed or one made; True, a request is
    measuring the first handoff; False, none is and the next P/D request may."""
    seconds_per_token: float | None
    by_prefill: Mapping[str, float]
    """Per prefill replica, its handoff estimate when fresh enough to trust."""
    prefill_seconds_per_token: float | None
    output_tokens: float | None

    def predicted_handoff(self, prompt_tokens: int, prefill: str | None) -> float | None:
        """HandoffHealth.predicted_handoff, from this view."""
        per_token = None if prefill is None else self.by_prefill.get(prefill)
        if per_token is None:
            per_token = self.seconds_per_token
        return None if per_token is None else per_token * prompt_tokens

    def to_wire(self) -> dict[str, Any]:
        """The view as the data plane reads it (camelCase keys, as in the routing table)."""
        return {WIRE_NAMES[k]: v for k, v in asdict(self).items()} | {
            "byPrefill": dict(sorted(self.by_prefill.items()))
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> AutoView:
        return cls(**{name: wire[key] for name, key in WIRE_NAMES.items()})


WIRE_NAMES = {
    "short_prompt_tokens": "shortPromptTokens",
    "local_when_decode_idle": "localWhenDecodeIdle",
    "pd_ttft_share": "pdTtftShare",
    "itl_share": "itlShare",
    "ttft_budget": "ttftBudget",
    "itl_budget": "itlBudget",
    "degraded": "degraded",
    "learning": "learning",
    "seconds_per_token": "secondsPerToken",
    "by_prefill": "byPrefill",
    "prefill_seconds_per_token": "prefillSecondsPerToken",
    "output_tokens": "outputTokens",
}


def local_breaks_itl(view: AutoView, this_prefill: float, queues: QueueState) -> bool:
    """Would prefilling this prompt on the least busy decode replica push its streams' time
    between tokens over the ITL budget?"""
    step, answer, itl_budget = queues.decode_step_seconds, view.output_tokens, view.itl_budget
    if itl_budget is None or not queues.decode_active or step is None or answer is None:
        return False
    return step + this_prefill / max(1.0, answer) > view.itl_share * itl_budget


def slow_path(view: AutoView, tokens: int, prefill: str | None) -> str | None:
    """Why P/D through this prefill replica would miss the TTFT budget on its KV path alone
    (None: it would not)."""
    ttft_budget = view.ttft_budget
    if ttft_budget is None:
        return None
    handoff = view.predicted_handoff(tokens, prefill)
    if handoff is not None and handoff > ttft_budget:
        return "handoff_over_ttft_budget"
    speed = view.prefill_seconds_per_token
    if speed is not None:
        this_prefill = speed * tokens
        target = view.pd_ttft_share * ttft_budget
        if this_prefill <= ttft_budget and this_prefill + (handoff or 0.0) > target:
            # Even an idle prefill pool would miss the SLO: the KV path is the problem.
            return "kv_path_over_ttft_budget"
    return None


def decide_with(
    view: AutoView,
    *,
    prompt_tokens: int | None,
    prefill_available: bool,
    queues: QueueState,
    prefill_replicas: Sequence[str],
    probe: Callable[[], bool],
) -> Decision:
    """P/D or local prefill for one request (the rules in this module's docstring). `probe`
    is asked once per request eligible for P/D while the path is degraded: whether this one
    probes it."""
    if not prefill_available:
        return Decision(False, "no_prefill")
    if prompt_tokens is not None and prompt_tokens < view.short_prompt_tokens:
        return Decision(False, "short_prompt")
    if view.degraded:
        if probe():
            return Decision(True, "probe")
        return Decision(False, "degraded", anywhere=True)
    if view.local_when_decode_idle and queues.decode_active == 0:
        return Decision(False, "decode_idle")
    if view.learning:
        return Decision(False, "handoff_unknown", anywhere=True)
    tokens = prompt_tokens or 0
    ttft_budget = view.ttft_budget
    candidates: list[str | None] = [*prefill_replicas] or [None]

    def only(usable: list[str | None]) -> tuple[str, ...]:
        """The replicas P/D is restricted to: none (any) when all are usable."""
        if len(usable) == len(candidates):
            return ()
        return tuple(r for r in usable if r is not None)

    slow = {r: slow_path(view, tokens, r) for r in candidates}
    usable = [r for r in candidates if slow[r] is None]
    if not usable:
        # Every replica's path is too slow: say why for the one that is least so.
        best = min(candidates, key=lambda r: view.predicted_handoff(tokens, r) or 0.0)
        return Decision(False, slow[best] or "", anywhere=True)
    speed = view.prefill_seconds_per_token
    if ttft_budget is not None and speed is not None:
        this_prefill = speed * tokens
        target = view.pd_ttft_share * ttft_budget
        if this_prefill <= target:
            # Local prefill would fit: P/D must be predicted to fit too, through a replica
            # whose queue leaves room. The wait ahead is the larger of two guesses: the
            # requests ahead taken as long as this one, and the prompt tokens known to be
            # waiting there at the measured speed.
            def predicted_ttft(replica: str | None) -> float:
                ahead = queues.prefill_ahead or 0.0
                backlog = 0.0
                if replica is not None:
                    ahead = queues.prefill_ahead_by.get(replica, ahead)
                    backlog = queues.prefill_backlog_by.get(replica, 0.0)
                wait = max(ahead * this_prefill, backlog * speed)
                handoff = view.predicted_handoff(tokens, replica) or 0.0
                return wait + this_prefill + handoff

            fitting = [r for r in usable if predicted_ttft(r) <= target]
            if not fitting and local_breaks_itl(view, this_prefill, queues):
                return Decision(True, "local_would_break_itl", prefill=only(usable))
            if not fitting:
                # Congestion, not the path: spill to decode, not onto the busy prefill pool.
                return Decision(False, "prefill_queue_over_ttft_budget")
            usable = fitting
    return Decision(True, "long_prompt", prefill=only(usable))


class AutoPolicy:
    def __init__(
        self, settings: PolicySettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or PolicySettings()
        self.health = HandoffHealth(self.settings, clock)
        self.output_tokens: float | None = None
        """EWMA of streamed answers' lengths: how many tokens a local prefill's stall is
        spread over for the streams it delays."""

    def observe_output(self, tokens: int) -> None:
        if tokens > 0:
            self.output_tokens = ewma(self.output_tokens, float(tokens), self.settings.ewma_alpha)

    def view(self, ttft_budget: float | None, itl_budget: float | None) -> AutoView:
        """What a decision reads now (what the data plane is pushed)."""
        health, settings = self.health, self.settings
        fresh = {r: e for r in health.by_prefill if (e := health.replica_estimate(r)) is not None}
        return AutoView(
            short_prompt_tokens=settings.short_prompt_tokens,
            local_when_decode_idle=settings.local_when_decode_idle,
            pd_ttft_share=settings.pd_ttft_share,
            itl_share=settings.itl_share,
            ttft_budget=ttft_budget,
            itl_budget=itl_budget,
            degraded=health.degraded,
            learning=health.learning(ttft_budget),
            seconds_per_token=health.seconds_per_token,
            by_prefill=fresh,
            prefill_seconds_per_token=health.prefill_seconds_per_token,
            output_tokens=self.output_tokens,
        )

    def probe(self) -> bool:
        """While degraded, every probe_every-th request eligible for P/D tries it."""
        self.health.eligible_while_degraded += 1
        return self.health.eligible_while_degraded % self.settings.probe_every == 0

    def decide(
        self,
        *,
        prompt_tokens: int | None,
        prefill_available: bool,
        ttft_budget: float | None,
        queues: QueueState | None = None,
        prefill_replicas: Sequence[str] = (),
        itl_budget: float | None = None,
    ) -> Decision:
        view = self.view(ttft_budget, itl_budget)
        decision = decide_with(
            view,
            prompt_tokens=prompt_tokens,
            prefill_available=prefill_available,
            queues=queues or QueueState(),
            prefill_replicas=prefill_replicas,
            probe=self.probe,
        )
        if view.learning is False and decision.disaggregated:
            self.health.start_learning()
        return decision
