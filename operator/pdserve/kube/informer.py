"""One kind's objects, in one namespace or all, kept current by a list and then a watch from
that list's version (re-listed after the watch ends badly, with capped backoff), and grouped by a
key of the caller's choosing. Readers get what the watch last saw without a request; writers tell
it what they wrote (`observe`), so their own next read is not older than their write."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import httpx

from pdserve.kube.client import Kind, Kube, KubeError

log = logging.getLogger("pdserve.kube.informer")

ObjectKey = tuple[str, str]  # namespace ("" for cluster-scoped), name
# Told of every object the watch added, changed or removed ("ADDED", "MODIFIED", "DELETED"),
# after the store holds it (a reader it wakes sees the change). Not told of `observe`d writes.
ChangeHandler = Callable[[str, Mapping[str, Any]], None]
Grouping = Callable[[Mapping[str, Any]], Hashable | None]


def object_key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


def version_of(obj: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as a number (etcd's revision), None when it is not one:
    such versions are never compared, the later write simply wins."""
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def is_older(candidate: Mapping[str, Any], held: Mapping[str, Any] | None) -> bool:
    if held is None:
        return False
    new, old = version_of(candidate), version_of(held)
    return new is not None and old is not None and new < old


class Informer:
    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        group_by: Grouping | None = None,
        on_change: ChangeHandler | None = None,
        on_listed: Callable[[], None] | None = None,
        max_backoff_seconds: float = 30.0,
    ) -> None:
        """`group_by`: an object's group (None: in none), for `group`. `on_change`: see
        ChangeHandler; `on_listed`: told after every list, once the store holds it. Neither may
        block (they run on the watch's task)."""
        self.kube, self.kind, self.namespace = kube, kind, namespace
        self.label_selector, self.field_selector = label_selector, field_selector
        self.group_by = group_by
        self.on_change = on_change
        self.on_listed = on_listed
        self.max_backoff_seconds = max_backoff_seconds
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self._groups: dict[Hashable, dict[ObjectKey, dict[str, Any]]] = {}
        # True while the store is as current as the watch: after a list, until the watch fails.
        self.synced = False
        # Set once the first list has answered, with objects or with an error.
        self.attempted = asyncio.Event()
        self.last_error: str | None = None

    def __repr__(self) -> str:
        where = self.namespace or "all namespaces"
        selector = ",".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"Informer({self.kind.kind} in {where}, {selector or 'no selector'})"

    # -- reading ------------------------------------------------------------------------------

    def get(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object as last seen (not a copy: readers must not change it)."""
        return self.objects.get((namespace or "", name))

    def group(self, group: Hashable) -> list[dict[str, Any]]:
        """The objects of `group`, by name (not copies: readers must not change them)."""
        members = self._groups.get(group, {})
        return [members[key] for key in sorted(members)]

    # -- what the caller wrote ----------------------------------------------------------------

    def observe(self, obj: Mapping[str, Any]) -> None:
        """An object as a write answered it: kept unless the store holds a newer version."""
        item = dict(obj)
        item.setdefault("apiVersion", self.kind.api_version)
        item.setdefault("kind", self.kind.kind)
        if not is_older(item, self.objects.get(object_key(item))):
            self._put(item)

    def discard(self, namespace: str | None, name: str) -> None:
        """An object the caller deleted; a later watch event that still shows it puts it back
        until the deletion's own event arrives."""
        self._remove((namespace or "", name))

    # -- the store ----------------------------------------------------------------------------

    def _put(self, obj: dict[str, Any]) -> None:
        key = object_key(obj)
        self._remove(key)
        self.objects[key] = obj
        if self.group_by is not None and (group := self.group_by(obj)) is not None:
            self._groups.setdefault(group, {})[key] = obj

    def _remove(self, key: ObjectKey) -> None:
        old = self.objects.pop(key, None)
        if old is None or self.group_by is None:
            return
        group = self.group_by(old)
        members = self._groups.get(group) if group is not None else None
        if members is not None:
            members.pop(key, None)
            if not members:
                del self._groups[group]

    def _tell(self, event: str, obj: Mapping[str, Any]) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(event, obj)
        except Exception:  # a handler's bug must not stop the watch every reader relies on
            log.exception("%r: change handler failed on %s", self, object_key(obj))

    # -- list, then watch ---------------------------------------------------------------------

    async def relist(self) -> str:
        """Replace the store with a fresh list, telling what changed since the last; the list's
        resourceVersion, to watch from."""
        items, version = await self.kube.list_versioned(
            self.kind, self.namespace, label_selector=self.label_selector,
            field_selector=self.field_selector,
        )  # fmt: skip
        before = self.objects
        self.objects, self._groups = {}, {}
        for item in items:
            item.setdefault("apiVersion", self.kind.api_version)
            item.setdefault("kind", self.kind.kind)
            self._put(item)
        self.synced = True
        for key, obj in self.objects.items():
            old = before.get(key)
            if old is None or old["metadata"].get("resourceVersion") != obj["metadata"].get(
                "resourceVersion"
            ):
                self._tell("ADDED" if old is None else "MODIFIED", obj)
        for key, old in before.items():
            if key not in self.objects:
                self._tell("DELETED", old)
        if self.on_listed is not None:
            self.on_listed()
        return version

    def _not_served(self) -> None:
        """The API server does not serve the kind (its CRD is not installed): there is none of
        it, which readers may know without asking, until a list finds it served."""
        for key, old in list(self.objects.items()):
            self._remove(key)
            self._tell("DELETED", old)
        self.synced = True

    async def watch(self, version: str) -> str:
        """Apply the watch's events from `version` until the server ends it; the version to
        resume from, or "" when it must re-list (the version expired)."""
        async for event, obj in self.kube.watch(
            self.kind, self.namespace, label_selector=self.label_selector,
            field_selector=self.field_selector, resource_version=version,
        ):  # fmt: skip
            if event == "ERROR":
                log.debug("%r: watch ended: %s", self, obj.get("message"))
                return ""  # 410 Gone: the version is too old to resume from
            version = str(obj.get("metadata", {}).get("resourceVersion") or version)
            if event == "BOOKMARK":
                continue
            obj.setdefault("apiVersion", self.kind.api_version)
            obj.setdefault("kind", self.kind.kind)
            key = object_key(obj)
            held = self.objects.get(key)
            if event == "DELETED":
                if not is_older(obj, held):
                    self._remove(key)
            elif not is_older(obj, held):
                self._put(obj)
            self._tell(event, obj)
        return version

    async def run(self) -> None:
        """List and watch until cancelled. Errors (a 403 included: RBAC may be granted later)
        re-list after a backoff; meanwhile `synced` is False, and readers ask the API server."""
        delay = 0.5
        version = ""
        while True:
            try:
                if not version:
                    version = await self.relist()
                    self.attempted.set()
                version = await self.watch(version)
                delay = 0.5
            except (KubeError, httpx.HTTPError, ValueError) as error:
                not_served = isinstance(error, KubeError) and error.status == 404
                self.synced = False
                if not_served:
                    self._not_served()
                self.attempted.set()
                message = str(error)
                # Once per distinct error: a kind the operator may not watch retries quietly.
                level = logging.DEBUG if message == self.last_error else logging.WARNING
                why = "readers ask the API server meanwhile"
                if not_served:
                    level = min(level, logging.INFO)  # e.g. KEDA's CRD not installed: normal
                    why = "not served here (is its CRD installed?): none exist meanwhile"
                elif isinstance(error, KubeError) and error.status == 403:
                    why = f"grant list and watch on {self.kind.plural} to cache them; " + why
                log.log(level, "%r: %s; %s; listing again in %.1fs", self, message, why, delay)
                self.last_error = message
                version = ""
                await asyncio.sleep(delay)  # backoff before re-listing, not synchronization
                delay = min(delay * 2, self.max_backoff_seconds)
