"""What a DisaggregatedModel's pods would run, as commands on this host: the container command,
arguments and environment the operator builds (pdserve.builders.build_all), untouched except for
what a pod gets from its cluster: its own IP (here loopback), its own port space (the operator
gives every pod port 8000 and NIXL side-channel port 5600; here each process needs free ones),
and the routing config the gateway reads from its ConfigMap (here with static endpoints).
A PersistentVolumeClaim the test gives a directory for is that directory here: a path the pod
reads under the claim's mount is rewritten to the same file in it.

A multi-node pool (a LeaderWorkerSet) gives one command per worker of a group, with what LWS
and the kubelet add: the LWS webhook's LWS_* variables in the container env, and the kubelet's
expansion of `$(VAR)` in the arguments (--node-rank $(LWS_WORKER_INDEX), ...)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all
from pdserve.builders.leaderworkerset import KIND as LWS_KIND
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.contract.names import COMPONENT_LABEL

SERVED_COMPONENTS = ("prefill", "decode", "render")
PORT_FLAG = "--port"
POD_IP = "status.podIP"
SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
RPC_PORT_FLAG = "--data-parallel-rpc-port"
# On loopback every "node" of a group is this host: the leader's address is loopback too.
LEADER_ADDRESS = "127.0.0.1"
# The kubelet's $(VAR) reference in args; $$ escapes a literal $.
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class OperatorCommandError(AssertionError):
    """The operator's objects do not have the shape this harness reads."""


@dataclass(frozen=True)
class PodCommand:
    component: str
    command: list[str]  # the container's command: ["vllm", "serve"] or ["vllm", "launch", ...]
    args: list[str]
    env: dict[str, str]  # literal values; the pod IP as POD_IP's placeholder
    worker: int | None = None  # the LWS worker index of a multi-node pool's pod

    @property
    def data_parallel_size(self) -> int:
        """--data-parallel-size: the ranks of the whole replica (NIXL listens on base + rank)."""
        if "--data-parallel-size" in self.args:
            return int(self.args[self.args.index("--data-parallel-size") + 1])
        return 1

    def on_host(
        self, vllm: str, port: int, side_channel_port: int, rpc_port: int | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """argv and environment for one process on this host: the operator's `vllm` on PATH is
        this venv's, the pod port and side-channel port the given ones, the pod IP loopback; a
        multi-node pod's data-parallel RPC port `rpc_port` (one per group, not the operator's
        fixed one, which another test on this host may hold)."""
        if self.command[:1] != ["vllm"]:
            raise OperatorCommandError(f"{self.component}: command {self.command} is not vllm")
        args = list(self.args)
        if PORT_FLAG not in args:
            raise OperatorCommandError(f"{self.component}: no {PORT_FLAG} in {args}")
        args[args.index(PORT_FLAG) + 1] = str(port)
        if RPC_PORT_FLAG in args:
            if rpc_port is None:
                raise OperatorCommandError(f"{self.component}: {RPC_PORT_FLAG} needs a port")
            args[args.index(RPC_PORT_FLAG) + 1] = str(rpc_port)
        env = {key: "127.0.0.1" if value == POD_IP else value for key, value in self.env.items()}
        if SIDE_CHANNEL_PORT in env:
            env[SIDE_CHANNEL_PORT] = str(side_channel_port)
        return [vllm, *self.command[1:], *args, "--host", "127.0.0.1"], env


def pod_commands(
    dm: DisaggregatedModel, claims: Mapping[str, Path] | None = None
) -> dict[str, PodCommand]:
    """The vLLM container of each engine and render pool the operator builds for `dm`, by
    component; a multi-node pool's by `<component>-<worker index>`, one per pod of a group.
    `claims`: the directory on this host holding each named PersistentVolumeClaim's files."""
    found: dict[str, PodCommand] = {}
    for obj in build_all(dm):
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if component not in SERVED_COMPONENTS:
            continue
        if obj["kind"] in ("StatefulSet", "Deployment"):
            found[component] = _pod_command(component, obj, claims or {})
        elif obj["kind"] == LWS_KIND:
            for pod in _group_commands(component, obj, claims or {}):
                found[f"{component}-{pod.worker}"] = pod
    return found


def _pod_command(
    component: str, workload: Mapping[str, Any], claims: Mapping[str, Path]
) -> PodCommand:
    pod = pod_template_of(workload)["spec"]
    [container] = pod["containers"]
    on_host = _claim_paths(pod, container, claims)
    return PodCommand(
        component, list(container["command"]),
        [_host_path(arg, on_host) for arg in container["args"]],
        {item["name"]: _host_path(_env_value(component, item), on_host)
         for item in container.get("env", [])},
    )  # fmt: skip


def _claim_paths(
    pod: Mapping[str, Any], container: Mapping[str, Any], claims: Mapping[str, Path]
) -> dict[str, str]:
    """The container's mount path of each claim given in `claims` (its subPath, if any) -> the
    same directory on this host."""
    claim_of = {
        volume["name"]: volume["persistentVolumeClaim"]["claimName"]
        for volume in pod.get("volumes", [])
        if "persistentVolumeClaim" in volume
    }
    return {
        mount["mountPath"]: str(claims[claim_of[mount["name"]]] / mount.get("subPath", ""))
        for mount in container.get("volumeMounts", [])
        if claim_of.get(mount["name"]) in claims
    }


def _host_path(value: str, on_host: Mapping[str, str]) -> str:
    """`value` with every path under a mount in `on_host` moved to its directory here (a whole
    path component: /a/b is not under /a/bc); values that hold one in JSON too."""
    for mount, directory in on_host.items():
        value = re.sub(re.escape(mount) + r'(?=$|[/"])', directory.replace("\\", r"\\"), value)
    return value


def _group_commands(
    component: str, lws: Mapping[str, Any], claims: Mapping[str, Path]
) -> Iterator[PodCommand]:
    """Each worker of one group: the LWS webhook's env, then the kubelet's expansion of the
    arguments with the container's env (command too, as the kubelet does)."""
    template = _pod_command(component, lws, claims)
    size = int(lws["spec"]["leaderWorkerTemplate"]["size"])
    for worker in range(size):
        env = {**template.env, **lws_env(worker, size)}
        yield PodCommand(
            component, [kubelet_expand(arg, env) for arg in template.command],
            [kubelet_expand(arg, env) for arg in template.args], env, worker,
        )  # fmt: skip


def lws_env(worker: int, size: int) -> dict[str, str]:
    """What LWS v0.7.0's pod webhook injects into every container of a group's pod."""
    return {
        "LWS_LEADER_ADDRESS": LEADER_ADDRESS,
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker),
    }


def kubelet_expand(value: str, env: Mapping[str, str]) -> str:
    """$(VAR) replaced by the container env's VAR, left as written when VAR is not set; $$ is a
    literal $ (Kubernetes' dependent environment variable expansion)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(one, value)


def _env_value(component: str, item: Mapping[str, Any]) -> str:
    if "value" in item:
        return str(item["value"])
    field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if field == POD_IP:
        return POD_IP
    raise OperatorCommandError(f"{component}: env {item['name']} comes from {item['valueFrom']}")


def routing_config(dm: DisaggregatedModel) -> dict[str, Any]:
    """The routing config the operator writes into the gateway's ConfigMap."""
    for obj in build_all(dm):
        if obj["kind"] == "ConfigMap" and "routing.json" in obj.get("data", {}):
            config: dict[str, Any] = json.loads(obj["data"]["routing.json"])
            return config
    raise OperatorCommandError(f"{dm.metadata.name}: no ConfigMap with routing.json")
