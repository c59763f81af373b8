"""Leader election over a coordination.k8s.io/v1 Lease, so that several operator replicas can
run: every replica serves the admission webhook, only the Lease holder reconciles.

The Lease is written with optimistic concurrency (metadata.resourceVersion): of two replicas
that read the same Lease and both try to take it, the API server accepts one write and answers
the other 409 Conflict, so at most one replica believes it holds a given version. A holder
renews every third of the lease duration; a replica takes the Lease when it is absent, has no
holder (released), is already its own, or was not renewed for a whole lease duration. A holder
that cannot renew steps down at its renew deadline (two thirds of the duration), before any
other replica may take the Lease over."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Gauge

from pdserve.contract.names import LEADER_LEASE_NAME
from pdserve.kube.client import KINDS, Kind, KubeError

log = logging.getLogger("pdserve.leader")

LEASE = KINDS[("coordination.k8s.io/v1", "Lease")]
LEADER_METRIC = "pdserve_operator_leader"
MANAGED = {"app.kubernetes.io/managed-by": "pdserve"}

Clock = Callable[[], datetime]
Sleep = Callable[[float], Awaitable[None]]


def utc_now() -> datetime:
    return datetime.now(UTC)


def micro_time(moment: datetime) -> str:
    """A Lease's MicroTime: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


class LeaseStore(Protocol):
    """What the elector calls (pdserve.kube.client.Kube; an in-memory store in tests)."""

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None: ...

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...


def _nothing() -> None:
    return None


