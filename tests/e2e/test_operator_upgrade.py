"""The operator upgraded by `helm upgrade` from a real earlier version of this repository (its
chart and image built from git history) to this one under steady load, on the real node; both
images pushed to a real registry (as README's quick start has users push them to their own) and
named by digest, which the node pulls over TLS trusting the registry's CA. No request fails,
every apply keeps being admitted (every replica serves the webhook), the new replicas take the
leader Lease, and of the model's children only what needed it is rewritten: the gateway
Deployment's image, which follows the operator's own (spec.image.gateway names none), while the
engines are neither rewritten nor replaced."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from devtools.images import EARLIER_COMMIT as EARLIER
from devtools.images import Builder, earlier_image, image_cache
from devtools.localplane import wait_until
from devtools.publish import publish, push
from devtools.registry import Registry
from pdserve.contract.names import CONFIG_HASH_ANNOTATION, LEADER_LEASE_NAME
from tests.support.realcluster import (
    CHART,
    EXAMPLE,
    MODEL_NAMESPACE,
    RELEASE_NAMESPACE,
    Cluster,
    operator_logs,
    pods,
    ready,
    sigkill,
)
from tests.support.rollout_load import GatewayLogs, Load, logged_requests, request_log_on, running

OPERATOR = "app.kubernetes.io/name=pdserve"
ROOT = Path(__file__).resolve().parents[2]


def children(cluster: Cluster) -> dict[str, Any]:
    """Each of the model's workloads by kind/name: its spec and applied hash, replicas aside
    (the Builtin render autoscaler may scale under the load)."""
    listed = json.loads(cluster.kubectl(
        "get", "statefulsets,deployments", "-n", MODEL_NAMESPACE, "-l",
        "app.kubernetes.io/instance=sim-qwen3", "-o", "json").stdout)  # fmt: skip
    return {
        f"{o['kind']}/{o['metadata']['name']}": (
            {k: v for k, v in o["spec"].items() if k != "replicas"},
            o["metadata"]["annotations"].get("pdserve.io/applied-hash"),
        )
        for o in listed["items"]
    }


def engine_pods(cluster: Cluster) -> set[str]:
    """The uids of the engine pods (no autoscaler adds or removes them here)."""
    return {p["metadata"]["uid"] for p in pods(cluster, MODEL_NAMESPACE,
            "app.kubernetes.io/component in (prefill,decode)")}  # fmt: skip


GATEWAY = "Deployment/sim-qwen3-gateway"


def gateway_image(children: dict[str, Any]) -> str:
    spec, _ = children[GATEWAY]
    return str(spec["template"]["spec"]["containers"][0]["image"])


def without_gateway_image(children: dict[str, Any]) -> dict[str, Any]:
    """The children as compared across the upgrade: the gateway's image and applied hash aside,
    its routing file's hash (CHANGELOG.md's upgrade note: this version writes the file as
    schema version 3, which rolls the gateways, as their new image does anyway) and its
    `--data-plane` (the upgrade note: every gateway pod serves through the data plane now)."""
    spec, _ = children[GATEWAY]
    metadata = spec["template"].get("metadata", {})
    annotations = {k: v for k, v in metadata.get("annotations", {}).items()
                   if k != CONFIG_HASH_ANNOTATION}  # fmt: skip
    template = {**spec["template"], "metadata": {**metadata, "annotations": annotations},
                "spec": {**spec["template"]["spec"], "containers": [
        {k: without_data_plane(v) if k == "args" else v for k, v in c.items() if k != "image"}
        for c in spec["template"]["spec"]["containers"]
    ]}}  # fmt: skip
    return {**children, GATEWAY: ({**spec, "template": template}, None)}


def without_data_plane(args: list[str]) -> list[str]:
    if "--data-plane" not in args:
        return args
    at = args.index("--data-plane")
    return args[:at] + args[at + 2 :]


def image_of(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["image"])


def holder(cluster: Cluster) -> str:
    lease = json.loads(cluster.kubectl("get", "lease", LEADER_LEASE_NAME, "-n",
                                       RELEASE_NAMESPACE, "-o", "json").stdout)  # fmt: skip
    return str(lease["spec"].get("holderIdentity", ""))


class Applies:
    """`kubectl apply --dry-run=server` of the example, again and again: the API server calls the
    webhook each time (failurePolicy Fail: no replica serving it refuses the apply)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.sent, self.failures = cluster, 0, list[str]()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            applied = self.cluster.kubectl(
                "apply", "--dry-run=server", "-f", str(EXAMPLE), check=False, timeout=60
            )
            self.sent += 1
            if applied.returncode != 0:
                self.failures.append(applied.stderr.strip())
            self.stop.wait(0.5)


