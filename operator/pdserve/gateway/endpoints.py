"""Endpoints per pool and parity gating: a request only combines render, prefill and decode
endpoints that carry the same parity hash, so a rollout never mixes an old chat template with a
new parser. During a rollout the newest complete set wins; with no complete set the gateway
answers 503 rather than mixing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.policy import ewma

# One unit of load per this many queued prompt tokens (about two engine steps of prefill at
# vLLM's default 2048-token budget).
PREFILL_TOKENS_PER_LOAD_UNIT = 4096
AFFINITY_SLACK = 4.0
"""How much busier (load units) than the least loaded candidate the one holding a request's KV
may be and still win it: a cache hit saves a prefill, a queue that long costs more."""


@dataclass
class StepMeter:
    """How long an engine's streams wait between tokens lately: the mean gap between streamed
    events (one per engine step and stream), prefill stalls included, over windows of
    `window` seconds smoothed across windows. What a stream's TPOT would be if it ran now."""

    seconds: float | None = None
    _sum: float = 0.0
    _count: int = 0
    _started: float | None = None

    def observe(self, gap: float, now: float, window: float, alpha: float = 0.5) -> None:
        if self._started is None or now - self._started > 2 * window:
            self._started, self._sum, self._count = now, 0.0, 0  # after a quiet spell: anew
        self._sum += gap
        self._count += 1
        if now - self._started >= window:
            mean = self._sum / self._count
            self.seconds = ewma(self.seconds, mean, alpha)
            self._started, self._sum, self._count = now, 0.0, 0


# vLLM's header naming the engine, among those its API server manages, that serves a request
# (docs/design/multinode.md "Addressing one DP rank").
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


@dataclass
class Replica:
    """What the routing targets of one engine pod share, one per data-parallel rank it serves:
    whether its replica check lets it be routed to, and until when it is marked down (a pod
    that failed a request fails it on every rank)."""

    routable: bool = True
    down_until: float = 0.0


@dataclass
class Endpoint:
    """One routing target: a replica's server, or one data-parallel rank of it (`rank`)."""

    url: str
    parity_hash: str | None = None
    inflight: int = 0
    # From the engine's own /metrics (vllm:num_requests_waiting/running, kv_cache_usage_perc),
    # refreshed by the load scraper; zero until the first scrape.
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    # From vllm:cache_config_info: the engine's KV cache in blocks (num_gpu_blocks, the smallest
    # of its data-parallel ranks') and their size in tokens; zero until scraped.
    kv_blocks: int = 0
    kv_block_size: int = 0
    # From the pod: its slice (pdserve.io/slice; None without slices) and its slice's transport
    # preflight verdict (pdserve.io/kv-transport: Verified, Failed, Unverified).
    slice: str | None = None
    kv_transport: str | None = None
    # Prefill and decode: the KV-compatibility digest (pdserve.io/kv-compat) of the spec the
    # pod was built from; NIXL hands KV only between engines with equal ones (kv_compatible).
    kv_compat: str | None = None
    # Prompt tokens this gateway sent to the engine that have not produced a first token yet:
    # prefill work queued there, which a request count alone hides (one 8k-token prompt holds
    # an engine ~30x longer than a short chat).
    prefill_backlog: int = 0
    name: str | None = None  # the pod's name (discovery) or a static endpoint's name
    steps: StepMeter = field(default_factory=StepMeter)
    rank: int | None = None
    """The engine of the pod this target is (X-data-parallel-rank: an index into the engines
    its API server manages, 0..dataParallelLocal-1); None where the pod runs one, or where
    vLLM balances over its ranks itself."""
    replica: Replica = field(default_factory=Replica)

    @property
    def routable(self) -> bool:
        """False while its replica check (replica_contract.py) is pending or found it
        disagreeing."""
        return self.replica.routable

    @routable.setter
    def routable(self, value: bool) -> None:
        self.replica.routable = value

    @property
    def down_until(self) -> float:
        return self.replica.down_until

    @down_until.setter
    def down_until(self, value: float) -> None:
        self.replica.down_until = value

    @property
    def label(self) -> str:
        """How metrics name this replica: its pod name, else its URL."""
        return self.name or self.url

    @property
    def key(self) -> str:
        """Names this target among all (affinity, load): the URL, with the rank if any."""
        return self.url if self.rank is None else f"{self.url}#dp{self.rank}"

    @property
    def target(self) -> str:
        """How a request's log and headers name where it went: the replica, with the rank."""
        return self.label if self.rank is None else f"{self.label}#dp{self.rank}"

    def upstream_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """`headers` for a call to this target: with its rank, vLLM's header that pins it."""
        if self.rank is None:
            return dict(headers)
        return {**headers, DATA_PARALLEL_RANK_HEADER: str(self.rank)}

    def healthy(self, now: float) -> bool:
        return self.routable and self.down_until <= now

    def load(self) -> float:
        """Lower is better. Queued requests weigh most (they wait for everything running); the
        gateway's own in-flight count moves at once, so replicas share traffic between scrapes;
        a nearly full KV cache means preemptions ahead."""
        return (
            4 * self.waiting
            + self.running
            + self.inflight
            + self.prefill_backlog / PREFILL_TOKENS_PER_LOAD_UNIT
            + 8 * max(0.0, self.kv_usage - 0.9)
        )


