"""What a simulated engine is configured with, the faults it can be told to inject, and its
clock: real seconds against the simulated seconds a real engine would report."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig


@dataclass
class TransferConfig:
    bytes_per_token: int = 56 * 1024  # Qwen2.5-7B bf16: 2 x 28 layers x 4 KV heads x 128 x 2 B
    bandwidth_gb_s: float = 0.4  # with the overhead: ~1.3 s for 8k tokens, as the article measured
    overhead_ms: float = 100.0
    poll_ms: float = 5.0  # the consumer notices finished transfers on its next poll
    lease_seconds: float = 30.0
    load_failure_policy: str = "fail"
    bidirectional: bool = False  # bidirectional_kv_xfer: decode's KV flows back for next turns
    decoder_kv_ttl_seconds: float = 480.0  # decoder_kv_blocks_ttl


@dataclass
class EngineConfig:
    model: str = "sim-model"
    served_model_name: str | None = None
    adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapters (--lora-modules), name -> path: requests name them in `model`."""
    role: str = "both"  # prefill | decode | both
    api: str = "tokens"
    """tokens (`--tokens-only`: the generate API, no tokenizer), scale_out (`--enable-scale-out`:
    the generate API and the OpenAI routes, with a tokenizer) or openai (plain `vllm serve`)."""
    max_model_len: int = 32768
    advertise_host: str = "127.0.0.1"
    port: int = 8000
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """kv_transfer_config.engine_id; each DP rank's KV connector suffixes it (kv_engine_id)."""
    data_parallel_size: int = 1
    """--data-parallel-size: the deployment's DP ranks, over all its nodes."""
    data_parallel_size_local: int = 1
    """The DP ranks this server runs (vLLM's data_parallel_size_local): local indices 0..L-1,
    which the X-data-parallel-rank header addresses."""
    data_parallel_start_rank: int = 0
    """The global DP rank of local index 0 (its metrics label and KV engine id use it)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    behaviour: ModelBehaviour = field(default_factory=ModelBehaviour)
    render: RenderConfig | None = None  # chat template/parsers for --api openai

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def global_ranks(self) -> range:
        """The global DP ranks this server runs, in local-index order."""
        start = self.data_parallel_start_rank
        return range(start, start + self.data_parallel_size_local)

    def kv_engine_id(self, rank: int) -> str:
        """The KV connector's engine id of global rank `rank`. Every engine process of a DP
        deployment appends `_dp<global rank>` so that sibling ranks' NIXL agents differ (vLLM
        0.32 v1/engine/core.py L1405, L1417-1422: when data_parallel_size > 1 or rank > 0)."""
        if self.data_parallel_size > 1 or rank > 0:
            return f"{self.engine_id}_dp{rank}"
        return self.engine_id

    @property
    def generate_api(self) -> bool:
        """Serves /inference/v1/generate and /inference/v1/abort_requests."""
        return self.api in ("tokens", "scale_out")

    @property
    def detokenizes(self) -> bool:
        """Loads a tokenizer: stop strings and structured outputs are served."""
        return self.api != "tokens"


@dataclass
class Faults:
    fail_transfers: int = 0
    delay_transfers: int = 0
    delay_ms: float = 0.0
    expire_leases: bool = False
    http_5xx: int = 0
    hang: int = 0
    drop_stream_after: int | None = None
    exit_after: int | None = None

    def set(self, faults: Mapping[str, Any]) -> None:
        """Apply faults by name; ValueError names unknown ones."""
        known = set(Faults.__dataclass_fields__)
        unknown = set(faults) - known
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in faults.items():
            setattr(self, key, value)


@dataclass(frozen=True)
class SimClock:
    scheduler: SchedulerConfig
    """Its time_scale: real seconds per simulated second."""

    def sim_seconds(self, real: float) -> float:
        """Real elapsed seconds -> simulated seconds (what a real engine would report)."""
        return real / self.scheduler.time_scale

    async def sleep(self, seconds: float) -> None:
        """Sleep for simulated seconds."""
        await asyncio.sleep(seconds * self.scheduler.time_scale)
