"""One data-parallel rank of a simulated engine: what one of vLLM's EngineCore processes owns.
Its own scheduler loop, prefix cache and KV block budget (EngineCore), its own KV holds and NIXL
engine id (KvTransfer), its own request intake (EngineRequests) and its own metric labels; the
server's HTTP front, tokenizer, faults and registry are shared by all its ranks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from pdserve.sim.engine_config import EngineConfig, Faults, SimClock
from pdserve.sim.engine_core import EngineCore, Sequence
from pdserve.sim.engine_metrics import EngineMetrics
from pdserve.sim.engine_requests import EngineRequests
from pdserve.sim.kv_transfer import KvTransfer
from pdserve.sim.tokenizer import SimTokenizer


class EngineRank:
    def __init__(
        self,
        index: int,
        config: EngineConfig,
        *,
        tokenizer: SimTokenizer,
        metrics: EngineMetrics,
        faults: Faults,
        client: httpx.AsyncClient,
        shutting_down: asyncio.Event,
        on_token: Callable[[], None],
    ) -> None:
        self.index = index
        """Local index: what the X-data-parallel-rank header names on this server."""
        self.rank = config.data_parallel_start_rank + index
        """Global DP rank: the `engine` metrics label, the KV engine id's suffix."""
        self.engine_id = config.kv_engine_id(self.rank)
        self.metrics = metrics.rank(self.rank, SimClock(config.scheduler).sim_seconds)
        self._on_any_token = on_token
        self.core = EngineCore(
            config.scheduler, on_token=self._on_token, on_finish=self.metrics.on_finish
        )
        self.kv = KvTransfer(config, self.core, self.metrics, faults, client, self.engine_id)
        self.requests = EngineRequests(config, tokenizer, self.core, faults, self.kv, shutting_down)
        self.inflight = 0
        """Requests the server sent here that have not ended: the balancer's exact floor on
        this rank's load (vLLM's per-engine in-flight count, v1/engine/core_client.py L1623)."""
        self._loop: asyncio.Task[None] | None = None

    def _on_token(self, seq: Sequence, now: float) -> None:
        self.metrics.on_token(seq, now)
        self._on_any_token()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """While a request is this rank's (picked until its handler ends)."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def start(self) -> None:
        self._loop = asyncio.create_task(self.core.run(), name=f"engine-loop-dp{self.rank}")

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
