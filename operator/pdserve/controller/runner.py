"""Coalescing reconcile scheduler: one worker per DisaggregatedModel, bursts of events collapse
into one pass, failures retry with capped exponential backoff, and a resync loop reconciles
every known resource periodically so drift is repaired even without events.

With leader election only the Lease holder reconciles: a follower remembers the models it hears
of, and on taking over (`lead`) reconciles every model it can list, since it may have missed
events; on losing the Lease (`step_down`) its loops and in-flight passes are cancelled at once.
A pass cut short, or one the next leader repeats, is harmless: passes are level-based and write
by server-side apply, so writing the same desired state twice changes nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client import CollectorRegistry

from pdserve.controller.autoscale.loop import Autoscaler
from pdserve.controller.autoscale.metrics import AutoscaleMetrics
from pdserve.controller.autoscale.targets import TargetResolver, pod_metrics_url
from pdserve.controller.cache import ClusterCache
from pdserve.controller.events import post_event
from pdserve.controller.health import TransportMonitor
from pdserve.controller.peer_key import PeerMaster
from pdserve.controller.reconcile import DM_KIND, PARITY_DRIFT, PassFailed, reconcile
from pdserve.controller.reconcile_metrics import ReconcileMetrics
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import Kube, KubeError

log = logging.getLogger("pdserve.runner")

Key = tuple[str, str]  # namespace, name
CACHE_LIST_WAIT_SECONDS = 30.0


class Reconciler:
    def __init__(
        self, kube: Kube, settings: OperatorSettings, *, resolve: TargetResolver = pod_metrics_url,
        leading: bool = True, watch: bool = False,
    ) -> None:  # fmt: skip
        """`resolve`: a pod -> its /metrics URL, for the autoscaling loop (tests point it at
        simulators on loopback). `leading`: False for a replica that waits for the leader
        Lease (`lead` starts it). `watch`: keep a watch-fed cache of the models and their
        children (`start_watching`), which passes read and whose changes trigger them; without
        it passes read from the API server and the caller triggers them."""
        self.kube = kube
        self.settings = settings
        self.leading = leading
        self._takeover: asyncio.Task[None] | None = None
        self.known: set[Key] = set()
        self._dirty: set[Key] = set()
        self._workers: dict[Key, asyncio.Task[None]] = {}
        self._failures: dict[Key, int] = {}
        self._loops: list[asyncio.Task[None]] = []
        self.cache: ClusterCache | None = None
        if watch:
            self.cache = ClusterCache(kube, settings.namespaces, on_model=self._heard)
        # Kinds the operator may not list that it warned about: once per kind while it runs.
        self.warned_forbidden: set[str] = set()
        # Read once, at the first model that needs a peer key, and kept: no pass reads a Secret.
        self.peer_master = PeerMaster(kube, settings.operator_namespace)
        self.health: TransportMonitor | None = None
        if settings.engine_metrics_seconds > 0:
            self.health = TransportMonitor(
                lambda key: self.trigger(*key), interval=settings.engine_metrics_seconds
            )
        # What --metrics-port serves: the passes' and the work queue's, the autoscaler's.
        self.registry = CollectorRegistry()
        self.metrics = ReconcileMetrics(self.registry)
        self._asked: dict[Key, float] = {}  # when a pass was first asked for, per waiting key
        self.autoscaler: Autoscaler | None = None
        if settings.autoscale_seconds > 0:
            self.autoscaler = Autoscaler(
                lambda key: self.trigger(*key), interval=settings.autoscale_seconds,
                resolve=resolve, metrics=AutoscaleMetrics(self.registry),
            )  # fmt: skip

    def trigger(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.known.add(key)
        if not self.leading:
            return  # remembered only: the leader reconciles it, this replica once it leads
        self._dirty.add(key)
        self._asked.setdefault(key, time.monotonic())
        self.metrics.depth.set(len(self._dirty))
        worker = self._workers.get(key)
        # A worker cancelled by `step_down` but not yet unwound would never pick the key up.
        if worker is None or worker.done() or worker.cancelling():
            self._workers[key] = asyncio.create_task(self._work(key), name=f"reconcile {key}")

    def _heard(self, namespace: str, name: str, deleted: bool) -> None:
        """A watch saw the model or one of its children change."""
        if deleted:
            self.forget(namespace, name)  # owner references let the GC remove children
        else:
            self.trigger(namespace, name)

    def start_watching(self) -> None:
        """Start the cache's watches (every replica, leading or not: a new leader needs them)."""
        if self.cache is not None:
            self.cache.start()

    def forget(self, namespace: str, name: str) -> None:
        self.known.discard((namespace, name))
        self.metrics.forget((namespace, name))
        if self.health is not None:
            self.health.forget((namespace, name))
        if self.autoscaler is not None:
            self.autoscaler.forget((namespace, name))

    def lead(self) -> None:
        """This replica took the leader Lease: start the loops and reconcile every model, the
        listed ones and those heard of while following."""
        if self.leading:
            return
        self.leading = True
        self.start_loops()
        self._takeover = asyncio.create_task(self._reconcile_all(), name="takeover")

    async def _reconcile_all(self) -> None:
        keys = set(self.known)
        try:
            for namespace in self.settings.namespaces or (None,):
                for body in await self.kube.list(DM_KIND, namespace):
                    keys.add((body["metadata"]["namespace"], body["metadata"]["name"]))
        except (KubeError, httpx.HTTPError) as error:
            # kopf's watch lists every model again when it restarts, and each one is triggered.
            log.warning("listing DisaggregatedModels on takeover failed (%s); reconciling the "
                        "%d known", error, len(keys))  # fmt: skip
        for namespace, name in sorted(keys):
            self.trigger(namespace, name)

    def step_down(self) -> None:
        """This replica lost the leader Lease: nothing more may be written, so the loops, the
        takeover and every in-flight pass are cancelled now (their next await raises), and the
        keys stay known for the next time it leads."""
        self.leading = False
        self.stop_loops()
        if self._takeover is not None:
            self._takeover.cancel()
        for worker in self._workers.values():
            worker.cancel()
        self._dirty.clear()
        self._asked.clear()
        self.metrics.depth.set(0)
        self.metrics.forget_models()  # the new leader tells them; stale here, they would alert
        if self.autoscaler is not None:
            self.autoscaler.metrics.forget_models()
        self._failures.clear()

    async def _work(self, key: Key) -> None:
        if self.cache is not None:
            # Until every watch has listed once a pass would list what it cannot read yet.
            await self.cache.wait_listed(CACHE_LIST_WAIT_SECONDS)
        while key in self._dirty and self.leading:
            self._dirty.discard(key)
            self.metrics.depth.set(len(self._dirty))
            started = time.monotonic()
            self.metrics.wait.observe(started - self._asked.pop(key, started))
            try:
                await self._reconcile_once(key)
                self._count(key, "success", started)
                self._failures.pop(key, None)
            except (KubeError, httpx.HTTPError) as error:
                self._count(key, "error", started)
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = min(self.settings.retry_max_seconds, 0.5 * 2**failures)
                log.warning("%s/%s: reconcile failed (%s); retrying in %.1fs", *key, error, delay)
                await asyncio.sleep(delay)  # backoff before the retry, not synchronization
                self._dirty.add(key)
                self._asked.setdefault(key, time.monotonic())
            except Exception:
                self._count(key, "crash", started)
                log.exception("%s/%s: reconcile crashed; the next event or resync retries", *key)

    def _count(self, key: Key, result: str, started: float) -> None:
        self.metrics.passes.labels(*key, result).inc()
        self.metrics.duration.labels(result).observe(time.monotonic() - started)

    async def _reconcile_once(self, key: Key) -> None:
        known, body = self.cache.model(*key) if self.cache is not None else (False, None)
        if not known:
            body = await self.kube.get(DM_KIND, *key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(*key)
            return
        error: BaseException | None = None
        try:
            outcome = await reconcile(
                self.kube, body, network=self.settings.network_policies, health=self.health,
                autoscaler=self.autoscaler, warned=self.warned_forbidden,
                peer_master=self.peer_master, cache=self.cache,
                gateway_image=self.settings.gateway_image,
            )  # fmt: skip
        except PassFailed as failed:
            outcome, error = failed.outcome, failed.error
        if self.leading and key in self.known:  # not a model forgotten, or a Lease lost, meanwhile
            drifts = sum(event.reason == PARITY_DRIFT for event in outcome.events)
            self.metrics.observe(key, outcome.status, drifts)
        # What a pass found before it failed (drift it repaired, scaling it did) is told too:
        # the retry finds nothing left to repair and would never tell it.
        for event in outcome.events:
            await post_event(self.kube, body, event)
        if error is not None:
            raise error

    async def resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for namespace, name in sorted(self.known):
                self.trigger(namespace, name)

    def start_loops(self) -> None:
        """The resync loop and the background scrapers (transport health, Builtin autoscaling)
        as tasks this Reconciler holds until `stop_loops`."""
        self._loops.append(asyncio.create_task(self.resync_forever(), name="resync"))
        if self.health is not None:
            self._loops.append(
                asyncio.create_task(self.health.run_forever(), name="transport health")
            )
        if self.autoscaler is not None:
            self._loops.append(asyncio.create_task(self.autoscaler.run_forever(), name="autoscale"))

    def stop_loops(self) -> None:
        for task in self._loops:
            task.cancel()
        self._loops = []  # a replica that leads again starts them anew

    async def close(self) -> None:
        """Shutdown, after `stop_loops`: in-flight reconciles end, then the clients close."""
        await self.drain()
        if self.cache is not None:
            await self.cache.stop()
        await self.kube.close()
        if self.health is not None:
            await self.health.close()
        if self.autoscaler is not None:
            await self.autoscaler.close()

    async def drain(self) -> None:
        """Wait for in-flight reconciles (shutdown and tests)."""
        if self._takeover is not None:  # first: it may start workers
            await asyncio.gather(self._takeover, return_exceptions=True)
        while running := [w for w in self._workers.values() if not w.done()]:
            await asyncio.gather(*running, return_exceptions=True)
