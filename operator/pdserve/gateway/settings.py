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
    connect_timeout: float = 2.0
    # How long a request waits for a complete, parity-consistent set of endpoints (a pool's
    # only replica being replaced) before 503; 0: fail at once.
    endpoint_wait_seconds: float = 30.0
    render_timeout: float = 30.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    # vLLM closes idle connections after ~5 s: reuse only younger ones, or requests reset.
    keepalive_expiry: float = 4.0
    lease_margin_seconds: float = 1.0
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
