"""The kubelet's last step for the pods on kwok's fake nodes: a pod being deleted is removed for
good with its UID as the precondition, so that only that pod goes.

kwok (v0.8.0, and its main branch today) finishes a deletion by name (`pod_controller.go`,
`stage_controller.go`: `Delete(ctx, name, NewDeleteOptions(0))`, no precondition). A late replay
of an old pod's deletion then removes the pod a StatefulSet has just created under the same
name, which a real kubelet cannot do: its status manager deletes with the pod's UID as the
precondition since kubernetes/kubernetes#25224. With LeaderWorkerSet's RecreateGroupOnPodRestart
each such deletion recreates a whole group, and the next one again (measured on the local plane:
one decode group recreated 16 times in 15 s of an engine upgrade, so a rolling-upgrade test saw
states no real cluster shows). kwok still plays every other stage (devtools/kwok-stages.yaml);
this process replaces its delete stage, and leaves finalizers to their owners, as a kubelet does.

Run by devtools.localplane.ControlPlane as one of the plane's components."""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

RETRY_SECONDS = 0.5  # after a watch breaks (the API server restarted, a network blip)
WATCH_SECONDS = 300


class PodFinisher:
    """Watches every pod; removes each one that is being deleted on a node carrying the kwok
    annotation (the nodes kwok plays), with its UID as the precondition."""

    def __init__(self, client: httpx.Client, node_annotation: tuple[str, str]) -> None:
        self.client = client
        self.node_annotation = node_annotation
        self.kwok_nodes: set[str] = set()  # kwok's nodes never turn into real ones

    def on_kwok_node(self, pod: dict[str, Any]) -> bool:
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            return False  # unbound pods are removed by the API server itself
        if node in self.kwok_nodes:
            return True
        response = self.client.get(f"/api/v1/nodes/{node}")
        if response.status_code != 200:
            return False
        key, value = self.node_annotation
        annotations = response.json()["metadata"].get("annotations", {})
        if annotations.get(key) == value:
            self.kwok_nodes.add(node)
            return True
        return False

    def finish(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if not meta.get("deletionTimestamp") or not self.on_kwok_node(pod):
            return
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                   "preconditions": {"uid": meta["uid"]}}  # fmt: skip
        response = self.client.request(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            json=options,
        )  # fmt: skip
        # 404: already gone; 409: the name now belongs to a newer pod, which stays.
        if response.status_code not in (200, 202, 404, 409):
            print(f"deleting {meta['namespace']}/{meta['name']}: {response.status_code} "
                  f"{response.text[:200]}", flush=True)  # fmt: skip

    def relist(self) -> str:
        """Finish every pod being deleted now; the list's resourceVersion to watch from."""
        listed = self.client.get("/api/v1/pods")
        listed.raise_for_status()
        body = listed.json()
        for pod in body["items"]:
            self.finish(pod)
        return str(body["metadata"]["resourceVersion"])

    def events(self, version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        params = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_SECONDS)}  # fmt: skip
        with self.client.stream(
            "GET", "/api/v1/pods", params=params, timeout=httpx.Timeout(10.0, read=None)
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line:
                    event = json.loads(line)
                    yield str(event["type"]), event["object"]

    def run(self, ready_file: Path) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = self.relist()
                    if not ready_file.exists():
                        ready_file.write_text("watching\n")
                for kind, pod in self.events(version):
                    if kind == "ERROR":  # the version expired (410 Gone): list again
                        version = None
                        break
                    version = pod["metadata"]["resourceVersion"]
                    if kind in ("ADDED", "MODIFIED"):
                        self.finish(pod)
            except httpx.HTTPError as error:
                print(f"watch broken ({error}); listing again", flush=True)
                time.sleep(RETRY_SECONDS)
                version = None


def client_from_kubeconfig(path: Path) -> httpx.Client:
    config = yaml.safe_load(path.read_text())
    cluster = config["clusters"][0]["cluster"]
    token = config["users"][0]["user"]["token"]
    return httpx.Client(
        base_url=cluster["server"], headers={"Authorization": f"Bearer {token}"},
        verify=ssl.create_default_context(cafile=cluster["certificate-authority"]), timeout=10.0,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pod_finisher", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node-annotation", required=True, help="key=value of kwok's nodes")
    parser.add_argument("--ready-file", type=Path, required=True,
                        help="written once the first list is done")  # fmt: skip
    args = parser.parse_args(argv)
    key, _, value = args.node_annotation.partition("=")
    with client_from_kubeconfig(args.kubeconfig) as client:
        PodFinisher(client, (key, value)).run(args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
