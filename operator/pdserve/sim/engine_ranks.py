"""A simulated engine's data-parallel ranks behind its one HTTP server, and which of them serves
a request, as vLLM 0.32's API server decides it:

- the `X-data-parallel-rank: <int>` header names one by its index among this server's ranks
  (`[0, L)`); a value that is not an integer is ignored, as vLLM's `_get_data_parallel_rank`
  ignores it (vllm/entrypoints/generate/base/serving.py L220-232), and one out of range is a
  400 with vLLM's message (vllm/v1/engine/input_processor.py L392-400);
- without it, vLLM's in-process balancer picks the least loaded rank
  (`DPLBAsyncMPClient.get_core_engine_for_request`, vllm/v1/engine/core_client.py L1642-1697).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from pdserve.sim.engine_rank import EngineRank
from pdserve.sim.http import HttpError

DP_RANK_HEADER = "X-data-parallel-rank"


def header_rank(value: str | None) -> int | None:
    """The header's rank, None where vLLM takes none (absent or not an integer: Python's int(),
    which vLLM calls, also takes surrounding spaces, a sign and digit underscores)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class EngineRanks:
    def __init__(self, ranks: list[EngineRank]) -> None:
        if not ranks:
            raise ValueError("an engine server runs at least one rank")
        self.ranks = ranks
        self._scan_start = 0

    def __iter__(self) -> Iterator[EngineRank]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, index: int) -> EngineRank:
        return self.ranks[index]

    def for_request(self, headers: Mapping[str, str]) -> EngineRank:
        """The rank that serves a request with these headers; HttpError 400 for a rank out of
        range (vLLM's VLLMValidationError: BadRequestError, no param)."""
        index = header_rank(headers.get(DP_RANK_HEADER))
        if index is None:
            return self.least_loaded()
        if not 0 <= index < len(self.ranks):
            raise HttpError(
                400, f"data_parallel_rank {index} is out of range [0, {len(self.ranks)})."
            )
        return self.ranks[index]

    def least_loaded(self) -> EngineRank:
        """vLLM's score with one API server (client_count 1): max(in flight, waiting +
        running), plus, where requests wait, waiting x 6 x (KV usage - 0.5) above half-full KV;
        the lowest score wins, scanning from a start that moves on one rank per pick so that
        ties rotate. Simplified: vLLM reads waiting/running/KV usage from the DP coordinator's
        snapshot (every 100 ms) and bumps the chosen rank's waiting count until the next one;
        the simulator reads each rank's scheduler as it is now, so it needs no bump."""
        best, best_score = 0, float("inf")
        count = len(self.ranks)
        for step in range(count):
            index = (self._scan_start + step) % count
            rank = self.ranks[index]
            waiting, running = len(rank.core.waiting), len(rank.core.running)
            score = float(max(rank.inflight, waiting + running))
            if waiting:
                score += waiting * 6.0 * max(0.0, rank.core.kv_usage() - 0.5)
            if score < best_score:
                best, best_score = index, score
        self._scan_start = (self._scan_start + 1) % count
        return self.ranks[best]

    def by_engine_id(self, engine_id: object) -> EngineRank | None:
        """The rank whose KV engine id a peer's pull names."""
        return next((rank for rank in self.ranks if rank.engine_id == engine_id), None)
