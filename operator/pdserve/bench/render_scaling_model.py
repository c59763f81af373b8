"""What render_scaling replays: the calibrated cost of a derender call, the load plan over time,
and the replicas, streams and per-window results of one policy's run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cost:
    """Seconds of render-server handler time for one streamed derender call at history n."""

    base: float
    per_token: float

    def __call__(self, tokens: int) -> float:
        return self.base + self.per_token * tokens

    def stream(self, length: int) -> float:
        """Handler seconds of one stream derendered a token per call."""
        return length * self.base + self.per_token * length * (length + 1) / 2


@dataclass(frozen=True)
class Scenario:
    """Streams per second and reasoning tokens per stream over time. ramp: a warm-up, a ramp of
    both over 6 minutes, a plateau, then a drop. step: the same warm-up, then at once many
    long-reasoning streams, then a drop."""

    plan: str = "ramp"
    minutes: float = 20.0
    itl: float = 0.02  # decode's inter-token latency: tokens of a stream arrive this often
    startup: float = 15.0  # a new render pod takes this long to serve (tokenizer load)
    interval: float = 15.0  # metrics window and decision period
    # Derender call latency the pool should hold: one inter-token interval. A slower derender
    # makes a stream's tokens pile up and reach the client in bursts.
    target_p99: float = 0.02
    min_replicas: int = 2
    max_replicas: int = 24

    def shape(self, t: float) -> tuple[float, int]:
        """(streams per second, tokens per stream) at time t, on a 20-minute plan scaled to
        `minutes`."""
        m = t / 60 * 20 / self.minutes
        if m < 2:
            return 0.2, 1000
        if self.plan == "step":
            return (0.8, 6000) if m < 10 else (0.1, 2000)
        if m < 8:
            f = (m - 2) / 6
            return 0.2 + 0.4 * f, int(1000 + 7000 * f)
        if m < 12:
            return 0.6, 8000
        return 0.1, 2000


@dataclass
class Replica:
    index: int
    ready_at: float
    free_at: float = 0.0
    inflight: int = 0
    draining: bool = False
    cpu: float = 0.0  # handler seconds finished in the window (the server's own view)
    waited: float = 0.0  # call seconds finished in the window (the gateway's view)


@dataclass
class Stream:
    start: float
    length: int
    sent: int = 0


@dataclass
class Window:
    t: float
    replicas: int
    desired: int
    demand: float  # cores the live streams would need with a derender call per token
    p99: float | None
    token_p99: float | None
    calls: int


@dataclass
class Run:
    policy: str
    windows: list[Window] = field(default_factory=list)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds)
    token_delays: list[float] = field(default_factory=list)
    replica_seconds: float = 0.0
    decisions: int = 0


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
