"""`pdserve gateway` started the way its pod starts it: the routing ConfigMap the operator writes
(no static endpoints), in-cluster credentials from its service-account token, `POD_NAME`, and the
RBAC the operator gives it. It must find the model's pods and answer through them.

Every other pod of the model runs its own container command (the simulator image's `vllm` is
`pdserve sim vllm`) as a process on a loopback address of its own. The Pod objects sit on a Node
that no kubelet or kwok manages, with the status a kubelet would write, so every address the
gateway learns from the API is on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devtools.clitools import Kubectl
from devtools.localplane import ComponentExited, ControlPlane, wait_until
from pdserve.contract.names import GATEWAY_CONTAINER_PORT

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim-qwen3.yaml"
SERVICE_ACCOUNT_DIR = Path("secrets/kubernetes.io/serviceaccount")  # under /run in a pod
STATIC_NODE = "static-loopback"
# One loopback address per pod; each serves on the port its container declares.
POD_IPS = {"render": "127.0.0.2", "prefill": "127.0.0.3", "decode": "127.0.0.4",
           "gateway": "127.0.0.5"}  # fmt: skip


def manifests(namespace: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "manifests", "-f", str(EXAMPLE), "-n", namespace],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def component(obj: dict[str, Any]) -> str:
    labels: dict[str, str] = obj["metadata"].get("labels", {})
    return labels.get("app.kubernetes.io/component", "")


@pytest.fixture
def static_node(http_api: httpx.Client) -> Iterator[str]:
    """A Node that nothing manages: pods bound to it keep the status the test gives them. It
    is tainted and removed afterwards, so no other test's pods land on it."""
    body = {
        "metadata": {"name": STATIC_NODE, "labels": {"kubernetes.io/hostname": STATIC_NODE}},
        "spec": {"taints": [{"key": "pdserve.io/static", "effect": "NoSchedule"}]},
    }
    created = http_api.post("/api/v1/nodes", json=body)
    assert created.is_success, created.text
    yield STATIC_NODE
    http_api.delete(f"/api/v1/nodes/{STATIC_NODE}")


def start_pod(http: httpx.Client, namespace: str, workload: dict[str, Any], node: str) -> str:
    """A Pod of `workload`'s template (its labels and parity annotation), Running and Ready at
    its loopback address, as a kubelet would report it."""
    name = f"{workload['metadata']['name']}-0"
    template = workload["spec"]["template"]
    body = {
        "metadata": {"name": name, **template["metadata"]},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "unused"}]},
    }
    http.post(f"/api/v1/namespaces/{namespace}/pods", json=body).raise_for_status()
    ip = POD_IPS[component(workload)]
    status = {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }}  # fmt: skip
    http.patch(
        f"/api/v1/namespaces/{namespace}/pods/{name}/status", json=status,
        headers={"Content-Type": "application/merge-patch+json"},
    ).raise_for_status()  # fmt: skip
    return name


def run_container(workload: dict[str, Any], pod: str, log: Path, stack: ExitStack) -> None:
    """The pod's one container as a process: its command line (the simulator image's `vllm` is
    `pdserve sim vllm`), its env with the field references resolved, bound to the pod's IP."""
    ip = POD_IPS[component(workload)]
    [container] = workload["spec"]["template"]["spec"]["containers"]
    fields = {"status.podIP": ip, "metadata.name": pod}
    env = dict(os.environ)
    for var in container.get("env", []):
        env[var["name"]] = var.get("value") or fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    assert container["command"][0] == "vllm", container["command"]
    args = [*container["command"][1:], *container["args"], "--host", ip]
    output = stack.enter_context(log.open("wb"))
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "sim", "vllm", *args],
        env=env, stdout=output, stderr=subprocess.STDOUT,
    )  # fmt: skip
    stack.callback(process.wait, 10)
    stack.callback(process.terminate)


def answers(url: str) -> bool:
    return httpx.get(url, timeout=2).is_success


