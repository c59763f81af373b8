"""Nodes and namespaces a cluster test module holds for itself on the session's plane, gone
after it: pods first (kwok finishes a pod's deletion only while it manages the pod's node)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import httpx

from devtools.localplane import wait_until
from devtools.nodes import FakeNode, create_nodes, wait_nodes_ready


@contextlib.contextmanager
def nodes_held(http: httpx.Client, nodes: Iterable[FakeNode]) -> Iterator[list[str]]:
    """The nodes, Ready; deleted on exit."""
    names = create_nodes(http, nodes)
    try:
        wait_nodes_ready(http, names, timeout=60)
        yield names
    finally:
        for name in names:
            http.delete(f"/api/v1/nodes/{name}")


@contextlib.contextmanager
def namespace_held(http: httpx.Client, name: str) -> Iterator[str]:
    """The namespace; on exit deleted, and waited for until its pods are gone."""
    http.post("/api/v1/namespaces", json={"metadata": {"name": name}}).raise_for_status()
    try:
        yield name
    finally:
        http.delete(f"/api/v1/namespaces/{name}")
        wait_until(
            f"the pods of namespace {name} to go",
            lambda: not http.get(f"/api/v1/namespaces/{name}/pods").json().get("items"),
            timeout=60,
        )
