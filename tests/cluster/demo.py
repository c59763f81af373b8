"""The local demo (README's main job): a real control plane with fake H200 nodes, the pdserve
operator, and an example DisaggregatedModel, ending with `kubectl get dm`.

    python -m tests.cluster.demo          # or: make demo
    python -m tests.cluster.localplane down   # or: make cluster-down (stops the operator too)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pdserve.api import SpecError
from pdserve.manifests import load_resources
from tests.cluster.clitools import ensure_cli_tools
from tests.cluster.localplane import (
    DEFAULT_STATE_DIR,
    OPERATOR_USER,
    ControlPlaneError,
    _pid_alive,
    bring_up,
    record_process,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen2.5-7b-pd.yaml"


def kubectl(kubeconfig: str, *args: str) -> str:
    proc = subprocess.run(
        [str(ensure_cli_tools().kubectl), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ControlPlaneError(f"kubectl {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def start_operator(state_dir: Path, pids: dict[str, int]) -> None:
    if "pdserve-operator" in pids and _pid_alive(pids["pdserve-operator"]):
        print("operator already running")
        return
    log_path = state_dir / "logs" / "operator.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "operator",
             f"--kubeconfig={state_dir / f'kubeconfig-{OPERATOR_USER}'}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command; `make cluster-down` stops it
        )  # fmt: skip
    record_process(state_dir, "pdserve-operator", process.pid)
    print(f"operator started (pid {process.pid}), log: {log_path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("-f", "--filename", type=Path, default=EXAMPLE, help="resource to apply")
    args = parser.parse_args()
    try:
        state = bring_up(args.state_dir)
        config = state["kubeconfig"]
        print(kubectl(config, "apply", "--server-side", "-f", str(REPO / "crds")).strip())
        kubectl(config, "wait", "--for=condition=Established", "--timeout=60s",
                "crd/disaggregatedmodels.pdserve.io")  # fmt: skip
        start_operator(args.state_dir, state["pids"])
        namespaces = sorted({dm.namespace for dm in load_resources(args.filename)})
        for namespace in namespaces:
            if kubectl(config, "get", "namespace", "-o", "name").count(f"namespace/{namespace}\n"):
                continue
            kubectl(config, "create", "namespace", namespace)
        print(kubectl(config, "apply", "--server-side", "-f", str(args.filename)).strip())
        for namespace in namespaces:
            kubectl(config, "wait", "--for=condition=Ready", "dm", "--all", "-n", namespace,
                    "--timeout=180s")  # fmt: skip
        print(kubectl(config, "get", "dm", "-A"))
        for namespace in namespaces:
            print(kubectl(config, "get", "pods", "-n", namespace, "-o", "wide"))
    except (ControlPlaneError, SpecError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={config}")
    print(f"kubectl: {ensure_cli_tools().kubectl}  (stop everything: make cluster-down)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
