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
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from devtools.localplane import (
    ADMIN_USER,
    ComponentExited,
    ControlPlane,
    ControlPlaneError,
    free_port,
    wait_until,
)
from devtools.planecommands import SERVICE_CLUSTER_IP_RANGE
from devtools.procs import raise_if_exited, spawn_component, terminate

NODE_NAME = "real-node"
NODE_WORKDIR = "node"  # under a plane's work directory, for `make demo` / `make cluster-down`
BRIDGE = "pdserve0"
BRIDGE_ADDRESS = "10.244.0.1"  # the node's address and the pods' gateway
POD_CIDR = "10.244.0.0/24"
CNI_NETWORK = "pdserve-real-node"
KUBELET_USER = "system:node:real-node"
PROXY_USER = "system:kube-proxy"
CONTAINERD_NAMESPACE = "k8s.io"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")
# Fixed paths outside the work directory that the node writes to: the kubelet's links to each
# container's log, and libcni's cache of each sandbox's network.
HOST_DIRS = (Path("/var/log/containers"), Path("/var/lib/cni/results"))
REQUIRED_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "iptables",
                     "iptables-save", "conntrack")  # fmt: skip
CNI_PLUGIN_DIR = Path("/usr/lib/cni")
NODE_RULE = re.compile(r"\b(KUBE|CNI)-")


class NodeError(ControlPlaneError):
    """The real node could not be set up, started or torn down."""


class NodeComponentExited(NodeError, ComponentExited):
    """A node process died: waiting longer cannot help."""


def missing_prerequisites() -> list[str]:
    """What this machine lacks for a real node (commands, CNI plugins, root)."""
    missing = [c for c in REQUIRED_COMMANDS if shutil.which(c) is None]
    missing += [
        f"{CNI_PLUGIN_DIR}/{p}"
        for p in ("bridge", "host-local", "loopback")
        if not (CNI_PLUGIN_DIR / p).exists()
    ]
    if os.geteuid() != 0:
        missing.append("root (containers, network namespaces and iptables need it)")
    return missing


def run(args: Sequence[str], *, check: bool = True, timeout: float = 60) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def create_bridge() -> None:
    """The pods' bridge with the node's address: the API server listens on it before the first
    pod exists (the CNI bridge plugin then reuses it)."""
    if run(["ip", "link", "show", BRIDGE], check=False) == "":
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


CLUSTER_DOMAIN = "cluster.local"


@dataclass
class NodePorts:
    dns_health: int = field(default_factory=free_port)
    dns_ready: int = field(default_factory=free_port)
    kubelet: int = field(default_factory=free_port)
    kubelet_healthz: int = field(default_factory=free_port)
    proxy_healthz: int = field(default_factory=free_port)
    proxy_metrics: int = field(default_factory=free_port)


