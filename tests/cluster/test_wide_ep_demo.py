"""`make demo-wide-ep` as a newcomer runs it (devtools/wide_ep_demo.py): a plane of its own with a
kwok GB200 NVL72 rack, the real LeaderWorkerSet controller, NVIDIA's DRA driver's twin and the
operator as a process; examples/deepseek-r1-gb200-wide-ep.yaml applied unchanged with kubectl
until `kubectl get dm -o wide` shows its prefill and decode groups Ready; `make cluster-down`
then leaves nothing running."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.localplane import wait_until
from devtools.lws import GROUP_INDEX_LABEL, NAME_LABEL
from devtools.nodes import RACK_FABRIC
from devtools.procs import pid_alive
from devtools.wide_ep_demo import EXAMPLE, MODEL, NAMESPACE, REPO, attached_plane

pytestmark = pytest.mark.cluster

TABLE = f"$ kubectl get dm {MODEL} -n {NAMESPACE} -o wide"


def printed_table(output: str) -> dict[str, str]:
    """The row `kubectl get dm -o wide` printed, by column (columns are 2+ spaces apart)."""
    lines = output.split(TABLE + "\n", 1)[1].splitlines()
    header, row = (re.split(r"\s{2,}", line.strip()) for line in lines[:2])
    return dict(zip(header, row, strict=True))


def test_the_wide_ep_example_shows_its_groups_ready_and_cluster_down_stops_it_all(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "plane"
    state: dict[str, Any] = {"pids": {}}
    demo = [sys.executable, "-m", "devtools.wide_ep_demo", f"--state-dir={state_dir}"]
    down = [sys.executable, "-m", "devtools.localplane", "down", f"--state-dir={state_dir}"]
    try:
        run = subprocess.run(demo, capture_output=True, text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        assert f"kubectl apply -f {EXAMPLE.relative_to(REPO)}" in run.stdout
        row = printed_table(run.stdout)
        assert (row["READY"], row["PHASE"], row["PLACED"]) == ("True", "Ready", "True"), row
        assert (row["PREFILL"], row["DECODE"]) == ("1/1 groups", "1/1 groups"), row

        state = json.loads((state_dir / "state.json").read_text())
        assert {"lws-manager", "pdserve-operator"} <= set(state["pids"])
        with attached_plane(state_dir, state).http() as http:
            pods = http.get(f"/api/v1/namespaces/{NAMESPACE}/pods").json()["items"]
            nodes = {n["metadata"]["name"]: n["metadata"]["labels"]
                     for n in http.get("/api/v1/nodes").json()["items"]}  # fmt: skip
            groups: dict[tuple[str, str], list[str]] = {}
            for pod in pods:
                labels = pod["metadata"]["labels"]
                if NAME_LABEL in labels:
                    key = (labels[NAME_LABEL], labels[GROUP_INDEX_LABEL])
                    groups.setdefault(key, []).append(pod["spec"]["nodeName"])
            # The example's shape: prefill 2 trays, decode 4, one pod per tray, all in the rack.
            assert sorted((k[0], len(v)) for k, v in groups.items()) == [
                (f"{MODEL}-decode", 4), (f"{MODEL}-prefill", 2),
            ]  # fmt: skip
            trays = [tray for members in groups.values() for tray in members]
            assert len(set(trays)) == 6
            assert {nodes[t]["nvidia.com/gpu.clique"] for t in trays} == {f"{RACK_FABRIC}.0"}

            # The transport probe covers every tray of the rack, one Job per node pair (the
            # first prefill and first decode tray with each other tray), and is scheduled
            # beside the engines, though each holds its tray's only ComputeDomain channel (the
            # probe claims none).
            def probed_trays() -> set[str]:
                listed = http.get(f"/api/v1/namespaces/{NAMESPACE}/pods").json()["items"]
                probes = [p for p in listed if "preflight" in p["metadata"]["name"]]
                return {p["spec"].get("nodeName", "") for p in probes}

            wait_until(
                "a probe pod on every tray", lambda: probed_trays() == set(trays), timeout=60
            )
            jobs = http.get(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs").json()["items"]
            assert len(jobs) == 2 + 4 - 1
    finally:
        subprocess.run(down, capture_output=True, timeout=120, check=False)
    assert not [pid for pid in state["pids"].values() if pid_alive(pid)]
    assert not (state_dir / "state.json").exists()
