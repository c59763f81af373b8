"""Where a request's KV most likely already is: an approximate per-engine index of the
block-aligned token-id prefixes it was sent, and the engines a conversation used last. An
engine is a routing target (Endpoint.key): a replica, or one data-parallel rank of it.

Token ids, not text: a reasoning template rewrites history (strips <think>), so only the token
ids say what an engine's prefix cache really holds."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_BLOCKS_PER_ENGINE = 200_000
"""Block hashes remembered per engine: about 3 M tokens at 16 a block, more than an engine's KV
cache holds, so an engine's index forgets only what its cache has evicted too."""
MAX_CONVERSATIONS = 100_000
CONVERSATION_BONUS = 1_000_000
"""A conversation's last engine outranks any prefix count: its KV of the whole conversation,
answers included, is there."""


def conversation_of(body_id: object, header: str | None) -> str | None:
    """A request's conversation: the body's conversation_id (a string or an integer) unless it
    is empty or 0, else the X-Conversation-Id header. The data plane reads it the same way
    (placement.go conversationOf; shared cases in dataplane/testdata/placement_cases.json)."""
    conversation = body_id or header
    return str(conversation) if conversation else None


def scores(cached: Mapping[str, int], conversation_engine: str | None) -> dict[str, int]:
    """Per engine (Endpoint.key), how much of a request's KV it probably holds: the leading
    blocks of its prompt it cached, and the bonus for the conversation's last engine."""
    out = {key: blocks for key, blocks in cached.items() if blocks > 0}
    if conversation_engine:
        out[conversation_engine] = out.get(conversation_engine, 0) + CONVERSATION_BONUS
    return out


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks (keyed like vLLM's prefix cache, but the gateway's own):
    one running hash over the ids as 64-bit integers, read at every block boundary."""
    full = len(token_ids) - len(token_ids) % block_size
    try:
        data = array("q", token_ids[:full]).tobytes()
    except OverflowError:  # no engine's token ids: hashed all the same, modulo 2**64
        data = array("Q", (token & 0xFFFF_FFFF_FFFF_FFFF for token in token_ids[:full])).tobytes()
    running = hashlib.blake2b(digest_size=12)
    hashes: list[bytes] = []
    step = 8 * block_size
    for start in range(0, len(data), step):
        running.update(data[start : start + step])
        hashes.append(running.copy().digest())
    return hashes


class PrefixIndex:
    """Per engine (Endpoint.key), the most recent block hashes it was sent (LRU, bounded)."""

    def __init__(self, max_blocks_per_engine: int = MAX_BLOCKS_PER_ENGINE) -> None:
        self.max_blocks = max_blocks_per_engine
        self.engines: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, key: str, hashes: Sequence[bytes]) -> None:
        blocks = self.engines.setdefault(key, OrderedDict())
        for digest in hashes:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def cached_blocks(self, key: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of this prompt the engine probably has cached."""
        blocks = self.engines.get(key)
        if not blocks:
            return 0
        count = 0
        for digest in hashes:
            if digest not in blocks:
                break
            count += 1
        return count


class Conversations:
    """conversation id -> the engine (Endpoint.key) per stage it used last (LRU, bounded)."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max = max_conversations
        self.last: OrderedDict[tuple[str, str], str] = OrderedDict()

    def remember(self, conversation: str, stage: str, engine: str) -> None:
        key = (conversation, stage)
        self.last[key] = engine
        self.last.move_to_end(key)
        while len(self.last) > self.max:
            self.last.popitem(last=False)

    def endpoint(self, conversation: str, stage: str) -> str | None:
        return self.last.get((conversation, stage))


@dataclass(frozen=True)
class HeldKv:
    """The KV a conversation's last decode turn left on its decode engine (prompt + answer)."""

    params: dict[str, Any]
    token_ids: tuple[int, ...]
    expires_at: float
    """On the store's own monotonic clock."""
    decode_url: str | None = None
    """The decode replica holding it, and its KV-compatibility digest: only a prefill replica
    of that digest can pull it, and only while that replica is still discovered."""
    kv_compat: str | None = None
    request_id: str | None = None
    """The gateway's id of the turn (its hold in held_kv.DecodeHolds)."""


class DecodeKv:
    """conversation id -> the decode engine's held KV of its last turn (bidirectional_kv_xfer),
    handed to the next turn's prefill only as far as the token ids really match: a reasoning
    template that strips <think> from history changes the prompt right after the old one.

    How long decode holds it is the gateway's own reckoning: `ttl` (decoder_kv_blocks_ttl) from
    when the turn's answer came. The engine's remote_blocks_expiry_time is a reading of its own
    monotonic clock (vLLM's time.perf_counter()), meaningless in another process; it is passed
    on untouched for the engines, which know each other's clock offsets."""

    def __init__(
        self,
        max_conversations: int = MAX_CONVERSATIONS,
        ttl: float = 480.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max = max_conversations
        self.ttl = ttl
        self.clock = clock
        self.held: OrderedDict[str, HeldKv] = OrderedDict()

    def keep(
        self,
        conversation: str,
        params: Mapping[str, Any],
        token_ids: Sequence[int],
        *,
        decode_url: str | None = None,
        kv_compat: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.held[conversation] = HeldKv(
            dict(params), tuple(token_ids), self.clock() + self.ttl, decode_url, kv_compat,
            request_id,
        )  # fmt: skip
        self.held.move_to_end(conversation)
        while len(self.held) > self.max:
            self.held.popitem(last=False)

    def consumed(self, conversation: str, request_id: str | None) -> None:
        """The turn `request_id` left was read back by a next prefill, which frees its blocks
        on decode: pointing another prefill at them would load whatever decode put there
        since."""
        held = self.held.get(conversation)
        if held is not None and held.request_id == request_id:
            del self.held[conversation]

    def reuse(
        self, conversation: str, prompt_ids: Sequence[int], min_tokens: int
    ) -> tuple[dict[str, Any] | None, str, int]:
        """(params for the prefill, outcome, matching tokens). Outcomes: none, expired,
        prefix_mismatch (fewer than min_tokens agree), reused."""
        held = self.held.get(conversation)
        if held is None:
            return None, "none", 0
        if held.expires_at <= self.clock():
            del self.held[conversation]
            return None, "expired", 0
        matched = 0
        for mine, theirs in zip(prompt_ids, held.token_ids, strict=False):
            if mine != theirs:
                break
            matched += 1
        if matched < min_tokens:
            return None, "prefix_mismatch", matched
        return dict(held.params), "reused", matched