def operators_on(cluster: Cluster, image: str, replaced: set[str]) -> bool:
    """Every operator replica is new (none of `replaced`), Ready, runs `image`, one leads."""
    now = pods(cluster, RELEASE_NAMESPACE, OPERATOR)
    names = {p["metadata"]["name"] for p in now}
    return (
        bool(now) and not names & replaced and holder(cluster) in names
        and all(ready(p) and image_of(p) == image for p in now)
    )  # fmt: skip


def gateways_on(cluster: Cluster, image: str) -> bool:
    now = pods(cluster, MODEL_NAMESPACE, "app.kubernetes.io/component=gateway")
    return bool(now) and all(ready(p) and image_of(p) == image for p in now)


def operator_names(cluster: Cluster) -> set[str]:
    return {p["metadata"]["name"] for p in pods(cluster, RELEASE_NAMESPACE, OPERATOR)}


def chart_at(commit: str, into: Path) -> Path:
    """charts/pdserve as it was at `commit`."""
    tarball = into / "chart.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tarball), commit,
                    "charts/pdserve"], check=True)  # fmt: skip
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(into)], check=True)
    return into / "charts" / "pdserve"


def test_helm_upgrade_from_the_earlier_version_under_load_loses_nothing_and_rewrites_nothing(
    cluster: Cluster, registry: Registry, model: str, tmp_path: Path
) -> None:
    request_log_on(cluster)
    wait_until("the model's children settled", lambda: all(
        ready(p) for p in pods(cluster, MODEL_NAMESPACE)), timeout=120, interval=1)  # fmt: skip
    wanted = children(cluster)  # as this version's operator makes them
    # Both versions' images pushed to the team's own registry (as `make push-images` does)
    # and installed from there by digest: references the node has never seen, so it pulls.
    published = publish(f"{registry.host}/team", cert_dir=registry.client_cert_dir())
    pushed = published.pdserve.reference
    earlier_name, earlier_archive = earlier_image()
    earlier = push(Builder(image_cache()), earlier_name, earlier_archive,
                   f"{registry.host}/team/pdserve", cert_dir=registry.client_cert_dir(),
                   tls_verify=True)  # fmt: skip
    earlier_values = ["--set", f"image.repository={earlier.repository}",
                      "--set", f"image.tag={earlier.tag}",
                      "--set", f"image.digest={earlier.digest}"]  # fmt: skip

    # The starting point: the earlier version's chart and operator with the values the user
    # gave (not this chart's defaults, which the earlier schema may not know), settled.
    replaced = operator_names(cluster)
    given = tmp_path / "values.yaml"
    given.write_text(cluster.helm("get", "values", "pdserve", "-n", RELEASE_NAMESPACE,
                                  "-o", "yaml").stdout)  # fmt: skip
    cluster.helm("upgrade", "pdserve", str(chart_at(EARLIER, tmp_path)), "-n", RELEASE_NAMESPACE,
                 "--reset-values", "-f", str(given), *earlier_values, "--wait",
                 "--timeout", "3m")  # fmt: skip
    wait_until("the earlier operator, one replica leading",
               lambda: operators_on(cluster, earlier.reference, replaced),
               timeout=180, interval=1)  # fmt: skip
    wait_until("the gateways on the earlier operator's image",
               lambda: gateways_on(cluster, earlier.reference), timeout=180,
               interval=1)  # fmt: skip
    wait_until("the model's pods Ready under the earlier operator", lambda: all(
        ready(p) for p in pods(cluster, MODEL_NAMESPACE)), timeout=180, interval=1)  # fmt: skip
    before_children = children(cluster)
    model_pods = engine_pods(cluster)
    old_operators = operator_names(cluster)

    load, applies = Load(model), Applies(cluster)
    logs = GatewayLogs(cluster.node.pod_logs, MODEL_NAMESPACE)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    with running((logs.follow, logs.stop), (applies.run, applies.stop), *workers):
        wait_until("steady load", lambda: len(load.sent) >= 10 and applies.sent >= 2, timeout=60)
        started = time.monotonic()
        cluster.helm(
            "upgrade", "pdserve", str(CHART), "-n", RELEASE_NAMESPACE, "--reuse-values",
            *published.helm_values(), "--wait", "--timeout", "3m",
        )  # fmt: skip
        wait_until("the new operator replicas, one leading",
                   lambda: operators_on(cluster, pushed, old_operators),
                   timeout=120, interval=1)  # fmt: skip
        upgrade_seconds = time.monotonic() - started
        wait_until("the gateways on the new operator's image",
                   lambda: gateways_on(cluster, pushed), timeout=180, interval=1)  # fmt: skip
        # A pass of the new leader over the model (any change would be written by now).
        cluster.kubectl("annotate", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--overwrite",
                        f"pdserve.test/touched={time.time()}")  # fmt: skip
        during, applied = len(load.sent), applies.sent
        wait_until("requests and applies after the upgrade", lambda: len(load.sent) >= during + 10
                   and applies.sent >= applied + 4, timeout=60)  # fmt: skip
        entries = logged_requests(load, logs)
    logs.close()

    refused = len(applies.failures)
    print(f"operator upgrade from {EARLIER[:12]} {upgrade_seconds:.1f}s, {len(entries)} requests, "
          f"{len(load.failures)} failed, {applies.sent} applies, {refused} refused")  # fmt: skip
    assert load.failures == [], load.failures[:5]
    assert applies.failures == [], applies.failures[:3]
    after_children = children(cluster)
    assert gateway_image(before_children) == earlier.reference
    assert gateway_image(after_children) == pushed
    # What this version makes, and of it only what the earlier version made otherwise written:
    # the gateway's image here, as long as the two versions build the same children.
    assert without_gateway_image(after_children) == without_gateway_image(wanted), operator_logs(
        cluster
    )
    assert without_gateway_image(after_children) == without_gateway_image(before_children), (
        "the earlier version builds these children otherwise: name what changed in the "
        "upgrade notes (CHANGELOG.md) and compare only the rest here"
    )
    assert engine_pods(cluster) == model_pods
    # Pulled from the registry: the kubelet reports the digest it stored there.
    for pod in pods(cluster, RELEASE_NAMESPACE, OPERATOR):
        status = pod["status"]["containerStatuses"][0]
        assert status["imageID"].endswith(published.pdserve.digest), status
    assert "team/pdserve" in registry.pulled_by_containerd(), registry.logs


