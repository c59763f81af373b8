"""`make demo-wide-ep`: the wide-EP example (examples/deepseek-r1-gb200-wide-ep.yaml, unchanged)
on the local plane's twin of a GB200 NVL72 rack, until `kubectl get dm -o wide` shows its
prefill and decode groups Ready.

What runs, as on a GPU cluster with LeaderWorkerSet and NVIDIA's DRA driver installed:
- a local plane (`make cluster-up`'s, with `make cluster-down` to stop it) whose GPU nodes are
  one whole NVL72 rack of kwok trays (devtools.nodes.nvl72_rack: 18 trays in one
  nvidia.com/gpu.clique) and two CPU nodes; a plane running without the rack is replaced;
- the real LeaderWorkerSet controller v0.7.0 with its CRD and webhooks (devtools/lws.py);
- NVIDIA's DRA driver's twin (devtools/dra.py): its ComputeDomain DeviceClasses, each tray's
  channel ResourceSlice, and the channel ResourceClaimTemplate its ComputeDomain controller
  creates for the example's ComputeDomain;
- the CRD applied with kubectl and `pdserve operator` as a process on this machine (kwok runs no
  containers, so the operator cannot run as a pod here);
- the example's prerequisites (namespace `llm`, the `model-store` claim) and `kubectl apply -f`.

kwok marks the pods Running and Ready without running vLLM: what this shows is the operator's
side (groups, placement in one clique, the wiring vLLM reads, status), not serving. No root needed.

    python -m devtools.wide_ep_demo      # or: make demo-wide-ep
    python -m devtools.localplane down   # or: make cluster-down (the operator and LWS too)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from devtools import dra
from devtools.clitools import ToolsError
from devtools.demo import tool
from devtools.localplane import (
    OPERATOR_USER,
    ControlPlane,
    ControlPlaneError,
    Ports,
    build_binaries,
)
from devtools.lws import LwsManager
from devtools.nodes import FakeNode, cpu_node, nvl72_rack
from devtools.planecli import DEFAULT_STATE_DIR, bring_down, bring_up, load_state, record_process
from devtools.procs import pid_alive, spawn_component

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "deepseek-r1-gb200-wide-ep.yaml"
NAMESPACE, MODEL = "llm", "deepseek-r1"
RACK = "nvl72-tray"
MODEL_CLAIM = "model-store"
# The example's placement.resourceClaims template, and the ComputeDomain its header says to
# create (whose UID the channel's config carries).
CHANNEL_TEMPLATE = "deepseek-r1-nvl72-channel"
COMPUTE_DOMAIN_UID = "5e1f0c2a-7d3b-4c69-9a8e-0b1d2c3e4f50"
OPERATOR = "pdserve-operator"
OPERATOR_NAMESPACE = "pdserve-system"
READY_TIMEOUT = "5m"


def attached_plane(state_dir: Path, state: dict[str, Any]) -> ControlPlane:
    """The plane `up` started, to act on from this process (its processes stay `up`'s)."""
    address = urlsplit(state["server"]).hostname or "127.0.0.1"
    return ControlPlane(
        workdir=state_dir, binaries=build_binaries(quiet=True, lws=True), address=address,
        ports=Ports(**state["ports"]), tokens=dict(state["tokens"]), pids=dict(state["pids"]),
    )  # fmt: skip


def kubectl(plane: ControlPlane, *args: str) -> str:
    """Run and show `kubectl args` as the plane's admin; its output, or ControlPlaneError."""
    print(f"$ kubectl {' '.join(args)}")
    return tool(plane.kubeconfig(), "kubectl", *args)


def running(state: dict[str, Any], name: str) -> bool:
    pid = state["pids"].get(name)
    return pid is not None and pid_alive(pid)


def plane_nodes() -> list[FakeNode]:
    """One whole NVL72 rack and two CPU nodes (gateway, render). No smaller GB200 clique: a
    required podAffinity reserves nothing, so a group's leader bound in a clique of two trays
    (`make cluster-up`'s) would leave its workers Pending (docs/placement.md)."""
    return [*nvl72_rack(RACK), cpu_node("cpu-0"), cpu_node("cpu-1")]


def plane_state(state_dir: Path) -> dict[str, Any]:
    """The running plane if it is this demo's (it has the rack), else a new one with
    plane_nodes() in place of whatever ran in `state_dir`."""
    state = load_state(state_dir)
    if state is not None:
        with attached_plane(state_dir, state).http() as http:
            if http.get(f"/api/v1/nodes/{RACK}-00").is_success:
                print(f"reusing the wide-EP plane at {state['server']}")
                return state
        print("the running plane has no NVL72 rack: replacing it")
    bring_down(state_dir)
    return bring_up(state_dir, plane_nodes())


def start_lws(plane: ControlPlane, state_dir: Path, state: dict[str, Any]) -> None:
    """The LeaderWorkerSet controller, its CRD and webhooks, for `down` to stop with the plane."""
    if running(state, "lws-manager"):
        return
    manager = LwsManager(workdir=state_dir / "lws", binaries=plane.binaries, plane=plane)
    manager.start()
    record_process(state_dir, "lws-manager", manager.pids["lws-manager"])
    print(f"LeaderWorkerSet v0.7.0 controller running (log: {manager.logs}/lws-manager.log)")


def install_dra_twin(http: httpx.Client, trays: list[str]) -> None:
    """What NVIDIA's DRA driver publishes, and the channel template the ComputeDomain gives."""
    dra.install_device_classes(http)
    dra.publish_resource_slices(http, trays)
    dra.create_compute_domain_claim_template(
        http, NAMESPACE, CHANNEL_TEMPLATE, domain_uid=COMPUTE_DOMAIN_UID
    )


def start_operator(plane: ControlPlane, state_dir: Path, state: dict[str, Any]) -> None:
    """`pdserve operator` on this machine with the plane's operator kubeconfig."""
    if running(state, OPERATOR):
        return
    args = [sys.executable, "-m", "pdserve.cli", "operator",
            f"--kubeconfig={plane.kubeconfig(OPERATOR_USER)}"]  # fmt: skip
    # Where it keeps the gateways' peer master key (in-cluster: the namespace it runs in).
    env = {"PDSERVE_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE}
    print(f"$ PDSERVE_OPERATOR_NAMESPACE={OPERATOR_NAMESPACE} pdserve operator "
          f"--kubeconfig={plane.kubeconfig(OPERATOR_USER)} &")  # fmt: skip
    process = spawn_component(OPERATOR, args, logs=plane.logs, cwd=state_dir, env=env)
    record_process(state_dir, OPERATOR, process.pid)
    print(f"operator log: {plane.logs / f'{OPERATOR}.log'}")


def model_claim(http: httpx.Client) -> None:
    """The example's `model-store` claim, bound to a PersistentVolume of its own (kwok mounts
    nothing: the volume only has to exist)."""
    pv = f"{NAMESPACE}-{MODEL_CLAIM}"
    bodies = (
        ("/api/v1/persistentvolumes", {
            "metadata": {"name": pv},
            "spec": {"capacity": {"storage": "2Ti"}, "accessModes": ["ReadOnlyMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "nfs": {"server": "192.0.2.10", "path": "/models"},
                     "claimRef": {"namespace": NAMESPACE, "name": MODEL_CLAIM}},
        }),
        (f"/api/v1/namespaces/{NAMESPACE}/persistentvolumeclaims", {
            "metadata": {"name": MODEL_CLAIM},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                     "volumeName": pv, "resources": {"requests": {"storage": "2Ti"}}},
        }),
    )  # fmt: skip
    for path, body in bodies:
        response = http.post(path, json=body)
        if not (response.is_success or response.status_code == 409):
            raise ControlPlaneError(f"creating {path}: {response.text}")


def deploy(plane: ControlPlane, state_dir: Path) -> str:
    """Everything above on the running plane, then the example applied and Ready; returns what
    `kubectl get dm -o wide` prints."""
    state = load_state(state_dir)
    if state is None:
        raise ControlPlaneError(f"no local plane runs in {state_dir}: make cluster-up first")
    trays = [tray.name for tray in nvl72_rack(RACK)]
    print(f"GB200 NVL72 rack: {len(trays)} trays in clique {nvl72_rack(RACK)[0].nvlink_clique}")
    with plane.http() as http:
        start_lws(plane, state_dir, state)
        kubectl(plane, "apply", "--server-side", "-f", str(REPO / "crds"))
        for namespace in (OPERATOR_NAMESPACE, NAMESPACE):
            if http.get(f"/api/v1/namespaces/{namespace}").status_code == 404:
                kubectl(plane, "create", "namespace", namespace)
        start_operator(plane, state_dir, state)
        model_claim(http)
        install_dra_twin(http, trays)
    print(kubectl(plane, "apply", "-f", str(EXAMPLE.relative_to(REPO))).strip())
    kubectl(plane, "wait", "--for=condition=Ready", f"dm/{MODEL}", "-n", NAMESPACE,
            f"--timeout={READY_TIMEOUT}")  # fmt: skip
    table = kubectl(plane, "get", "dm", MODEL, "-n", NAMESPACE, "-o", "wide")
    print(table)
    print(kubectl(plane, "get", "leaderworkersets", "-n", NAMESPACE))
    print(kubectl(plane, "get", "pods", "-n", NAMESPACE, "-o", "wide",
                  "-L", "leaderworkerset.sigs.k8s.io/group-index"))  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = parser.parse_args()
    started = time.monotonic()
    try:
        state = plane_state(args.state_dir)
        deploy(attached_plane(args.state_dir, state), args.state_dir)
    except (ControlPlaneError, ToolsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f}s; export KUBECONFIG={state['kubeconfig']}")
    print("stop it all: make cluster-down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
