"""What decode engines hold of finished P/D requests under bidirectional KV, and the budget that
keeps those holds from stalling them.

With `bidirectional_kv_xfer`, a decode engine (vLLM's NIXL pull connector, `request_finished`)
keeps the blocks of EVERY P/D request that ends stopped or length-capped for
`decoder_kv_blocks_ttl` seconds, so that a next turn's prefill may read them back: streamed
turns (whose answers carry no kv_transfer_params, so nothing can ever read them), turns of
conversations that never come back, all of them. Only that read (or a prefill's full local
prefix hit, which notifies all the same) frees them early; nothing frees them under cache
pressure. Measured on vLLM 0.32: enough long answers fill decode's cache with holds, and
nothing is admitted until they expire (docs/operations.md#held-kv).

A decode request sent WITHOUT kv_transfer_params (prefilled locally on decode) holds nothing.
So the gateway keeps its own reckoning of every hold it caused, per decode replica (blocks of
prompt + answer, from when the answer came, for the TTL), plus the P/D requests still in flight
(reserved at their prompt + max_tokens), and sends a request P/D only to decode replicas where
its hold fits the budget: `fraction` of the replica's KV blocks (vllm:cache_config_info), shared
evenly among the gateway replicas. Past the budget the request prefills locally on decode
(counted as fallback reason `decode_kv_held`): it is served at once, and the holds never fill
more than the budget of a cache, so they never stall admission. A hold a next turn read back
(bidirectional reuse) is freed on the engine and in the reckoning.

The reckoning errs on holding more than the engine does (prefix-shared blocks are counted per
request, an answer's hold is dated from its arrival here, a failed KV pull that fell back to
local prefill may be counted): that only sends fewer requests P/D. A replica whose capacity is
not scraped yet takes P/D as before."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.exchange import Exchange

FALLBACK_REASON = "decode_kv_held"
MAX_HOLDS = 200_000
"""Holds remembered per decode replica (the oldest forgotten first)."""
HELD_FINISH_REASONS = ("stop", "length")
"""Finish reasons after which decode holds a P/D request's blocks (vLLM's
FINISHED_STOPPED, FINISHED_LENGTH_CAPPED); an aborted or failed one frees them at once."""


@dataclass(frozen=True)
class Hold:
    blocks: int
    expires_at: float


class DecodeHolds:
    def __init__(
        self,
        *,
        ttl: float,
        block_size: int,
        fraction: float,
        clock: Callable[[], float] = time.monotonic,
        max_holds: int = MAX_HOLDS,
    ) -> None:
        self.ttl, self.block_size, self.fraction = ttl, block_size, fraction
        self.clock = clock
        self.max_holds = max_holds
        self.holds: dict[str, OrderedDict[str, Hold]] = {}
        """Per decode URL, per request id: what the engine holds (oldest first)."""
        self.inflight: dict[str, int] = {}
        """Per P/D request still decoding: the blocks it may hold when it finishes."""
        self.elsewhere: dict[str, int] = {}
        """Per decode URL: the blocks held there for requests the data plane served (its
        `GET /stats`), counted in this gateway's budget as its own are."""

    # ---- the arithmetic ------------------------------------------------------------------------
    def blocks(self, tokens: int, endpoint: Endpoint | None = None) -> int:
        """KV blocks `tokens` take on the engine (its own block size once scraped)."""
        size = endpoint.kv_block_size if endpoint and endpoint.kv_block_size else self.block_size
        return max(1, math.ceil(tokens / size)) if tokens > 0 else 0

    def held(self, url: str) -> int:
        """Blocks decode replica `url` holds now for finished requests of this gateway."""
        holds = self.holds.get(url)
        if not holds:
            return 0
        now = self.clock()
        # Held oldest first with one TTL: the expired ones lead.
        while holds and next(iter(holds.values())).expires_at <= now:
            holds.popitem(last=False)
        return sum(hold.blocks for hold in holds.values())

    def total_held(self, url: str) -> int:
        """Blocks decode replica `url` holds now for this gateway's finished requests, whichever
        process of it served them."""
        return self.held(url) + self.elsewhere.get(url, 0)

    def pending(self) -> int:
        return sum(self.inflight.values())

    def budget(self, endpoint: Endpoint, replicas: int) -> int | None:
        """Blocks this gateway's holds may take on `endpoint`; None: capacity not known yet."""
        if not endpoint.kv_blocks:
            return None
        return int(self.fraction * endpoint.kv_blocks / max(1, replicas))

    # ---- the decision --------------------------------------------------------------------------
    def room(self, decode: Sequence[Endpoint], tokens: int, replicas: int) -> list[Endpoint]:
        """The decode replicas a P/D request that may hold `tokens` (prompt + max_tokens) fits
        on: where its hold, this gateway's holds and its P/D requests still decoding (those
        counted against every candidate: where each lands is the picker's choice) stay within
        the budget. Replicas of unknown capacity always fit."""
        pending = self.pending()
        fits = []
        for endpoint in decode:
            budget = self.budget(endpoint, replicas)
            need = self.blocks(tokens, endpoint)
            if budget is None or self.total_held(endpoint.url) + pending + need <= budget:
                fits.append(endpoint)
        return fits

    def admit(self, exchange: Exchange, tokens: int, replicas: int) -> bool:
        """Whether the request may go P/D (its decode replicas narrowed to those with room, its
        hold reserved until `settle`); False: it must prefill locally on decode."""
        decode = exchange.selection.pools.get("decode", [])
        fits = self.room(decode, tokens, replicas)
        if not fits:
            return False
        exchange.selection.pools["decode"] = fits
        self.reserve(exchange.request_id, max(self.blocks(tokens, e) for e in fits))
        return True

    def settle(self, exchange: Exchange) -> None:
        """The request admitted P/D is over: what its decode holds now, if anything."""
        held = exchange.decode_pulled_kv and exchange.decoded_on is not None
        self.finished(
            exchange.request_id,
            exchange.decoded_on if held else None,
            exchange.held_tokens if held else (),
        )

    # ---- the lifecycle of one P/D request ------------------------------------------------------
    def reserve(self, request_id: str, blocks: int) -> None:
        self.inflight[request_id] = blocks

    def finished(self, request_id: str, endpoint: Endpoint | None, tokens: Iterable[int]) -> None:
        """A P/D request's decode ended: with `endpoint` and the tokens (prompt + answer) of each
        choice that finished stopped or length-capped, decode now holds them for the TTL;
        without (aborted, failed, served by local prefill), nothing."""
        self.inflight.pop(request_id, None)
        if endpoint is None:
            return
        blocks = sum(self.blocks(count, endpoint) for count in tokens)
        if not blocks:
            return
        holds = self.holds.setdefault(endpoint.url, OrderedDict())
        holds[request_id] = Hold(blocks, self.clock() + self.ttl)
        holds.move_to_end(request_id)
        while len(holds) > self.max_holds:
            holds.popitem(last=False)

    def released(self, url: str | None, request_id: str | None) -> None:
        """A next turn's prefill read the hold back: the engine freed it."""
        if url is not None and request_id is not None and (holds := self.holds.get(url)):
            holds.pop(request_id, None)

    def forget(self, urls: Iterable[str]) -> None:
        """Only these decode replicas remain: the others' holds went with them."""
        keep = set(urls)
        for url in [u for u in self.holds if u not in keep]:
            del self.holds[url]
