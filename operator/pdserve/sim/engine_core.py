"""A continuous-batching scheduler with vLLM's knobs and a step-time model.

Each step gives every running decode one token and fills the rest of the token budget
(max_num_batched_tokens) with prefill chunks (chunked prefill, long_prefill_token_threshold),
admitting waiting requests while fewer than max_num_seqs run. A step lasts
base + per-prefill-token x prefill tokens + per-sequence x decodes, so a long prefill visibly
stalls the decodes batched with it; each decode also pays for reading its context's KV.
Defaults are calibrated to the article's setup (Qwen2.5-7B,
L40S, 2048-token budget): ~21 ms decode steps, ~0.65 s for an 8k-token prefill.
`time_scale` < 1 runs faster than real time; every duration (steps, transfers, leases) scales."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

Clock = Callable[[], float]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    num_gpu_blocks: int = 20000
    enable_prefix_caching: bool = True
    step_base_ms: float = 20.0
    per_prefill_token_ms: float = 0.07
    per_decode_seq_ms: float = 0.1
    # Each decode reads its whole KV every step: ~56 KiB/token of Qwen2.5-7B at ~1 TB/s.
    per_decode_context_token_us: float = 0.05
    time_scale: float = 1.0


class State(Enum):
    waiting = "waiting"
    running = "running"
    finished = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # the whole planned output, already cut to max_tokens
    finish_reason: str  # stop or length, once the planned output is emitted
    arrival: float
    computed: int = 0  # prompt tokens whose KV exists
    emitted: int = 0
    state: State = State.waiting
    queue: asyncio.Queue[tuple[int | None, str | None]] = field(default_factory=asyncio.Queue)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    sim_times: list[float] = field(default_factory=list)  # simulated time of each token
    parent_id: str | None = None
    """With n > 1: the request's id (each choice's sequence adds its index to it)."""

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt_ids)


@dataclass
class StepRecord:
    prefill_tokens: int
    decodes: int
    seconds: float


def block_hashes(ids: list[int], block_size: int) -> list[str]:
    """Chained hashes of the full blocks of a token sequence (vLLM's prefix-cache keys)."""
    hashes, parent = [], ""
    for start in range(0, len(ids) - len(ids) % block_size, block_size):
        parent = hashlib.sha256(f"{parent}:{ids[start : start + block_size]}".encode()).hexdigest()
        hashes.append(parent)
    return hashes


class EngineCore:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        clock: Clock = time.monotonic,
        on_token: Callable[[Sequence, float], None] | None = None,
        on_finish: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.prefix_cache: set[str] = set()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.held_blocks = 0  # prefill-side blocks kept for remote decode
        self.steps: list[StepRecord] = []
        # Simulated time: steps run back to back while busy, whatever the event loop's lag, and
        # re-anchor to the (scaled) real clock after idling. Token times come from it.
        self.virtual_end = 0.0
        self._wake = asyncio.Event()
        self._on_token = on_token
        self._on_finish = on_finish

    # ---- intake --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Abort one sequence, or by the request's id every choice of it, as vLLM aborts a
        parent request; False when none is waiting or running."""
        found = False
        for pool in (self.waiting, self.running):
            for seq in list(pool):
                if request_id in (seq.request_id, seq.parent_id):
                    pool.remove(seq)
                    seq.state = State.finished
                    seq.queue.put_nowait((None, "abort"))
                    found = True
        return found

    # ---- accounting ----------------------------------------------------------------------------
    def blocks_in_use(self) -> int:
        size = self.config.block_size
        live = sum(-(-(s.computed + s.emitted) // size) for s in self.running)
        return live + self.held_blocks

    def kv_usage(self) -> float:
        return min(1.0, self.blocks_in_use() / self.config.num_gpu_blocks)

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.step()

    def _admit(self, seq: Sequence) -> None:
        seq.state = State.running
        seq.admitted_at = self.clock()
        if self.config.enable_prefix_caching and not seq.prefilled:
            hashes = block_hashes(seq.prompt_ids, self.config.block_size)
            hit = 0
            for digest in hashes:
                if digest not in self.prefix_cache:
                    break
                hit += 1
            # At least the last prompt token is always computed (it yields the first output).
            cached = min(hit * self.config.block_size, len(seq.prompt_ids) - 1)
            self.prefix_queries += len(seq.prompt_ids)
            self.prefix_hits += cached
            seq.cached_tokens = cached
            seq.computed = max(seq.computed, cached)
        self.running.append(seq)

    async def step(self) -> None:
        config = self.config
        was_busy = bool(self.running)
        budget = config.max_num_batched_tokens
        decodes = [s for s in self.running if s.prefilled]
        budget -= len(decodes)
        chunks: list[tuple[Sequence, int]] = []
        candidates = [s for s in self.running if not s.prefilled]
        while self.waiting and len(self.running) < config.max_num_seqs:
            seq = self.waiting.pop(0)
            self._admit(seq)
            if seq.prefilled:
                decodes.append(seq)  # KV arrived from a prefill engine: straight to decode
                budget -= 1
            else:
                candidates.append(seq)
        for seq in candidates:
            if budget <= 0:
                break
            remaining = len(seq.prompt_ids) - seq.computed
            chunk = min(remaining, budget)
            if config.long_prefill_token_threshold > 0:
                chunk = min(chunk, config.long_prefill_token_threshold)
            if not config.enable_chunked_prefill and chunk < remaining:
                break  # without chunking a prompt runs whole or waits
            chunks.append((seq, chunk))
            budget -= chunk
        prefill_tokens = sum(c for _, c in chunks)
        context = sum(len(s.prompt_ids) + s.emitted for s in decodes)
        seconds = (
            config.step_base_ms
            + config.per_prefill_token_ms * prefill_tokens
            + config.per_decode_seq_ms * len(decodes)
            + config.per_decode_context_token_us * context / 1000
        ) / 1000
        self.steps.append(StepRecord(prefill_tokens, len(decodes), seconds))
        scale = config.time_scale
        # Busy: this step follows the previous one directly. Idle before it: catch up with the
        # scaled real clock. (Re-anchoring while busy would turn the event loop's own lag into
        # simulated inter-token gaps.)
        start = self.virtual_end
        if scale > 0 and not was_busy:
            start = max(start, self.clock() / scale)
        self.virtual_end = start + seconds
        await asyncio.sleep(max(0.0, self.virtual_end * scale - self.clock()) if scale > 0 else 0)
        now = self.clock()
        for seq in decodes:
            if seq.state is State.running:
                self._emit(seq, now)
        for seq, chunk in chunks:
            if seq.state is not State.running:
                continue
            seq.computed += chunk
            if seq.prefilled:
                if config.enable_prefix_caching:
                    self.prefix_cache.update(block_hashes(seq.prompt_ids, config.block_size))
                self._emit(seq, now)  # the step that finishes a prefill samples a token

    def _emit(self, seq: Sequence, now: float) -> None:
        token = seq.output_ids[seq.emitted]
        seq.emitted += 1
        seq.sim_times.append(self.virtual_end)
        if seq.first_token_at is None:
            seq.first_token_at = now
        if self._on_token is not None:
            self._on_token(seq, now)
        seq.last_token_at = now
        done = seq.emitted >= len(seq.output_ids)
        seq.queue.put_nowait((token, seq.finish_reason if done else None))
        if done:
            seq.state = State.finished
            self.running.remove(seq)
            if self._on_finish is not None:
                self._on_finish(seq)
