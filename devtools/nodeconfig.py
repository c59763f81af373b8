"""The configuration files of the real node's components: containerd's config.toml, the CNI
network, CoreDNS's Corefile, the kubelet's KubeletConfiguration and kube-proxy's
KubeProxyConfiguration.

Each is built from the node's addresses, ports and paths, which realnode.RealNode passes in; it
writes the files and starts the processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from devtools.planecommands import SERVICE_CLUSTER_IP_RANGE

POD_CIDR = "10.244.0.0/24"
CNI_NETWORK = "pdserve-real-node"
CNI_PLUGIN_DIR = Path("/usr/lib/cni")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CLUSTER_DOMAIN = "cluster.local"


# The CRI plugin's snapshotter, which `ctr images import` must unpack into too (realnode.py).
SNAPSHOTTER = "overlayfs"


def registry_hosts_dir(base: Path) -> Path:
    """containerd's hosts directory (config_path): one <host:port>/hosts.toml per registry."""
    return base / "certs.d"


def registry_hosts_toml(host: str, ca_file: Path) -> str:
    """A registry reached over HTTPS at ``host``, its certificate signed by ``ca_file``: what
    containerd's hosts.toml says for a private registry with a private CA."""
    return _toml({
        "server": f"https://{host}",
        "host": {f"https://{host}": {"capabilities": ["pull", "resolve"], "ca": str(ca_file)}},
    })  # fmt: skip


def containerd_toml(base: Path, *, socket: Path, cni_conf_dir: Path) -> str:
    """containerd with its root, state and sockets under ``base``, and the CRI plugin set up
    for the kubelet: runc with cgroupfs, the CNI network in ``cni_conf_dir``, registries only
    as listed in ``registry_hosts_dir``."""
    config = {
        "version": 2,
        "root": str(base / "root"),
        "state": str(base / "state"),
        "grpc": {"address": str(socket)},
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
                    "snapshotter": SNAPSHOTTER,
                    "default_runtime_name": "runc",
                    "runtimes": {"runc": {
                        "runtime_type": "io.containerd.runc.v2",
                        "options": {"SystemdCgroup": False},
                    }},
                },
                "cni": {"bin_dir": str(CNI_PLUGIN_DIR), "conf_dir": str(cni_conf_dir)},
                # Images come from `ctr images import`, or from a registry this node was told
                # to trust (RealNode.trust_registry writes its hosts.toml here, as into
                # /etc/containerd/certs.d on a real node); nothing else is reachable.
                "registry": {"config_path": str(registry_hosts_dir(base))},
            },
            "io.containerd.internal.v1.opt": {"path": str(base / "opt")},
        },
    }  # fmt: skip
    return _toml(config)


def cni_conflist(*, bridge: str, gateway: str, ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "hairpinMode": True,
                # No masquerade: pods only ever talk to this machine.
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": gateway}]],
                    # No default route: a pod reaches its bridge and, through kube-proxy,
                    # Services; any other address is unreachable, never forwarded on.
                    "routes": [{"dst": SERVICE_CLUSTER_IP_RANGE, "gw": gateway}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "loopback"},
        ],
    }


def corefile(*, address: str, health_port: int, ready_port: int, kubeconfig: Path) -> str:
    """Cluster DNS on ``address``: Service and pod names from the API server; any other name is
    refused, never forwarded."""
    return (
        f"{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{\n"
        f"    bind {address}\n"
        "    errors\n"
        f"    health 127.0.0.1:{health_port}\n"
        f"    ready 127.0.0.1:{ready_port}\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"        kubeconfig {kubeconfig}\n"
        "        pods insecure\n"
        "    }\n"
        "}\n"
    )


# The kubelet's resolvConf, which `dnsPolicy: Default` pods get: a resolver on their own
# loopback, never this machine's, so no name is resolved off the machine.
POD_RESOLV_CONF = "nameserver 127.0.0.1\noptions ndots:1 attempts:1 timeout:1\n"


def kubelet_config(
    *, address: str, port: int, healthz_port: int, containerd_socket: Path, resolv_conf: Path,
    pod_logs: Path,
) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine's cgroups are v1 (plus a v2 mount): 1.35+ refuses them by default.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{containerd_socket}",
        "resolvConf": str(resolv_conf),
        "clusterDNS": [address],
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
        "podLogsDir": str(pod_logs),
    }  # fmt: skip


def kube_proxy_config(
    *, kubeconfig: Path, node_name: str, address: str, healthz_port: int, metrics_port: int
) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": node_name,
        "bindAddress": address,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # Leave the host's conntrack table size alone.
        "conntrack": {"maxPerCore": 0, "min": 0},
        "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
        "nodePortAddresses": [f"{address}/32"],
    }


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
