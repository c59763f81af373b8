"""What the scenarios run: the deployments (engines, KV path, routing mode, a render pool or not,
fair queueing), started as processes behind the benchmark gateway, and the workloads."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pdserve.bench.summary import Slo
from pdserve.bench.workload import Workload, collision_mix, fixed
from pdserve.gateway.dataplane import build_binary
from pdserve.sim.experiment import ENGINE_MODEL
from pdserve.sim.procs import Processes, free_port, sim_engine_argv, sim_render_argv

MODEL = "bench"
SIMGATEWAY = [sys.executable, "-m", "pdserve.bench.simgateway"]
ARTICLE_SLO = Slo(ttft_ms=2000, tpot_ms=30)
ARTICLE_RATES = (0.2, 0.4, 0.7, 1.0, 1.5, 2.0)
KV_BYTES_PER_TOKEN = 56 * 1024  # Qwen2.5-7B bf16 (the simulator's default)
Mode = Literal["Aggregated", "Disaggregated", "Auto"]


@dataclass(frozen=True)
class KvPath:
    name: str
    bandwidth_gb_s: float
    overhead_ms: float

    def transfer_ms(self, tokens: int) -> float:
        return tokens * KV_BYTES_PER_TOKEN / (self.bandwidth_gb_s * 1e9) * 1000 + self.overhead_ms


SLOW_KV = KvPath("slow", 0.4, 100.0)  # the article's PCIe path without P2P: ~1.3 s for 8k tokens
FAST_KV = KvPath("fast", 50.0, 10.0)  # RDMA / NVLink class (400 Gb/s): ~20 ms for 8k tokens


@dataclass(frozen=True)
class Deployment:
    label: str
    mode: Mode
    prefill: int = 0
    decode: int = 2
    kv: KvPath = SLOW_KV
    max_num_batched_tokens: int = 2048
    chunked: bool = True
    fair_queue: bool = True
    render: bool = False
    """A render pool in front (tokens API): the gateway knows every prompt's exact token
    count; without, engines speak OpenAI and the gateway estimates it from characters."""
    reversed_engines: bool = False
    """List the engines to the gateway in the other order: ties between equally loaded
    engines break the other way (an equally good deployment, for the noise of comparisons)."""
    data_plane: bool = False
    """The gateway behind its compiled data plane (which decides Auto itself). It keeps no
    request log (the data plane would hand every request to the Python gateway to log it), so
    such points have no per-request engines or Auto reasons."""

    def engine_flags(self, time_scale: float) -> list[str]:
        flags = [
            "--no-enable-prefix-caching",  # as the article: cached prefixes would hide prefill
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--sim-time-scale",
            str(time_scale),
            "--sim-kv-bandwidth-gb-s",
            str(self.kv.bandwidth_gb_s),
            "--sim-kv-overhead-ms",
            str(self.kv.overhead_ms),
        ]
        if not self.chunked:
            flags.append("--no-enable-chunked-prefill")
        return flags

    def start(self, procs: Processes, time_scale: float, request_log: Path | None = None) -> str:
        """Engines (and a render server) and a gateway over them (logging each request's
        engines and Auto reason to `request_log`); the gateway's URL."""
        roles = ["prefill"] * self.prefill + ["decode" if self.prefill else "both"] * self.decode
        engines = []
        for role in roles:
            port = free_port()
            argv = sim_engine_argv(
                ENGINE_MODEL,
                port,
                role=role,
                tokens_only=self.render,
                served_model_name=MODEL,
                extra=self.engine_flags(time_scale),
            )
            engines.append((role, procs.spawn(argv, port)))
        renders = []
        if self.render:
            port = free_port()
            renders.append(
                procs.spawn(sim_render_argv(ENGINE_MODEL, port, served_model_name=MODEL), port)
            )
        procs.wait_ready(*(proc for _, proc in engines), *renders)
        pool = {"service": "sim", "port": 8000}
        ordered = engines[::-1] if self.reversed_engines else engines
        config = {
            "model": MODEL,
            "engineApi": "tokens" if self.render else "openai",
            # The gateway's clock is real: its budgets are scaled like the engines' time.
            "routing": {
                "mode": self.mode,
                "slo": {"ttftMs": 2000 * time_scale, "itlMs": 30 * time_scale},
            },
            "pools": {
                "render": pool if self.render else None,
                "prefill": pool if self.prefill else None,
                "decode": pool,
            },
            "endpoints": {
                "render": [{"url": r.url} for r in renders],
                "prefill": [{"url": p.url} for role, p in ordered if role == "prefill"],
                "decode": [{"url": p.url} for role, p in ordered if role != "prefill"],
            },
        }
        extra = ["--time-scale", str(time_scale)]
        if not self.fair_queue:
            extra.append("--no-fair-queue")
        if self.data_plane:
            extra += ["--data-plane", str(build_binary())]
        if request_log is not None:  # behind the data plane, the data plane writes it
            extra += ["--request-log", str(request_log)]
        return procs.gateway(config, *extra, module=SIMGATEWAY).url


AGGREGATED = Deployment("Aggregated DP=2", "Aggregated", decode=2)
PD_SLOW = Deployment("Disaggregated 1P1D, slow KV", "Disaggregated", 1, 1, SLOW_KV)
PD_FAST = Deployment("Disaggregated 1P1D, fast KV", "Disaggregated", 1, 1, FAST_KV)
AGGREGATED_AGAIN = replace(
    AGGREGATED, label="Aggregated DP=2, engines in the other order", reversed_engines=True
)
AUTO_SLOW = Deployment("Auto 1P1D, slow KV", "Auto", 1, 1, SLOW_KV)
AUTO_FAST = Deployment("Auto 1P1D, fast KV", "Auto", 1, 1, FAST_KV)


def article_workload() -> Workload:
    return fixed(8000, 256)


def mix_workload() -> Workload:
    return collision_mix()


CHUNK_BUDGETS = (512, 1024, 2048, 4096, 8192)
UNCHUNKED = 32768
MIX_RATES_ONE_ENGINE = (2.0, 3.0)
MIX_RATE_TWO_ENGINES = 3.5


def budget_deployment(budget: int) -> Deployment:
    if budget >= UNCHUNKED:
        return Deployment(f"unchunked ({budget})", "Aggregated", decode=1,
                          max_num_batched_tokens=budget, chunked=False)  # fmt: skip
    return Deployment(f"max_num_batched_tokens {budget}", "Aggregated", decode=1,
                      max_num_batched_tokens=budget)  # fmt: skip
