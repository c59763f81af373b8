"""Which replicas a request's hops prefer: where its prefix is probably cached, where its
conversation ran, and for decode the replicas that can pull prefill's KV."""

from __future__ import annotations

from pdserve.gateway.affinity import Conversations, PrefixIndex, block_hashes, scores
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.exchange import Exchange


class Placement:
    def __init__(
        self, block_size: int, prefixes: PrefixIndex, conversations: Conversations
    ) -> None:
        self.block_size, self.prefixes, self.conversations = block_size, prefixes, conversations

    def affinity(
        self, exchange: Exchange, stage: str, token_ids: list[int] | None
    ) -> dict[str, int]:
        """Where this request's prefix is probably cached, and where its conversation ran, by
        Endpoint.key: a data-parallel rank's prefix cache is its own."""
        cached: dict[str, int] = {}
        if token_ids:
            hashes = self.hashes(exchange, token_ids)
            for endpoint in exchange.selection.pools.get(stage, []):
                cached[endpoint.key] = self.prefixes.cached_blocks(endpoint.key, hashes)
        conversation = exchange.conversation
        last = self.conversations.endpoint(conversation, stage) if conversation else None
        return scores(cached, last)

    def remember(
        self, exchange: Exchange, stage: str, endpoint: Endpoint, token_ids: list[int] | None
    ) -> None:
        exchange.served_by[stage] = endpoint.target
        if token_ids:
            self.prefixes.record(endpoint.key, self.hashes(exchange, token_ids))
        if conversation := exchange.conversation:
            self.conversations.remember(conversation, stage, endpoint.key)

    def hashes(self, exchange: Exchange, token_ids: list[int]) -> list[bytes]:
        """The prompt's block hashes, computed once per request: every hop asks for them."""
        cached = exchange.block_hashes
        if cached is not None and cached[0] is token_ids:
            return cached[1]
        hashes = block_hashes(token_ids, self.block_size)
        exchange.block_hashes = (token_ids, hashes)
        return hashes

    @staticmethod
    def decode_candidates(
        exchange: Exchange, *, with_kv: bool, local_on_prefill_pool: bool
    ) -> list[Endpoint]:
        """Decode replicas for this request: with prefill's KV to pull, only those that can
        (its KV-compatibility digest; the planner kept only prefill replicas that have one),
        and those in the prefill replica's slice first (same topology domain, the verified
        path). A request Auto mode
        prefills locally may also run whole on a prefill replica (engines serve a request
        without kv_transfer_params end to end)."""
        pool = exchange.selection.pools["decode"]
        if with_kv:
            prefill = exchange.prefilled_on
            return Endpoints.same_slice(Endpoints.kv_compatible(pool, prefill), prefill)
        if exchange.local_anywhere and local_on_prefill_pool:
            return pool + exchange.selection.pools.get("prefill", [])
        return pool