@dataclass
class RealNode:
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

    # ---- paths -------------------------------------------------------------------------------
    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

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
        self.netns_before = set(_netns())
        self.host_entries_before = set(_host_entries())
        try:
            create_bridge()
            self._start_containerd(timeout)
            for archive in images:
                self.ctr("images", "import", "--no-unpack", str(archive), timeout=300)
            self._write_cni_config()
            self._start_dns(timeout)
            self._start_kubelet(timeout)
            self._start_kube_proxy(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop everything and remove what it made; never raises for what is already gone."""
        self._stop_component("kube-proxy")
        self._cleanup_proxy_rules()
        self._stop_component("kubelet")
        self._remove_containers()
        self._stop_component("containerd")
        self._stop_component("coredns")
        self._kill_leftover_shims()
        self._remove_pod_networks()
        self._unmount_all()
        self._remove_cgroups()
        delete_bridge()

    def _stop_component(self, name: str) -> None:
        if (pid := self.pids.pop(name, None)) is not None:
            terminate(pid, self._procs.pop(name, None))

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

    def check_alive(self) -> None:
        raise_if_exited(self._procs, self.logs, NodeComponentExited)

    def ctr(self, *args: str, timeout: float = 60) -> str:
        return run(
            ["ctr", "--address", str(self.containerd_socket), "--namespace",
             CONTAINERD_NAMESPACE, *args],
            timeout=timeout,
        )  # fmt: skip

    # ---- components --------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        proc = spawn_component(name, args, logs=self.logs, cwd=self.workdir)
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _start_containerd(self, timeout: float) -> None:
        base = self._path("containerd")
        config = {
            "version": 2,
            "root": str(base / "root"),
            "state": str(base / "state"),
            "grpc": {"address": str(self.containerd_socket)},
            "debug": {"level": os.environ.get("PDSERVE_NODE_LOG_LEVEL", "info")},
            "ttrpc": {"address": str(base / "containerd.sock.ttrpc")},
            "disabled_plugins": [
                "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
                "io.containerd.internal.v1.tracing", "io.containerd.grpc.v1.introspection",
            ],
            "plugins": {
                "io.containerd.grpc.v1.cri": {
                    "sandbox_image": PAUSE_IMAGE,
                    # Lowering oom_score_adj needs CAP_SYS_RESOURCE, which this machine's root
                    # lacks: the sandbox (-998) and Guaranteed pods get at most containerd's own.
                    "restrict_oom_score_adj": True,
                    "enable_cdi": False,
                    "containerd": {
                        "snapshotter": "overlayfs",
                        "default_runtime_name": "runc",
                        "runtimes": {"runc": {
                            "runtime_type": "io.containerd.runc.v2",
                            "options": {"SystemdCgroup": False},
                        }},
                    },
                    "cni": {"bin_dir": str(CNI_PLUGIN_DIR), "conf_dir": str(self._path("cni"))},
                    # Images come only from `ctr images import`; nothing is pulled.
                    "registry": {"config_path": str(base / "no-registries")},
                },
                "io.containerd.internal.v1.opt": {"path": str(base / "opt")},
            },
        }  # fmt: skip
        base.mkdir(parents=True, exist_ok=True)
        (base / "config.toml").write_text(_toml(config))
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
        config = {
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "hairpinMode": True,
                    # No masquerade: pods only ever talk to this machine.
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": BRIDGE_ADDRESS}]],
                        # No default route: a pod reaches its bridge and, through kube-proxy,
                        # Services; any other address is unreachable, never forwarded on.
                        "routes": [{"dst": SERVICE_CLUSTER_IP_RANGE, "gw": BRIDGE_ADDRESS}],
                        "dataDir": str(self._path("cni-ipam")),
                    },
                },
                {"type": "loopback"},
            ],
        }
        (directory / "10-pdserve.conflist").write_text(json.dumps(config, indent=2))

    def _start_dns(self, timeout: float) -> None:
        """Cluster DNS on the node's address: Service and pod names from the API server; any
        other name is refused, never forwarded."""
        corefile = self._path("Corefile")
        kubeconfig = self.plane.kubeconfig(ADMIN_USER)
        corefile.write_text(
            f"{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{\n"
            f"    bind {BRIDGE_ADDRESS}\n"
            "    errors\n"
            f"    health 127.0.0.1:{self.ports.dns_health}\n"
            f"    ready 127.0.0.1:{self.ports.dns_ready}\n"
            f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
            f"        kubeconfig {kubeconfig}\n"
            "        pods insecure\n"
            "    }\n"
            "}\n"
        )
        binary = str(self.plane.binaries.path("coredns"))
        self._spawn("coredns", [binary, "-conf", str(corefile)])

        self._wait_healthy("cluster DNS", f"http://127.0.0.1:{self.ports.dns_ready}/ready", timeout)

    def _start_kubelet(self, timeout: float) -> None:
        root = self._path("kubelet")
        root.mkdir(parents=True, exist_ok=True)
        resolv = self._path("resolv.conf")
        resolv.write_text("nameserver 127.0.0.1\noptions ndots:1 attempts:1 timeout:1\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This machine's cgroups are v1 (plus a v2 mount): 1.35+ refuses them by default.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "address": BRIDGE_ADDRESS,
            "port": self.ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.ports.kubelet_healthz,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "resolvConf": str(resolv),
            "clusterDNS": [BRIDGE_ADDRESS],
            "clusterDomain": CLUSTER_DOMAIN,
            "podCIDR": POD_CIDR,
            "registerNode": True,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # A developer's disk may be nearly full; pods are not evicted for that here.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%",
                             "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "maxPods": 60,
            "localStorageCapacityIsolation": False,
            "podLogsDir": str(self.pod_logs),
        }  # fmt: skip
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
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.plane.kubeconfig(PROXY_USER))},
            "mode": "iptables",
            "clusterCIDR": POD_CIDR,
            "hostnameOverride": NODE_NAME,
            "bindAddress": BRIDGE_ADDRESS,
            "healthzBindAddress": f"127.0.0.1:{self.ports.proxy_healthz}",
            "metricsBindAddress": f"127.0.0.1:{self.ports.proxy_metrics}",
            # Leave the host's conntrack table size alone.
            "conntrack": {"maxPerCore": 0, "min": 0},
            "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
            "nodePortAddresses": [f"{BRIDGE_ADDRESS}/32"],
        }
        path = self._path("kube-proxy.yaml")
        path.write_text(yaml.safe_dump(config))
        binary = str(self.plane.binaries.path("kube-proxy"))
        self._spawn("kube-proxy", [binary, f"--config={path}", "--v=1"])

        url = f"http://127.0.0.1:{self.ports.proxy_healthz}/healthz"
        self._wait_healthy("kube-proxy", url, timeout)

    def _wait_healthy(self, what: str, url: str, timeout: float) -> None:
        def healthy() -> bool:
            self.check_alive()
            return httpx.get(url, timeout=2).status_code == 200

        wait_until(f"{what} at {url}", healthy, timeout=timeout)

    # ---- teardown ----------------------------------------------------------------------------
    def _cleanup_proxy_rules(self) -> None:
        binary = self.plane.binaries.path("kube-proxy")
        if binary.exists():
            run([str(binary), "--cleanup", "--v=0"], check=False)
        remove_node_iptables_rules()

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

    def _kill_leftover_shims(self) -> None:
        marker = str(self.containerd_socket).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if marker in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)

    def _remove_pod_networks(self) -> None:
        for name in set(_netns()) - self.netns_before:
            run(["ip", "netns", "delete", name], check=False)
        shutil.rmtree(self._path("cni-ipam"), ignore_errors=True)
        for entry in set(_host_entries()) - self.host_entries_before:
            path = Path(entry)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _unmount_all(self) -> None:
        """Every mount under the work directory (pod volumes, rootfs overlays, sandbox shm),
        deepest first."""
        prefix = str(self.workdir.resolve()) + "/"
        for _ in range(3):
            mounts = [m for m in _mount_points() if (m + "/").startswith(prefix)]
            if not mounts:
                return
            for mount in sorted(mounts, key=len, reverse=True):
                run(["umount", "--lazy", mount], check=False)
        raise NodeError(f"mounts left under {self.workdir}: {mounts}")

    def _remove_cgroups(self) -> None:
        """The kubelet's kubepods hierarchy in every cgroup controller, leaves first."""
        for hierarchy in CGROUP_ROOT.iterdir() if CGROUP_ROOT.exists() else ():
            top = hierarchy / "kubepods"
            if not top.is_dir():
                continue
            for directory in sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            ):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