class LeaderElector:
    def __init__(
        self,
        store: LeaseStore,
        namespace: str,
        identity: str,
        *,
        name: str = LEADER_LEASE_NAME,
        lease_seconds: float = 15.0,
        on_lead: Callable[[], None] = _nothing,
        on_lose: Callable[[], None] = _nothing,
        clock: Clock = utc_now,
        sleep: Sleep = asyncio.sleep,
        registry: CollectorRegistry | None = None,
        request_seconds: float | None = None,
    ) -> None:
        """`on_lead` / `on_lose` run synchronously at the moment leadership changes, so that
        nothing can reconcile between losing the Lease and being told. `clock` and `sleep` are
        injected so that tests drive time instead of waiting for it. `request_seconds`: how
        long one round's API calls may take (default a renew period: a hung request must not
        keep a leader past its deadline, and the client's own timeout is longer than a
        lease)."""
        if not identity:
            raise ValueError("a leader identity must not be empty")
        self.store = store
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = lease_seconds / 3
        # A follower polls more often than the leader renews: a released Lease (rolling
        # restart) is taken within this, not within a renew period.
        self.retry_seconds = min(2.0, self.renew_seconds)
        # Stop leading by then when renewals fail: earlier than the lease duration, after
        # which another replica may take the Lease, so two leaders never overlap.
        self.renew_deadline = lease_seconds * 2 / 3
        self.request_seconds = request_seconds or self.renew_seconds
        self.on_lead = on_lead
        self.on_lose = on_lose
        self.clock = clock
        self.sleep = sleep
        self.leading = False
        self._renewed_at: datetime | None = None
        self.gauge: Gauge | None = None
        if registry is not None:
            self.gauge = Gauge(LEADER_METRIC, "1 while this operator replica holds the leader "
                               "Lease and reconciles, else 0", registry=registry)  # fmt: skip
            self.gauge.set(0)

    # ---- one round ------------------------------------------------------------------------
    async def step(self) -> bool:
        """Acquire or renew the Lease once; whether this replica leads afterwards."""
        now = self.clock()
        try:
            async with asyncio.timeout(self.request_seconds):
                won = await self._acquire_or_renew(now)
        except KubeError as error:
            if error.status == 409:  # another replica wrote the Lease since it was read
                self._lose("another replica updated the Lease first")
                return False
            return self._failed(error, now)
        except (httpx.HTTPError, TimeoutError) as error:
            return self._failed(error, now)
        if not won:
            return False
        self._renewed_at = now
        if not self.leading:
            self.leading = True
            if self.gauge is not None:
                self.gauge.set(1)
            log.info("acquired the leader Lease %s/%s as %s: reconciling",
                     self.namespace, self.name, self.identity)  # fmt: skip
            self.on_lead()
        return True

    async def _acquire_or_renew(self, now: datetime) -> bool:
        lease = await self.store.get(LEASE, self.namespace, self.name)
        if lease is None:
            await self.store.create(self._lease(None, now))
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity and not self._expired(spec, now):
            self._lose(f"the Lease is held by {holder}")
            return False
        await self.store.replace(self._lease(lease, now))
        return True

    def _expired(self, spec: Mapping[str, Any], now: datetime) -> bool:
        """Not renewed within the holder's own lease duration (renewTime + duration < now)."""
        renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
        if renewed is None:
            return True
        duration = spec.get("leaseDurationSeconds")
        if not isinstance(duration, int | float) or duration <= 0:
            duration = self.lease_seconds
        return renewed + timedelta(seconds=duration) < now

    def _lease(self, current: Mapping[str, Any] | None, now: datetime) -> dict[str, Any]:
        """The Lease as this replica holds it at `now`: renewed if already its own, taken over
        (acquireTime now, one more transition) if not."""
        spec = dict((current or {}).get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = micro_time(now)
            transitions = spec.get("leaseTransitions")
            spec["leaseTransitions"] = (
                transitions + 1 if current is not None and isinstance(transitions, int) else 0
            )
        spec.update(holderIdentity=self.identity, renewTime=micro_time(now),
                    leaseDurationSeconds=math.ceil(self.lease_seconds))  # fmt: skip
        if current is not None:
            # Its metadata as read, resourceVersion included: the write is the optimistic one.
            return {**current, "spec": spec}
        return {
            "apiVersion": LEASE.api_version,
            "kind": LEASE.kind,
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": MANAGED},
            "spec": spec,
        }

    def _failed(self, error: BaseException, now: datetime) -> bool:
        """The Lease could not be read or written: a leader keeps leading until its renew
        deadline, since the Lease it last wrote is still valid for others until then."""
        if not self.leading:
            log.debug("leader Lease %s/%s unreachable: %s", self.namespace, self.name, error)
            return False
        since = (now - self._renewed_at).total_seconds() if self._renewed_at else math.inf
        if since >= self.renew_deadline:
            self._lose(f"could not renew for {since:.1f}s ({error})")
            return False
        log.warning("renewing the leader Lease failed (%s); still leading for %.1fs",
                    error, self.renew_deadline - since)  # fmt: skip
        return True

    def _lose(self, why: str) -> None:
        if not self.leading:
            return
        self.leading = False
        self._renewed_at = None
        if self.gauge is not None:
            self.gauge.set(0)
        log.info("lost the leader Lease %s/%s: %s; reconciling stops",
                 self.namespace, self.name, why)  # fmt: skip
        self.on_lose()

    # ---- the loop and shutdown -------------------------------------------------------------
    async def run(self) -> None:
        """Renew while leading, poll while following, until cancelled."""
        while True:
            try:
                leading = await self.step()
            except Exception as error:
                # A Lease of an unexpected shape must not end the loop: a leader that stopped
                # renewing but still reconciled would overlap the next one.
                log.exception("leader election round crashed")
                leading = self._failed(error, self.clock())
            await self.sleep(self.renew_seconds if leading else self.retry_seconds)

    async def release(self) -> None:
        """Graceful shutdown, after reconciling stopped: give the Lease up (no holder) so that
        another replica takes it at its next poll instead of after a lease duration."""
        if not self.leading:
            return
        self.leading = False
        if self.gauge is not None:
            self.gauge.set(0)
        try:
            async with asyncio.timeout(self.request_seconds):  # within the grace period
                lease = await self.store.get(LEASE, self.namespace, self.name)
                spec = (lease or {}).get("spec") or {}
                if lease is None or spec.get("holderIdentity") != self.identity:
                    return
                spec = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1,
                        "renewTime": micro_time(self.clock())}  # fmt: skip
                await self.store.replace({**lease, "spec": spec})
            log.info("released the leader Lease %s/%s", self.namespace, self.name)
        except (KubeError, httpx.HTTPError, TimeoutError) as error:
            log.warning("could not release the leader Lease (%s): another replica takes it "
                        "once it expires", error)  # fmt: skip