def service_account_files(
    http: httpx.Client, plane: ControlPlane, namespace: str, account: str, root: Path
) -> None:
    """What the kubelet projects into a pod: a bound token, the cluster CA, the namespace."""
    issued = http.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        json={"spec": {"expirationSeconds": 3600}},
    )
    issued.raise_for_status()
    directory = root / SERVICE_ACCOUNT_DIR
    directory.mkdir(parents=True)
    (directory / "token").write_text(issued.json()["status"]["token"])
    shutil.copy(plane.ca_file, directory / "ca.crt")
    (directory / "namespace").write_text(namespace)


def in_pod_mounts(run_dir: Path, command: list[str]) -> list[str]:
    """Run `command` in a mount namespace of its own whose /run is `run_dir`, so the service
    account files sit where in-cluster clients read them, as in a pod."""
    script = 'mount --bind "$0" /run && exec "$@"'
    mount_ns = ["unshare", "--mount"] if os.geteuid() == 0 else [
        "unshare", "--user", "--map-root-user", "--mount",
    ]  # fmt: skip
    return [*mount_ns, "sh", "-c", script, str(run_dir), *command]


def test_gateway_started_as_its_pod_discovers_pods_with_its_service_account(
    control_plane: ControlPlane,
    http_api: httpx.Client,
    kubectl: Kubectl,
    namespace: str,
    static_node: str,
    tmp_path: Path,
) -> None:
    objects = manifests(namespace)
    gateway_objects = [
        o for o in objects
        if component(o) == "gateway"
        and o["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap")
    ]  # fmt: skip
    kubectl(
        "apply", "--server-side", "-f", "-", check=True,
        stdin="\n---\n".join(yaml.safe_dump(o) for o in gateway_objects),
    )  # fmt: skip
    workloads = {component(o): o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    pods = {role: start_pod(http_api, namespace, workloads[role], static_node) for role in POD_IPS}

    [config_map] = [o for o in gateway_objects if o["kind"] == "ConfigMap"]
    account = config_map["metadata"]["name"]  # the gateway's ServiceAccount has its name
    # The routing config as the pod mounts it: read back from the API, not from the builder.
    read = http_api.get(f"/api/v1/namespaces/{namespace}/configmaps/{account}")
    read.raise_for_status()
    routing = tmp_path / "routing.json"
    routing.write_text(read.json()["data"]["routing.json"])
    config = json.loads(routing.read_text())
    assert "endpoints" not in config

    run_dir = tmp_path / "run"
    service_account_files(http_api, control_plane, namespace, account, run_dir)
    host, port = POD_IPS["gateway"], GATEWAY_CONTAINER_PORT
    env = {
        **{k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
        "POD_NAME": pods["gateway"],
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(control_plane.ports.apiserver),
        "HOME": str(tmp_path),  # no ~/.kube/config to fall back on
    }
    gateway_command = [
        sys.executable, "-m", "pdserve.cli", "gateway", "--config", str(routing),
        "--host", host, "--port", str(port),
    ]  # fmt: skip
    with ExitStack() as stack:
        for role in ("render", "prefill", "decode"):
            run_container(workloads[role], pods[role], tmp_path / f"{role}.log", stack)
        gateway_log = tmp_path / "gateway.log"
        process = subprocess.Popen(
            in_pod_mounts(run_dir, gateway_command), env=env,
            stdout=stack.enter_context(gateway_log.open("wb")), stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(process.wait, 10)
        stack.callback(process.terminate)
        url = f"http://{host}:{port}"

        def ready() -> bool:
            if process.poll() is not None:
                raise ComponentExited(
                    f"the gateway exited with {process.returncode}:\n{gateway_log.read_text()}"
                )
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200

        # Ready only once it has listed the model's pods with its own token and RBAC.
        wait_until("the gateway to discover its pools", ready, timeout=60)
        for role in ("render", "prefill", "decode"):
            health = f"http://{POD_IPS[role]}:8000/health"
            wait_until(f"the {role} pod", partial(answers, health), timeout=60)
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": config["model"], "max_tokens": 8,
                  "messages": [{"role": "user", "content": "hello"}]},
            timeout=30,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        [choice] = answer.json()["choices"]
        # The example turns reasoning on: eight tokens are all spent thinking.
        assert choice["message"]["reasoning"], choice
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert process.poll() is None