def generations(cluster: Cluster) -> dict[str, int]:
    """Every child of the model by kind/name: its generation (each write to its spec adds 1)."""
    listed = json.loads(cluster.kubectl(
        "get", "statefulsets,deployments,poddisruptionbudgets,services", "-n", MODEL_NAMESPACE,
        "-l", "app.kubernetes.io/instance=sim-qwen3", "-o", "json").stdout)  # fmt: skip
    return {f"{o['kind']}/{o['metadata']['name']}": int(o["metadata"].get("generation", 0))
            for o in listed["items"]}  # fmt: skip


def test_leader_killed_mid_reconcile_loses_nothing_and_writes_nothing_twice(
    cluster: Cluster, model: str
) -> None:
    """A spec change, and the leader SIGKILLed at once, most likely in the middle of the pass
    that applies it (no Lease released: the next leader, the other replica or the restarted
    one, takes it after the lease duration) and finishes the pass; each child is written at
    most once for the one change, and the model reaches it."""
    before = generations(cluster)
    gateways = json.loads(cluster.kubectl("get", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE,
                                          "-o", "json").stdout)["spec"]["gateway"]  # fmt: skip
    wanted = int(gateways.get("replicas", 2)) + 1
    killed = holder(cluster)
    load = Load(model)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    with running(*workers):
        wait_until("steady load", lambda: len(load.sent) >= 10, timeout=60)
        cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge",
                        "-p", json.dumps({"spec": {"gateway": {"replicas": wanted}}}))  # fmt: skip
        sigkill(cluster, RELEASE_NAMESPACE, killed)
        started = time.monotonic()

        def reached() -> bool:
            dm = json.loads(cluster.kubectl("get", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE,
                                            "-o", "json").stdout)  # fmt: skip
            status = dm.get("status", {})
            return (
                status.get("observedGeneration") == dm["metadata"]["generation"]
                and status.get("pools", {}).get("gateway", {}).get("ready") == wanted
                and holder(cluster) != ""
            )

        wait_until("the change carried out by the next leader", reached, timeout=120, interval=1)
        took = time.monotonic() - started
    after = generations(cluster)
    written = {name: after[name] - before.get(name, 0) for name in after}
    print(
        f"leader {killed} killed mid-reconcile, {holder(cluster)} leads; change done {took:.1f}s "
        "later; "
        f"{len(load.sent)} requests, {len(load.failures)} failed; writes {written}"
    )
    assert load.failures == [], load.failures[:5]
    assert written["Deployment/sim-qwen3-gateway"] == 1, written
    assert all(count <= 1 for count in written.values()), written
    cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge",
                    "-p", json.dumps({"spec": {"gateway": {"replicas": wanted - 1}}}))  # fmt: skip
