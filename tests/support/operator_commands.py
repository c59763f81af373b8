"""What a DisaggregatedModel's pods would run, as commands on this host: the container command,
arguments and environment the operator builds (pdserve.builders.build_all), untouched except for
what a pod gets from its cluster: its own IP (here loopback), its own port space (the operator
gives every pod port 8000 and NIXL side-channel port 5600; here each process needs free ones),
and the routing config the gateway reads from its ConfigMap (here with static endpoints)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all
from pdserve.contract.names import COMPONENT_LABEL

SERVED_COMPONENTS = ("prefill", "decode", "render")
PORT_FLAG = "--port"
POD_IP = "status.podIP"
SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"


class OperatorCommandError(AssertionError):
    """The operator's objects do not have the shape this harness reads."""


@dataclass(frozen=True)
class PodCommand:
    component: str
    command: list[str]  # the container's command: ["vllm", "serve"] or ["vllm", "launch", ...]
    args: list[str]
    env: dict[str, str]  # literal values; the pod IP as POD_IP's placeholder

    def on_host(
        self, vllm: str, port: int, side_channel_port: int
    ) -> tuple[list[str], dict[str, str]]:
        """argv and environment for one process on this host: the operator's `vllm` on PATH is
        this venv's, the pod port and side-channel port the given ones, the pod IP loopback."""
        if self.command[:1] != ["vllm"]:
            raise OperatorCommandError(f"{self.component}: command {self.command} is not vllm")
        args = list(self.args)
        if PORT_FLAG not in args:
            raise OperatorCommandError(f"{self.component}: no {PORT_FLAG} in {args}")
        args[args.index(PORT_FLAG) + 1] = str(port)
        env = {key: "127.0.0.1" if value == POD_IP else value for key, value in self.env.items()}
        if SIDE_CHANNEL_PORT in env:
            env[SIDE_CHANNEL_PORT] = str(side_channel_port)
        return [vllm, *self.command[1:], *args, "--host", "127.0.0.1"], env


def pod_commands(dm: DisaggregatedModel) -> dict[str, PodCommand]:
    """The vLLM container of each engine and render pool the operator builds for `dm`."""
    found: dict[str, PodCommand] = {}
    for obj in build_all(dm):
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if obj["kind"] not in ("StatefulSet", "Deployment") or component not in SERVED_COMPONENTS:
            continue
        [container] = obj["spec"]["template"]["spec"]["containers"]
        found[component] = PodCommand(
            component, list(container["command"]), list(container["args"]),
            {item["name"]: _env_value(component, item) for item in container.get("env", [])},
        )  # fmt: skip
    return found


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
