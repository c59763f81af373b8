"""The local demo (README's main job), as a user would do it on a real cluster: a local control
plane with a real node (pods really run, from images built here), `helm install` of the chart
(the operator runs as a pod), `kubectl apply -f examples/sim-qwen3.yaml`, `kubectl wait` for
Ready, and one chat completion through the model's gateway Service with the OpenAI SDK.

    python -m devtools.demo              # or: make demo (root: the node runs containers)
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
from devtools.planecli import DEFAULT_STATE_DIR, bring_down, load_state
from devtools.realnode import (
    BRIDGE_ADDRESS,
    KUBELET_USER,
    NODE_WORKDIR,
    PROXY_USER,
    RealNode,
    create_bridge,
    ensure_no_other_node,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sim-qwen3.yaml"
CHART = REPO / "charts" / "pdserve"


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


def tool(kubeconfig: Path, name: str, *args: str) -> str:
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
        [str(binary), *args], capture_output=True, text=True, env=env, check=False, timeout=600
    )
    if proc.returncode != 0:
        raise ControlPlaneError(f"{name} {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def gateway_url(kubeconfig: Path) -> str:
    service: dict[str, Any] = json.loads(
        tool(kubeconfig, "kubectl", "get", "svc", "sim-qwen3-gateway", "-n", "llm", "-o", "json")
    )
    return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}/v1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: make demo needs root: its real node runs containers (runc, CNI, iptables)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        kubeconfig = bring_up_with_node(args.state_dir)
        print("$ helm upgrade --install pdserve charts/pdserve -n pdserve-system --wait")
        tool(kubeconfig, "helm", "upgrade", "--install", "pdserve", str(CHART), "-n",
             "pdserve-system", "--create-namespace", "--wait", "--timeout", "3m")  # fmt: skip
        namespaces = tool(kubeconfig, "kubectl", "get", "namespaces", "-o", "name").split()
        if "namespace/llm" not in namespaces:
            tool(kubeconfig, "kubectl", "create", "namespace", "llm")
        print("$ kubectl apply -f examples/sim-qwen3.yaml")
        print(tool(kubeconfig, "kubectl", "apply", "-f", str(EXAMPLE)).strip())
        print("$ kubectl wait --for=condition=Ready dm/sim-qwen3 -n llm")
        tool(kubeconfig, "kubectl", "wait", "--for=condition=Ready", "dm/sim-qwen3", "-n", "llm",
             "--timeout=4m")  # fmt: skip
        print(tool(kubeconfig, "kubectl", "get", "dm", "-A"))
        print(tool(kubeconfig, "kubectl", "get", "pods", "-n", "llm", "-o", "wide"))

        import openai

        url = gateway_url(kubeconfig)
        print(f"$ OpenAI(base_url={url!r}).chat.completions.create(model='sim-qwen3', ...)")
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=2)
        chat = client.chat.completions.create(
            model="sim-qwen3", max_tokens=96,
            messages=[{"role": "user", "content": "What is disaggregated serving?"}],
        )  # fmt: skip
        message = chat.choices[0].message
        reasoning = getattr(message, "reasoning", None)
        if reasoning:
            print(f"reasoning: {reasoning}")
        print(f"answer: {message.content}")
        print(f"finish_reason: {chat.choices[0].finish_reason}, usage: {chat.usage}")
    except (ControlPlaneError, ImageBuildError, ToolsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={kubeconfig}")
    print(f"kubectl: {ensure_cli_tools().kubectl}  (stop everything: make cluster-down)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
