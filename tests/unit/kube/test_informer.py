"""The watch-fed store: what readers see after a list, watch events, their own writes, and a
watch that fails or expires."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import pytest

from pdserve.kube.client import KINDS, Kube, KubeError
from pdserve.kube.informer import Informer

POD = KINDS[("v1", "Pod")]


def pod(name: str, version: int, model: str = "m", namespace: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "resourceVersion": str(version),
                         "labels": {"model": model}}}  # fmt: skip


def forbidden() -> KubeError:
    request = httpx.Request("GET", "https://api.test/api/v1/pods")
    return KubeError(httpx.Response(403, json={"message": "pods is forbidden"}, request=request))


class ScriptedKube:
    """Answers each list and each watch from a script; a watch with no more events waits."""

    def __init__(self) -> None:
        self.lists: list[tuple[list[dict[str, Any]], str] | Exception] = []
        self.watches: list[list[tuple[str, dict[str, Any]]]] = []
        self.watched_from: list[str] = []
        self.watching = asyncio.Event()

    async def list_versioned(self, *_: Any, **__: Any) -> tuple[list[dict[str, Any]], str]:
        answer = self.lists.pop(0)
        if isinstance(answer, Exception):
            raise answer
        items, version = answer
        return [dict(i) for i in items], version

    async def watch(
        self, *_: Any, resource_version: str, **__: Any
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self.watched_from.append(resource_version)
        self.watching.set()
        for event in self.watches.pop(0) if self.watches else []:
            yield event
        await asyncio.Event().wait()  # the server keeps the watch open


Told = list[tuple[str, str]]  # (event, name) as the change handler heard them


def informer(kube: ScriptedKube, told: Told) -> Informer:
    return Informer(
        cast(Kube, kube), POD, label_selector="app=x",
        group_by=lambda o: o["metadata"]["labels"].get("model"),
        on_change=lambda event, obj: told.append((event, obj["metadata"]["name"])),
    )  # fmt: skip


async def test_a_list_fills_the_groups_and_tells_every_object() -> None:
    kube, told = ScriptedKube(), Told()
    kube.lists.append(([pod("a", 5), pod("b", 6, model="n")], "10"))
    store = informer(kube, told)
    assert not store.synced
    assert await store.relist() == "10"
    assert store.synced
    assert [p["metadata"]["name"] for p in store.group("m")] == ["a"]
    assert [p["metadata"]["name"] for p in store.group("n")] == ["b"]
    assert store.group("other") == []
    assert sorted(told) == [("ADDED", "a"), ("ADDED", "b")]
    held = store.get("ns", "a")
    assert held is not None
    assert held["kind"] == "Pod"


async def test_watch_events_change_move_and_remove_objects() -> None:
    kube, told = ScriptedKube(), Told()
    kube.lists.append(([pod("a", 5), pod("b", 6)], "10"))
    kube.watches.append([
        ("MODIFIED", pod("a", 11, model="n")),  # relabelled: it moves to another group
        ("DELETED", pod("b", 12)),
        ("BOOKMARK", {"metadata": {"resourceVersion": "13"}}),
        ("ERROR", {"message": "too old resource version", "code": 410}),
    ])  # fmt: skip
    store = informer(kube, told)
    version = await store.relist()
    told.clear()
    assert await store.watch(version) == ""  # expired: list again
    assert store.group("m") == []
    assert [p["metadata"]["resourceVersion"] for p in store.group("n")] == ["11"]
    assert store.get("ns", "b") is None
    assert told == [("MODIFIED", "a"), ("DELETED", "b")]


async def test_a_write_is_not_undone_by_an_older_event_and_a_newer_one_wins() -> None:
    kube, told = ScriptedKube(), Told()
    kube.lists.append(([pod("a", 5)], "10"))
    kube.watches.append([("MODIFIED", pod("a", 11)), ("MODIFIED", pod("a", 14))])
    store = informer(kube, told)
    version = await store.relist()
    third = asyncio.Event()

    def tell(event: str, obj: Any) -> None:
        told.append((event, obj["metadata"]["name"]))
        if len(told) == 3:
            third.set()

    store.on_change = tell
    written = pod("a", 12)
    written["metadata"]["annotations"] = {"mine": "yes"}
    store.observe(written)
    store.observe(pod("a", 9))  # an older answer (a slow request) is not kept
    assert store.get("ns", "a")["metadata"]["resourceVersion"] == "12"  # type: ignore[index]
    task = asyncio.create_task(store.watch(version))
    try:
        await asyncio.wait_for(third.wait(), 5)  # both events applied
    finally:
        task.cancel()
    assert store.get("ns", "a")["metadata"]["resourceVersion"] == "14"  # type: ignore[index]
    # The event at 11 came after the write at 12 and was dropped; 14 replaced the write.
    assert told == [("ADDED", "a"), ("MODIFIED", "a"), ("MODIFIED", "a")]


async def test_a_relist_tells_what_changed_and_vanished_while_the_watch_was_down() -> None:
    kube, told = ScriptedKube(), Told()
    kube.lists.append(([pod("a", 5), pod("b", 6), pod("c", 7)], "10"))
    kube.lists.append(([pod("a", 5), pod("b", 16)], "20"))
    store = informer(kube, told)
    await store.relist()
    told.clear()
    await store.relist()
    assert sorted(told) == [("DELETED", "c"), ("MODIFIED", "b")]
    assert [p["metadata"]["name"] for p in store.group("m")] == ["a", "b"]


async def test_run_keeps_readers_off_the_store_until_a_list_succeeds() -> None:
    kube, told = ScriptedKube(), Told()
    kube.lists += [forbidden(), ([pod("a", 5)], "10")]
    store = informer(kube, told)
    listed = asyncio.Event()
    store.on_listed = listed.set
    task = asyncio.create_task(store.run())
    try:
        await asyncio.wait_for(store.attempted.wait(), 5)
        assert not store.synced  # the 403: readers ask the API server themselves
        assert "403" in (store.last_error or "")
        await asyncio.wait_for(listed.wait(), 5)  # the retry after the backoff lists
        assert store.synced
        await asyncio.wait_for(kube.watching.wait(), 5)
        assert kube.watched_from == ["10"]  # from the list's version
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert told == [("ADDED", "a")]


def test_a_handler_that_raises_does_not_stop_the_store() -> None:
    def broken(_event: str, _obj: Any) -> None:
        raise RuntimeError("bug")

    kube = ScriptedKube()
    kube.lists.append(([pod("a", 5)], "10"))
    store = Informer(cast(Kube, kube), POD, on_change=broken)
    assert asyncio.run(store.relist()) == "10"
    assert store.get("ns", "a") is not None


@pytest.mark.parametrize("version", ["abc", None])
def test_versions_that_are_not_numbers_are_never_compared(version: str | None) -> None:
    store = Informer(cast(Kube, ScriptedKube()), POD)
    store.observe(pod("a", 5))
    newer = pod("a", 0)
    newer["metadata"]["resourceVersion"] = version
    store.observe(newer)
    assert store.get("ns", "a")["metadata"]["resourceVersion"] == version  # type: ignore[index]
