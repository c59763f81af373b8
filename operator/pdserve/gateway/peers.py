"""The other gateway replicas of a model, and one of them that decides every long-prefill
admission: the prefill admission limit is cluster-wide.

The replica with the lowest URL among those that can see each other (itself and the peers that
answered the last poll) is the leader. Every other replica asks it for a slot with
`POST /admission/hold`, naming the prefill replicas it may use, best first: the leader queues the
request in its own fair queue (first come first served, aging included, over the whole model),
answers `granted <replica>` when one of them has room and keeps the connection open; the slot is
held until the asking replica closes that connection (its prefill ended, or it died). A replica
that is not the leader in its own view answers 409. One process decides, so the limit is exact.

While no leader can be reached (start-up, a leader that just died or hangs), a replica admits on
its own and counts what its peers report holding, including the slots they still hold through a
leader that is gone (their prefills outlive it): the limit can then overshoot by one per replica
until the next poll."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import aiohttp

from pdserve.gateway.fairqueue import LONG, PrefillAdmission

log = logging.getLogger("pdserve.gateway.peers")

GRANTED = "granted"


class LeaderUnavailable(Exception):
    """The leader could not be asked or did not answer: admit here instead."""


class PeerAdmission:
    """Polls each peer's `GET /admission` every `interval` seconds; a peer that does not answer
    counts as holding nothing (a dead replica's prefills died with it) and cannot lead."""

    def __init__(
        self,
        admission: PrefillAdmission,
        client: Callable[[], aiohttp.ClientSession],
        *,
        interval: float = 0.1,
        timeout: float = 0.5,
        api_key: str | None = None,
    ) -> None:
        self.admission = admission
        self.client = client
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        # The peer key (else the gateway's own API key): the replicas of one gateway share it.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.self_url: str | None = None
        """This replica's own URL as its peers reach it; None: it cannot take part in electing
        a leader (it admits on its own)."""
        self.urls: list[str] = []
        self.states: dict[str, PeerState] = {}
        """Per peer: its last answer (nothing held while it does not answer)."""
        self.held: dict[str, Counter[str]] = {}
        """This replica's own slots held through a leader, per leader and replica."""
        self.live: set[str] = set()
        self.leader_errors = 0
        admission.others = self.total

    def set_peers(self, urls: list[str], self_url: str | None = None) -> None:
        self.urls = sorted(urls)
        self.self_url = self_url
        self.states = {u: state for u, state in self.states.items() if u in self.urls}
        self.live &= set(self.urls)

    def replicas(self) -> int:
        """This gateway's replicas: the peers it sees and itself (they share budgets evenly)."""
        return 1 + len([url for url in self.urls if url != self.self_url])

    def total(self, replica: str) -> int:
        """Long prefills on `replica` that this replica's own count misses: those its peers
        admitted on their own, and those anyone holds through a leader that no longer answers
        (a live leader reports them itself; this replica, if leader, counts its own)."""
        own = sum(state.replicas.get(replica, 0) for state in self.states.values())
        through: list[Mapping[str, Mapping[str, int]]] = [
            *(state.held_at for state in self.states.values()),
            self.held,
        ]
        orphaned = sum(
            held.get(replica, 0)
            for per_leader in through
            for leader, held in per_leader.items()
            if leader not in self.live and leader != self.self_url
        )
        return own + orphaned

    def holdings(self) -> dict[str, dict[str, int]]:
        """What `GET /admission` reports of this replica's slots held through a leader."""
        return {leader: dict(held) for leader, held in self.held.items() if held}

    def queued(self) -> int:
        """Long requests waiting in the peers' queues (the leader's holds everyone's)."""
        return sum(state.queued for state in self.states.values())

    def leader(self) -> str | None:
        """The peer that admits long prefills for every replica; None when this replica does
        (it is the leader, or it cannot know: no own URL)."""
        if self.self_url is None or not self.live:
            return None
        lowest = min(self.live)
        return lowest if lowest < self.self_url else None

    async def _ask(self, url: str) -> PeerState | None:
        try:
            async with self.client().get(
                f"{url}/admission", headers=self.headers, timeout=self.timeout
            ) as response:
                if response.status != 200:
                    return None
                return PeerState.parse(await response.json())
        except (TimeoutError, aiohttp.ClientError, ValueError, TypeError, AttributeError) as error:
            log.debug("peer %s: %s", url, error)
            return None

    async def poll_once(self) -> None:
        urls = list(self.urls)
        answers = dict(zip(urls, await asyncio.gather(*(self._ask(u) for u in urls)), strict=True))
        self.live = {url for url, answer in answers.items() if answer is not None}
        nothing = PeerState({}, {}, 0)
        self.states = {url: answer or nothing for url, answer in answers.items()}
        self.admission.wake()  # a peer's release may have made room for our queue

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)  # the poll period, not synchronization

    @asynccontextmanager
    async def slot(self, request_class: str, replicas: Sequence[str]) -> AsyncIterator[str | None]:
        """Hold a long-prefill slot on one of `replicas` (best first) and yield it, from the
        leader or, when there is none to ask, from this replica's own queue; short requests pass
        straight through (None)."""
        if request_class != LONG or not replicas:
            yield None
            return
        async with AsyncExitStack() as stack:
            granted: str | None = None
            if (leader := self.leader()) is not None:
                try:
                    granted = await stack.enter_async_context(self._hold(leader, replicas))
                except LeaderUnavailable as error:
                    self.leader_errors += 1
                    log.warning("admission leader %s: %s; admitting here", leader, error)
            if granted is None:
                granted = await stack.enter_async_context(self.admission.admit(LONG, replicas))
            yield granted

    @asynccontextmanager
    async def _hold(self, leader: str, replicas: Sequence[str]) -> AsyncIterator[str]:
        response, replica = await self._ask_leader(leader, replicas)
        held = self.held.setdefault(leader, Counter())
        held[replica] += 1
        try:
            yield replica
        finally:
            response.close()  # closing the connection releases the slot on the leader
            held[replica] -= 1
            if held[replica] <= 0:
                del held[replica]
            if not held:
                self.held.pop(leader, None)

    async def _ask_leader(
        self, leader: str, replicas: Sequence[str]
    ) -> tuple[aiohttp.ClientResponse, str]:
        """Wait for the leader's grant (the leader answers only then); the open response is
        the slot."""
        # The leader ages a queued request after max_wait_seconds: a grant later than twice
        # that means the leader is stuck (or gone without a reset), and this replica admits on
        # its own.
        grant_timeout = 2 * self.admission.settings.max_wait_seconds + 1
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(grant_timeout):
                response = await self.client().post(
                    f"{leader}/admission/hold",
                    json={"replicas": list(replicas)},
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=self.timeout.total, sock_read=None
                    ),
                )
                if response.status != 200:
                    raise LeaderUnavailable(f"HTTP {response.status}: {await response.text()}")
                line = await response.content.readline()
            word, _, replica = line.decode(errors="replace").strip().partition(" ")
            if word != GRANTED or replica not in replicas:
                raise LeaderUnavailable(f"unexpected answer {line[:120]!r}")
            return response, replica
        except BaseException as error:
            if response is not None:
                response.close()
            if isinstance(error, TimeoutError | aiohttp.ClientError):
                raise LeaderUnavailable(str(error) or type(error).__name__) from None
            raise


@dataclass(frozen=True)
class PeerState:
    """One peer's answer to `GET /admission`."""

    replicas: dict[str, int]
    held_at: dict[str, dict[str, int]]
    queued: int

    @classmethod
    def parse(cls, body: Mapping[str, object]) -> PeerState:
        replicas = body.get("replicas") or {}
        held_at = body.get("heldAt") or {}
        if not isinstance(replicas, Mapping) or not isinstance(held_at, Mapping):
            raise ValueError("replicas and heldAt must be objects")
        return cls(
            {str(k): int(v) for k, v in replicas.items()},
            {str(leader): {str(k): int(v) for k, v in held.items()}
             for leader, held in held_at.items()},
            int(str(body.get("queued", 0))),
        )  # fmt: skip