def leftovers(node: RealNode) -> list[str]:
    """What a stopped node would have left behind (for tests of the teardown)."""
    found: list[str] = []
    prefix = str(node.workdir.resolve()) + "/"
    found += [f"mount {m}" for m in _mount_points() if (m + "/").startswith(prefix)]
    found += [f"netns {n}" for n in set(_netns()) - node.netns_before]
    found += [f"file {e}" for e in set(_host_entries()) - node.host_entries_before]
    if run(["ip", "link", "show", BRIDGE], check=False):
        found.append(f"bridge {BRIDGE}")
    veths = run(["ip", "-o", "link", "show", "master", BRIDGE], check=False)
    found += [f"veth {line.split(':')[1].strip()}" for line in veths.splitlines() if line]
    rules = run(["iptables-save"], check=False)
    found += [f"iptables {line}" for line in rules.splitlines() if NODE_RULE.search(line)]
    marker = str(node.containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (proc / "cmdline").read_bytes():
                    found.append(f"process {proc.name}")
    for hierarchy in CGROUP_ROOT.iterdir() if CGROUP_ROOT.exists() else ():
        if (hierarchy / "kubepods").exists():
            found.append(f"cgroup {hierarchy / 'kubepods'}")
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


def remove_node_iptables_rules() -> None:
    """The kubelet's own chains (KUBE-FIREWALL, canaries), which `kube-proxy --cleanup` leaves,
    and anything of kube-proxy's or CNI's left by a process that died: every rule and chain
    named KUBE-* or CNI-*, in IPv4 and IPv6, and nothing else."""
    for save, restore in (("iptables-save", "iptables-restore"),
                          ("ip6tables-save", "ip6tables-restore")):  # fmt: skip
        if shutil.which(save) is None:
            continue
        rules = run([save], check=False)
        kept = [line for line in rules.splitlines() if not NODE_RULE.search(line)]
        if len(kept) != len(rules.splitlines()):
            subprocess.run([restore], input="\n".join(kept) + "\n", text=True, check=False)


def _host_entries() -> list[str]:
    return [str(p) for d in HOST_DIRS if d.is_dir() for p in d.iterdir()]


def _netns() -> list[str]:
    return [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.exists() else []


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        # Spaces and other odd characters in a mount point are octal-escaped.
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]))
    return points


def _toml(table: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for containerd's config: nested tables, strings, numbers, booleans, lists."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return str(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))

    lines = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, sub in table.items():
        if isinstance(sub, dict):
            quoted = json.dumps(key) if "." in key else key  # plugin ids hold dots
            name = f"{prefix}.{quoted}" if prefix else quoted
            out += f"\n[{name}]\n" + _toml(sub, name)
    return out