def rank_targets(endpoint: Endpoint, ranks: int) -> list[Endpoint]:
    """A pod serving `ranks` data-parallel ranks as that many routing targets sharing one
    Replica: each rank has its own prefix cache and queue, so the gateway's affinity and load
    are right only per rank. One rank: the endpoint itself."""
    if ranks <= 1:
        return [endpoint]
    shared = Replica()
    return [
        dataclasses.replace(endpoint, rank=rank, replica=shared, steps=StepMeter())
        for rank in range(ranks)
    ]


class NoEndpoints(Exception):
    """No complete, parity-consistent set of endpoints: the message says what is missing."""


@dataclass
class Selection:
    parity_hash: str | None
    pools: dict[str, list[Endpoint]] = field(default_factory=dict)


class Endpoints:
    def __init__(self, config: GatewayConfig, *, down_seconds: float = 5.0) -> None:
        self.config = config
        self.down_seconds = down_seconds
        self.pools: dict[str, list[Endpoint]] = {"render": [], "prefill": [], "decode": []}
        # Set (and replaced) on every discovery update: requests waiting for a complete set.
        self._changed = asyncio.Event()
        # Told of every discovery update (the replica checks start on new endpoints).
        self.on_change: Callable[[], None] | None = None
        if config.endpoints is not None:
            for pool in self.pools:
                self.pools[pool] = [
                    target
                    for e in getattr(config.endpoints, pool)
                    for target in rank_targets(
                        Endpoint(
                            e.url.rstrip("/"),
                            e.parity_hash,
                            slice=e.slice,
                            kv_transport=e.kv_transport,
                            kv_compat=e.kv_compat,
                            name=e.name,
                        ),
                        e.data_parallel_local,
                    )
                ]

    def replace(self, pool: str, endpoints: Iterable[Endpoint]) -> None:
        """Discovery updates a pool, keeping in-flight counts of endpoints that stay."""
        current = {e.key: e for e in self.pools[pool]}
        updated = []
        for endpoint in endpoints:
            kept = current.get(endpoint.key)
            # A new pod on a released pod IP is a new replica (its own replica check).
            if kept is not None and kept.name == endpoint.name:
                kept.parity_hash = endpoint.parity_hash
                kept.slice, kept.kv_transport = endpoint.slice, endpoint.kv_transport
                kept.kv_compat = endpoint.kv_compat
                updated.append(kept)
            else:
                updated.append(endpoint)
        self.pools[pool] = updated
        if self.on_change is not None:
            self.on_change()
        self.changed()

    def changed(self) -> None:
        """Wake the requests waiting for a complete set: endpoints came, or became routable."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_select(
        self, needed: Iterable[str], optional: Iterable[str] = (), *, wait_seconds: float
    ) -> Selection:
        """`select`, waiting up to `wait_seconds` for a complete set: a pool's only replica
        being replaced (a parity rollout, a restart) holds requests instead of failing them."""
        needed, optional = list(needed), list(optional)
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                return self.select(needed, optional)
            except NoEndpoints:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                # Woken by discovery; re-checked at least twice a second, as replicas marked
                # down come back by time alone.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 0.5))

    def select(self, needed: Iterable[str], optional: Iterable[str] = ()) -> Selection:
        """The newest complete parity-consistent set covering every needed pool."""
        needed, optional = list(needed), list(optional)
        now = time.monotonic()
        healthy = {p: [e for e in self.pools[p] if e.healthy(now)] for p in (*needed, *optional)}
        hashes = {e.parity_hash for p in needed for e in healthy[p]}
        preferred = [self.config.parity_hash] if self.config.parity_hash in hashes else []
        candidates = preferred + sorted(h for h in hashes if h not in preferred and h is not None)
        if None in hashes or not candidates:
            candidates.append(None)  # endpoints that carry no hash (static lists) match any
        for parity in candidates:
            chosen = {
                p: [e for e in healthy[p] if parity is None or e.parity_hash in (parity, None)]
                for p in (*needed, *optional)
            }
            if all(chosen[p] for p in needed):
                return Selection(parity, chosen)
        missing = [p for p in needed if not healthy[p]]
        if missing:
            held = sum(not e.routable for p in missing for e in self.pools[p])
            why = f" ({held} held out of routing by the replica check: see /status)" if held else ""
            raise NoEndpoints(f"no healthy {' or '.join(missing)} endpoint{why}")
        raise NoEndpoints(
            "no complete set of render/prefill/decode endpoints with one parity hash "
            f"(seen: {sorted(h for h in hashes if h)}); refusing to mix chat templates or parsers"
        )

    @staticmethod
    def pick(
        candidates: list[Endpoint],
        exclude: Iterable[Endpoint] = (),
        affinity: Mapping[str, int] | None = None,
        slack: float = AFFINITY_SLACK,
    ) -> Endpoint | None:
        """Least loaded, skipping the replicas that already failed this request (every rank of
        one: a retry goes to another pod). With `affinity` (Endpoint.key -> cached prefix
        blocks, or a conversation bonus), the target holding the most of this request's KV wins
        unless it is more than `slack` busier than the least loaded one."""
        failed = {e.url for e in exclude}
        pool = [e for e in candidates if e.url not in failed] if failed else candidates
        return Endpoints._best(pool, affinity, slack)

    @staticmethod
    def _best(
        pool: list[Endpoint], affinity: Mapping[str, int] | None, slack: float = AFFINITY_SLACK
    ) -> Endpoint | None:
        if not pool:
            return None
        least = min(e.load() for e in pool)
        if affinity:
            warm = [e for e in pool if affinity.get(e.key, 0) > 0 and e.load() <= least + slack]
            if warm:
                return max(warm, key=lambda e: (affinity[e.key], -e.load()))
        return min(pool, key=lambda e: e.load())

    @staticmethod
    def rank(
        candidates: list[Endpoint], affinity: Mapping[str, int] | None = None
    ) -> list[Endpoint]:
        """Every candidate, best first, in the order `pick` would choose them."""
        ranked: list[Endpoint] = []
        remaining = list(candidates)
        while (best := Endpoints._best(remaining, affinity)) is not None:
            ranked.append(best)
            remaining = [e for e in remaining if e is not best]
        return ranked

    @staticmethod
    def kv_compatible(decodes: list[Endpoint], prefill: Endpoint | None) -> list[Endpoint]:
        """The decode replicas that can pull `prefill`'s KV: those with its KV-compatibility
        digest. NIXL refuses a handshake between engines built differently (an engine image
        upgrade rolls prefill and decode separately), so no request pairs them. A replica
        without a digest pairs only with others without one: configs without digests keep
        working, and an unknown build never meets a known one."""
        if prefill is None:
            return decodes
        return [e for e in decodes if e.kv_compat == prefill.kv_compat]

    @staticmethod
    def same_slice(candidates: list[Endpoint], peer: Endpoint | None) -> list[Endpoint]:
        """The candidates in the peer's slice (one topology domain: the KV stays on the fast
        path); all of them when none is there."""
        if peer is None or peer.slice is None:
            return candidates
        return [e for e in candidates if e.slice == peer.slice] or candidates

    def mark_down(self, endpoint: Endpoint) -> None:
        endpoint.down_until = time.monotonic() + self.down_seconds
