"""The local demo (README's main job), as a user would do it on a real cluster: a local control
plane with a real node (pods really run, from images built here), `helm install` of the chart
(the operator runs as a pod), `kubectl apply -f examples/sim-qwen3.yaml`, `kubectl wait` for
Ready, and one chat completion through the model's gateway Service with the OpenAI SDK.

With --vllm, the second step: the same cluster then runs examples/vllm-cpu-tiny.yaml instead,
real vLLM's CPU build in every pod (devtools/vllm_image.py) serving a tiny model trained here
from a PersistentVolumeClaim (devtools/model_volume.py), prefill -> decode over NIXL.

    python -m devtools.demo              # or: make demo (root: the node runs containers)
    python -m devtools.demo --vllm       # or: make demo-vllm: then real vLLM (CPU) beside it
    python -m devtools.localplane down   # or: make cluster-down (stops and removes it all)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.clitools import ToolsError, ensure_cli_tools
from devtools.images import ImageBuildError, build_images
from devtools.localplane import (
    ADMIN_USER,
    OPERATOR_USER,
    ControlPlane,
    ControlPlaneError,
    build_binaries,
)
from devtools.model_volume import model_volume
from devtools.planecli import DEFAULT_STATE_DIR, bring_down, load_state
from devtools.realnode import (
    BRIDGE_ADDRESS,
    KUBELET_USER,
    NODE_WORKDIR,
    PROXY_USER,
    RealNode,
    create_bridge,
    ensure_no_other_node,
    import_archives,
)
from devtools.tiny_model import TinyModelError, ensure_tiny_model
from devtools.vllm_cpu import VllmCpuError
from devtools.vllm_image import build_vllm_image

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "pdserve"
NAMESPACE = "llm"


@dataclass(frozen=True)
class Example:
    file: Path
    name: str  # the DisaggregatedModel's
    served: str  # the model name clients send
    ready_timeout: str  # kubectl wait's


SIM = Example(REPO / "examples" / "sim-qwen3.yaml", "sim-qwen3", "sim-qwen3", "4m")
# Three vLLM processes starting on two cores, the image unpacked on first use.
VLLM = Example(REPO / "examples" / "vllm-cpu-tiny.yaml", "tiny-vllm", "tiny", "15m")


def bring_up_with_node(state_dir: Path) -> Path:
    """A detached plane with a real node (or the running one); returns the admin kubeconfig."""
    node_state = state_dir / NODE_WORKDIR / "node-state.json"
    if load_state(state_dir) is not None and node_state.exists():
        print("control plane and real node already running")
        return state_dir / f"kubeconfig-{ADMIN_USER}"
    bring_down(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    started = time.monotonic()
    images = build_images()
    ensure_no_other_node()
    create_bridge()
    plane = ControlPlane(
        workdir=state_dir, binaries=build_binaries(), address=BRIDGE_ADDRESS,
        users=(ADMIN_USER, OPERATOR_USER, KUBELET_USER, PROXY_USER),
    )  # fmt: skip
    plane.start()
    node = RealNode(plane=plane, workdir=state_dir / NODE_WORKDIR)
    try:
        node.start(images.archives)
    except BaseException:
        plane.stop()
        raise
    node.save()
    print(f"control plane and real node up in {time.monotonic() - started:.1f}s at {plane.server}")
    print(f"logs: {plane.logs} and {node.logs}")
    return plane.kubeconfig(ADMIN_USER)


def tool(
    kubeconfig: Path, name: str, *args: str, stdin: str | None = None, timeout: float = 600
) -> str:
    tools = ensure_cli_tools()
    helm_home = kubeconfig.parent / "helm"
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "HELM_CACHE_HOME": str(helm_home / "cache"),
        "HELM_CONFIG_HOME": str(helm_home / "config"),
        "HELM_DATA_HOME": str(helm_home / "data"),
    }
    binary = {"kubectl": tools.kubectl, "helm": tools.helm}[name]
    proc = subprocess.run(
        [str(binary), *args], input=stdin, capture_output=True, text=True, env=env,
        check=False, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ControlPlaneError(f"{name} {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def gateway_url(kubeconfig: Path, example: Example) -> str:
    service: dict[str, Any] = json.loads(tool(
        kubeconfig, "kubectl", "get", "svc", f"{example.name}-gateway", "-n", NAMESPACE, "-o",
        "json",
    ))  # fmt: skip
    return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}/v1"


def real_vllm_prerequisites(kubeconfig: Path, state_dir: Path) -> None:
    """The vLLM CPU image in the node's containerd and the tiny model's claim bound to it."""
    print("building (or finding) the vLLM CPU image and the tiny model (cold: ~15 minutes)")
    image = build_vllm_image()
    model = ensure_tiny_model()
    import_archives(state_dir / NODE_WORKDIR, [image.archive])
    # Three vLLM processes and the preflight probe's two pods (500m each) need the node's two
    # cores: the simulator model makes way.
    print(f"$ kubectl delete -f {SIM.file.relative_to(REPO)} --wait  # two cores for real vLLM")
    tool(kubeconfig, "kubectl", "delete", "-f", str(SIM.file), "--wait", "--ignore-not-found")
    print(f"$ kubectl apply -f - # PersistentVolume of {model}, and its claim")
    listing = {"apiVersion": "v1", "kind": "List", "items": model_volume(model, NAMESPACE)}
    print(tool(kubeconfig, "kubectl", "apply", "-f", "-", stdin=json.dumps(listing)).strip())


def deploy_and_ask(kubeconfig: Path, example: Example) -> None:
    """kubectl apply, kubectl wait for Ready, one chat completion through the gateway."""
    shown = example.file.relative_to(REPO)
    print(f"$ kubectl apply -f {shown}")
    print(tool(kubeconfig, "kubectl", "apply", "-f", str(example.file)).strip())
    print(f"$ kubectl wait --for=condition=Ready dm/{example.name} -n {NAMESPACE}")
    tool(kubeconfig, "kubectl", "wait", "--for=condition=Ready", f"dm/{example.name}", "-n",
         NAMESPACE, f"--timeout={example.ready_timeout}", timeout=1200)  # fmt: skip
    print(tool(kubeconfig, "kubectl", "get", "dm", "-A"))
    print(tool(kubeconfig, "kubectl", "get", "pods", "-n", NAMESPACE, "-o", "wide"))

    import openai

    url = gateway_url(kubeconfig, example)
    print(f"$ OpenAI(base_url={url!r}).chat.completions.create(model={example.served!r}, ...)")
    client = openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=2)
    chat = client.chat.completions.create(
        model=example.served, max_tokens=96,
        messages=[{"role": "user", "content": "What is disaggregated serving?"}],
    )  # fmt: skip
    message = chat.choices[0].message
    reasoning = getattr(message, "reasoning", None)
    if reasoning:
        print(f"reasoning: {reasoning}")
    print(f"answer: {message.content}")
    print(f"finish_reason: {chat.choices[0].finish_reason}, usage: {chat.usage}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--vllm", action="store_true",
                        help="then real vLLM's CPU build: examples/vllm-cpu-tiny.yaml")  # fmt: skip
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: make demo needs root: its real node runs containers (runc, CNI, iptables)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        kubeconfig = bring_up_with_node(args.state_dir)
        # --take-ownership: a plane still running from a chart before 0.2 has the CRD outside the
        # release (docs/operations.md#crds-and-upgrades); on a new plane it changes nothing.
        print("$ helm upgrade --install pdserve charts/pdserve -n pdserve-system --wait "
              "--take-ownership")  # fmt: skip
        tool(kubeconfig, "helm", "upgrade", "--install", "pdserve", str(CHART), "-n",
             "pdserve-system", "--create-namespace", "--wait", "--timeout", "3m",
             "--take-ownership")  # fmt: skip
        namespaces = tool(kubeconfig, "kubectl", "get", "namespaces", "-o", "name").split()
        if f"namespace/{NAMESPACE}" not in namespaces:
            tool(kubeconfig, "kubectl", "create", "namespace", NAMESPACE)
        deploy_and_ask(kubeconfig, SIM)
        if args.vllm:
            real_vllm_prerequisites(kubeconfig, args.state_dir)
            deploy_and_ask(kubeconfig, VLLM)
    except (ControlPlaneError, ImageBuildError, ToolsError, VllmCpuError, TinyModelError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={kubeconfig}")
    print(f"kubectl: {ensure_cli_tools().kubectl}  (stop everything: make cluster-down)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
