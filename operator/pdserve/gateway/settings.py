"""The gateway's tunables, shared by every part of it (main.py and the benchmark fill them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pdserve.gateway.fairqueue import FairQueueSettings
from pdserve.gateway.policy import PolicySettings


@dataclass(frozen=True)
class GatewaySettings:
    max_inflight: int = 256
    max_body_bytes: int = 16 * 1024**2
    max_tokens_cap: int | None = None
    api_keys: tuple[str, ...] = ()
    # The peers' key: the replicas of one gateway (and operational readers) call the admission
    # endpoints, /metrics and /status with it (or an API key); the first one is sent.
    peer_keys: tuple[str, ...] = ()
    # Every wait is bounded (docs/gateway.md#timeouts). Opening a connection to an engine or
    # render server: a reachable one on the cluster network answers in milliseconds.
    connect_timeout: float = 5.0
    # An upstream call's first response byte, and a stream's first event: a long prompt's
    # prefill (or a local prefill on decode behind a queue) takes tens of seconds on vLLM.
    first_byte_timeout: float = 120.0
    # Between two events of a decode stream: one decode step is milliseconds, so a minute
    # of silence is a hung or preempted-forever engine, not a slow one.
    idle_timeout: float = 60.0
    # Receiving the client's request body (before it takes an in-flight slot): 408 after.
    body_timeout: float = 30.0
    # A client's connection idle between requests (or since it opened), and its next request's
    # head still incomplete, is closed after this: an idle connection costs a file descriptor
    # and a buffer, and slow headers held one open forever. Above what load balancers keep
    # connections to a backend open for (AWS ALB and GCP's 60 s idle, nginx's 60 s), so they
    # close first and never send to one this side is closing.
    keepalive_timeout: float = 75.0
    # The whole request, from its first byte to its last (a non-streamed decode, whose first
    # byte is the whole answer, is bounded by this alone): 504, or an error event in a stream.
    request_timeout: float = 600.0
    # How long a request waits for a complete, parity-consistent set of endpoints (a pool's
    # only replica being replaced) before 503; 0: fail at once.
    endpoint_wait_seconds: float = 30.0
    render_timeout: float = 30.0  # one render or derender call (CPU only, no queue)
    # vLLM closes idle connections after ~5 s: reuse only younger ones, or requests reset.
    keepalive_expiry: float = 4.0
    lease_margin_seconds: float = 1.0
    # Bidirectional KV: the share of each decode engine's KV blocks that finished P/D requests
    # may hold for the next turn (gateway/held_kv.py), split among the gateway replicas; past
    # it a request prefills locally on decode, which holds nothing. The rest stays free for
    # running requests, so holds never stall decode's admission.
    held_kv_fraction: float = 0.5
    # Merge tokens that arrive during a derender call into the next one. False: one derender
    # call per engine event (what a naive proxy does; kept for the benchmark's comparison).
    derender_pipelining: bool = True
    policy: PolicySettings = dataclasses.field(default_factory=PolicySettings)
    fair_queue: FairQueueSettings = dataclasses.field(default_factory=FairQueueSettings)
    # Engines' own queue and KV metrics feed endpoint picking; None: in-flight counts only.
    load_scrape_seconds: float | None = 0.5
    # Engines' recent time between tokens is averaged over windows this long (Auto's ITL rule).
    step_window_seconds: float = 2.0
    # Engine-reported durations (KV transfer times) x this = seconds on the gateway's clock:
    # 1 for real engines; the benchmark's time-scaled simulators report simulated seconds.
    engine_seconds_scale: float = 1.0
    request_log: Path | None = None  # JSON Lines, one entry per finished request

    def kv_start_within(self, lease_seconds: float) -> float:
        """How long after prefill answered a decode may still be sent its KV: prefill holds it
        for `lease_seconds` (the routing config's lease), less the margin for the way there
        (once decode has the request, its heartbeats keep the lease alive)."""
        return lease_seconds - self.lease_margin_seconds
