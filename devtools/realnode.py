"""A real node for the local control plane: pods that actually run, on this machine only.

containerd and runc (Debian's packages) run the containers, the CNI bridge and host-local plugins
give each pod an address on one Linux bridge of this machine, and the kubelet and kube-proxy are
built from the same Kubernetes release as the control plane (bin-src/build.sh). The API server
listens on the bridge's address, so pods reach it through the `kubernetes` Service that
kube-proxy programs, and it reaches webhooks through their endpoints.

Nothing leaves the machine: pods get bridge addresses only, resolve names with the node's
CoreDNS (cluster names from the API server; every other name refused, never forwarded; pods
with `dnsPolicy: Default` get a resolver on their own loopback), and every image is built here
and imported (images.py), never pulled.

`stop()` leaves nothing behind: no process, mount, network namespace, veth, bridge, cgroup or
iptables rule of the node.

This module starts and stops the node and owns its bridge; nodeconfig.py builds the components'
configuration files, and nodehost.py finds and removes what the node leaves on the machine.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from devtools import nodeconfig, nodehost
from devtools.localplane import (
    ADMIN_USER,
    ComponentExited,
    Components,
    ControlPlane,
    free_port,
    wait_until,
)
from devtools.nodehost import NodeError, run

NODE_NAME = "real-node"
NODE_WORKDIR = "node"  # under a plane's work directory, for `make demo` / `make cluster-down`
BRIDGE = "pdserve0"
BRIDGE_ADDRESS = "10.244.0.1"  # the node's address and the pods' gateway
KUBELET_USER = "system:node:real-node"
PROXY_USER = "system:kube-proxy"
CONTAINERD_NAMESPACE = "k8s.io"
REQUIRED_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "iptables",
                     "iptables-save", "conntrack")  # fmt: skip


class NodeComponentExited(NodeError, ComponentExited):
    """A node process died: waiting longer cannot help."""


def missing_prerequisites() -> list[str]:
    """What this machine lacks for a real node (commands, CNI plugins, root)."""
    missing = [c for c in REQUIRED_COMMANDS if shutil.which(c) is None]
    plugins = nodeconfig.CNI_PLUGIN_DIR
    missing += [
        f"{plugins}/{p}" for p in ("bridge", "host-local", "loopback") if not (plugins / p).exists()
    ]
    if os.geteuid() != 0:
        missing.append("root (containers, network namespaces and iptables need it)")
    return missing


def _bridge_exists() -> bool:
    return run(["ip", "link", "show", BRIDGE], check=False) != ""


def create_bridge() -> None:
    """The pods' bridge with the node's address: the API server listens on it before the first
    pod exists (the CNI bridge plugin then reuses it)."""
    if not _bridge_exists():
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    existing = run(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE])
    if f"{BRIDGE_ADDRESS}/" not in existing:
        run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    # Pod -> Service -> pod on one bridge goes through iptables only with these.
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        Path("/proc/sys", key).write_text(value)


def delete_bridge() -> None:
    run(["ip", "link", "delete", BRIDGE], check=False)


@dataclass
class NodePorts:
    dns_health: int = field(default_factory=free_port)
    dns_ready: int = field(default_factory=free_port)
    kubelet: int = field(default_factory=free_port)
    kubelet_healthz: int = field(default_factory=free_port)
    proxy_healthz: int = field(default_factory=free_port)
    proxy_metrics: int = field(default_factory=free_port)


@dataclass
class RealNode(Components):
    """One kubelet + containerd + kube-proxy node named NODE_NAME, rooted at ``workdir``."""

    plane: ControlPlane
    workdir: Path
    ports: NodePorts = field(default_factory=NodePorts)
    labels: dict[str, str] = field(default_factory=dict)
    # Every component's process id: a node started by another command (`make demo`) is
    # stopped from its saved state (`make cluster-down`).
    pids: dict[str, int] = field(default_factory=dict)
    netns_before: set[str] = field(default_factory=set)
    host_entries_before: set[str] = field(default_factory=set)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _exited: ClassVar[type[ComponentExited]] = NodeComponentExited

    # ---- paths -------------------------------------------------------------------------------
    @property
    def containerd_socket(self) -> Path:
        return containerd_socket(self.workdir)

    @property
    def pod_logs(self) -> Path:
        """The kubelet's podLogsDir: <namespace>_<pod>_<uid>/<container>/<restart>.log, in the
        CRI format (`<time> <stream> <P|F> <text>`)."""
        return self._path("pod-logs")

    def _path(self, *parts: str) -> Path:
        return self.workdir.joinpath(*parts)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, images: Sequence[Path], *, timeout: float = 180.0) -> None:
        """Start containerd, import ``images`` (docker archives), start kubelet and kube-proxy,
        and wait until the node is Ready."""
        if missing := missing_prerequisites():
            raise NodeError("a real node needs: " + ", ".join(missing))
        ensure_no_other_node()
        for directory in (self.workdir, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        # What was there before, so that teardown removes only what this node added.
        self.netns_before = set(nodehost.netns())
        self.host_entries_before = set(nodehost.host_entries())
        try:
            create_bridge()
            self._start_containerd(timeout)
            self.import_images(images)
            self._write_cni_config()
            self._start_dns(timeout)
            self._start_kubelet(timeout)
            self._start_kube_proxy(timeout)
        except BaseException:
            self.stop()
            raise

    def import_images(self, archives: Sequence[Path], *, timeout: float = 900) -> None:
        """Docker archives into the node's containerd, unpacked, as a registry pull would leave
        them (the kubelet never pulls: IfNotPresent finds them)."""
        import_archives(self.workdir, archives, timeout=timeout)

    def trust_registry(self, host: str, ca_file: Path) -> None:
        """Let the kubelet's pulls reach the registry at ``host`` over TLS, trusting ``ca_file``
        (containerd reads the hosts directory at each pull: no restart)."""
        directory = nodeconfig.registry_hosts_dir(self._path("containerd")) / host
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts.toml").write_text(nodeconfig.registry_hosts_toml(host, ca_file))

    def stop(self) -> None:
        """Stop everything and remove what it made; never raises for what is already gone."""
        self._stop_component("kube-proxy")
        self._cleanup_proxy_rules()
        self._stop_component("kubelet")
        self._remove_containers()
        self._stop_component("containerd")
        self._stop_component("coredns")
        # Shims outlive containerd; each was started with its socket on the command line.
        nodehost.kill_processes_mentioning(str(self.containerd_socket))
        nodehost.remove_netns(self.netns_before)
        shutil.rmtree(self._path("cni-ipam"), ignore_errors=True)
        nodehost.remove_host_entries(self.host_entries_before)
        nodehost.unmount_under(self.workdir)
        # Unpacked images are most of the disk the node used (the vLLM image alone ~14 GB
        # imported and unpacked): gone with the node; the logs stay.
        for made in ("containerd", "kubelet"):
            shutil.rmtree(self._path(made), ignore_errors=True)
        nodehost.remove_kubepods_cgroups()
        delete_bridge()

    def save(self) -> None:
        state = {"pids": self.pids, "netns_before": sorted(self.netns_before),
                 "host_entries_before": sorted(self.host_entries_before)}  # fmt: skip
        self._path("node-state.json").write_text(json.dumps(state, indent=2))

    @classmethod
    def saved(cls, plane: ControlPlane, workdir: Path) -> RealNode | None:
        """The node a `save()` left in ``workdir``, to stop it from another process."""
        path = workdir / "node-state.json"
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        return cls(plane=plane, workdir=workdir, pids=state["pids"],
                   netns_before=set(state["netns_before"]),
                   host_entries_before=set(state["host_entries_before"]))  # fmt: skip

    def ctr(self, *args: str, timeout: float = 60) -> str:
        return ctr(self.workdir, *args, timeout=timeout)

    # ---- components --------------------------------------------------------------------------
    def _start_containerd(self, timeout: float) -> None:
        base = self._path("containerd")
        base.mkdir(parents=True, exist_ok=True)
        toml = nodeconfig.containerd_toml(
            base, socket=self.containerd_socket, cni_conf_dir=self._path("cni")
        )
        (base / "config.toml").write_text(toml)
        self._spawn("containerd", ["containerd", "--config", str(base / "config.toml")])

        def serving() -> bool:
            self.check_alive()
            return self.containerd_socket.exists() and "k8s.io" in self.ctr("namespaces", "ls")

        # The CRI plugin creates the k8s.io namespace on start; before that it cannot import.
        with contextlib.suppress(NodeError):
            self.ctr("namespaces", "create", CONTAINERD_NAMESPACE)
        wait_until("containerd", serving, timeout=timeout)

    def _write_cni_config(self) -> None:
        directory = self._path("cni")
        directory.mkdir(parents=True, exist_ok=True)
        config = nodeconfig.cni_conflist(
            bridge=BRIDGE, gateway=BRIDGE_ADDRESS, ipam_dir=self._path("cni-ipam")
        )
        (directory / "10-pdserve.conflist").write_text(json.dumps(config, indent=2))

    def _start_dns(self, timeout: float) -> None:
        corefile = self._path("Corefile")
        corefile.write_text(
            nodeconfig.corefile(
                address=BRIDGE_ADDRESS, health_port=self.ports.dns_health,
                ready_port=self.ports.dns_ready, kubeconfig=self.plane.kubeconfig(ADMIN_USER),
            )
        )  # fmt: skip
        binary = str(self.plane.binaries.path("coredns"))
        self._spawn("coredns", [binary, "-conf", str(corefile)])

        self._wait_healthy("cluster DNS", f"http://127.0.0.1:{self.ports.dns_ready}/ready", timeout)

    def _start_kubelet(self, timeout: float) -> None:
        root = self._path("kubelet")
        root.mkdir(parents=True, exist_ok=True)
        resolv = self._path("resolv.conf")
        resolv.write_text(nodeconfig.POD_RESOLV_CONF)
        config = nodeconfig.kubelet_config(
            address=BRIDGE_ADDRESS, port=self.ports.kubelet,
            healthz_port=self.ports.kubelet_healthz, containerd_socket=self.containerd_socket,
            resolv_conf=resolv, pod_logs=self.pod_logs,
        )  # fmt: skip
        (root / "config.yaml").write_text(yaml.safe_dump(config))
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        self._spawn(
            "kubelet",
            [
                str(self.plane.binaries.path("kubelet")),
                f"--config={root / 'config.yaml'}",
                f"--kubeconfig={self.plane.kubeconfig(KUBELET_USER)}",
                f"--root-dir={root}",
                f"--cert-dir={root / 'pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={BRIDGE_ADDRESS}",
                *([f"--node-labels={labels}"] if labels else []),
                "--v=1",
            ],
        )

        def ready() -> bool:
            self.check_alive()
            with self.plane.http() as http:
                node = http.get(f"/api/v1/nodes/{NODE_NAME}")
                if not node.is_success:
                    return False
                conditions = node.json().get("status", {}).get("conditions", [])
                return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        wait_until(f"node {NODE_NAME} Ready", ready, timeout=timeout)

    def _start_kube_proxy(self, timeout: float) -> None:
        config = nodeconfig.kube_proxy_config(
            kubeconfig=self.plane.kubeconfig(PROXY_USER), node_name=NODE_NAME,
            address=BRIDGE_ADDRESS, healthz_port=self.ports.proxy_healthz,
            metrics_port=self.ports.proxy_metrics,
        )  # fmt: skip
        path = self._path("kube-proxy.yaml")
        path.write_text(yaml.safe_dump(config))
        binary = str(self.plane.binaries.path("kube-proxy"))
        self._spawn("kube-proxy", [binary, f"--config={path}", "--v=1"])

        url = f"http://127.0.0.1:{self.ports.proxy_healthz}/healthz"
        self._wait_healthy("kube-proxy", url, timeout)

    # ---- teardown ----------------------------------------------------------------------------
    def _cleanup_proxy_rules(self) -> None:
        binary = self.plane.binaries.path("kube-proxy")
        if binary.exists():
            run([str(binary), "--cleanup", "--v=0"], check=False)
        nodehost.remove_node_iptables_rules()

    def _remove_containers(self) -> None:
        """Kill every task of the node's containerd and delete its containers, so the shims
        exit; CNI teardown of the sandboxes is done by hand afterwards."""
        if "containerd" not in self.pids or not self.containerd_socket.exists():
            return
        with contextlib.suppress(NodeError, subprocess.TimeoutExpired):
            tasks = self.ctr("tasks", "ls", "-q").split()
            for task in tasks:
                with contextlib.suppress(NodeError):
                    self.ctr("tasks", "kill", "-s", "SIGKILL", task)
            for task in tasks:
                with contextlib.suppress(NodeError):
                    self.ctr("tasks", "delete", "-f", task)
            for container in self.ctr("containers", "ls", "-q").split():
                with contextlib.suppress(NodeError):
                    self.ctr("containers", "delete", container)


GIB = 1 << 30
MARGIN_BYTES = 2 * GIB


def containerd_socket(workdir: Path) -> Path:
    return workdir / "containerd" / "containerd.sock"


def ctr(workdir: Path, *args: str, timeout: float = 60) -> str:
    """`ctr` against the containerd of the node rooted at `workdir` (also one another command
    started, such as `make demo`'s)."""
    return run(
        ["ctr", "--address", str(containerd_socket(workdir)), "--namespace",
         CONTAINERD_NAMESPACE, *args],
        timeout=timeout,
    )  # fmt: skip


def import_archives(workdir: Path, archives: Sequence[Path], *, timeout: float = 900) -> None:
    """Import and unpack each archive once, as a CRI pull leaves an image. Left packed, each
    container the kubelet created from it unpacked the image on its own: the real-vLLM pods,
    starting together, held five 5.8 GB snapshots of the vLLM image's one big layer at once
    (measured: 49 GB in 5 minutes, which filled a CI machine's disk)."""
    ensure_room_for(workdir, archives)
    for archive in archives:
        ctr(workdir, "images", "import", f"--snapshotter={nodeconfig.SNAPSHOTTER}", str(archive),
            timeout=timeout)  # fmt: skip


def ensure_room_for(workdir: Path, archives: Sequence[Path]) -> None:
    """Refuse at once, naming the need, when the node's disk cannot hold the archives imported
    (their layers kept as content) and unpacked: about twice their size, plus a margin for the
    containers' own writes. Found out later it is a pod stuck in CreateContainerError."""
    need = 2 * sum(archive.stat().st_size for archive in archives) + MARGIN_BYTES
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise NodeError(
            f"the node's containerd under {workdir} needs about {need / GIB:.1f} GiB free to "
            f"import and unpack {', '.join(a.name for a in archives)}, and {free / GIB:.1f} GiB "
            "are free: free disk there (old `/tmp/pytest-of-*` runs; `make cluster-down` for a "
            "demo's node), or give the tests a larger disk with TMPDIR"
        )


def leftovers(node: RealNode) -> list[str]:
    """What a stopped node would have left behind (for tests of the teardown)."""
    found: list[str] = []
    found += [f"mount {m}" for m in nodehost.mounts_under(node.workdir)]
    found += [f"netns {n}" for n in set(nodehost.netns()) - node.netns_before]
    found += [f"file {e}" for e in set(nodehost.host_entries()) - node.host_entries_before]
    if _bridge_exists():
        found.append(f"bridge {BRIDGE}")
    veths = run(["ip", "-o", "link", "show", "master", BRIDGE], check=False)
    found += [f"veth {line.split(':')[1].strip()}" for line in veths.splitlines() if line]
    found += [f"iptables {line}" for line in nodehost.node_iptables_rules()]
    found += [
        f"process {pid}" for pid in nodehost.processes_mentioning(str(node.containerd_socket))
    ]
    found += [f"cgroup {cgroup}" for cgroup in nodehost.kubepods_cgroups()]
    return found


def ensure_no_other_node() -> None:
    """One real node per machine: every node uses the same bridge, address and host rules, so
    a second one (a `make demo` node still up) would break the first. Call it before touching
    any of those."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((BRIDGE_ADDRESS, 53))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return  # no bridge address yet: no node
            raise NodeError(
                f"another real node runs on this machine (its DNS holds {BRIDGE_ADDRESS}:53): "
                "stop it first (`make cluster-down` stops the one `make demo` started)"
            ) from error
