"""The KV transport probe for real: two processes move data with NIXL over UCX on loopback, and
the reports tell the transport apart (shared memory vs TCP) the way the operator judges them."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.api import parse_resource
from pdserve.builders.preflight import NodePair
from pdserve.controller.transport import judge
from pdserve.ports import port_block
from pdserve.probe import kvprobe

PROBE = Path(kvprobe.__file__)


def port_pair() -> int:
    """A port p with p + 1 free as well (the client's NIXL listens on p + 1), below the ephemeral
    range: the probes bind them themselves, and an ephemeral port picked here could go to any
    process's outgoing connection first (a CI run lost that race: "Failed to bind metadata
    listener socket")."""
    return port_block(2)


def run_pair(
    tmp_path: Path, env: dict[str, str], server_late_by: float = 0.0
) -> tuple[dict[str, Any], dict[str, Any]]:
    port = port_pair()
    common = ["--peer", "127.0.0.1", "--port", str(port), "--megabytes", "8",
              "--iterations", "3", "--timeout", "60"]  # fmt: skip
    reports = {role: tmp_path / f"{role}.json" for role in ("server", "client")}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    for role in ("client", "server"):
        if role == "server" and server_late_by:
            time.sleep(server_late_by)  # the scenario: the server pod starts late, not a sync
        processes[role] = subprocess.Popen(
            [sys.executable, str(PROBE), "--role", role, "--report", str(reports[role]), *common],
            env={**env, "NODE_NAME": f"node-{role}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    outputs = {role: p.communicate(timeout=120)[0].decode() for role, p in processes.items()}
    for role, path in reports.items():
        assert path.exists(), f"{role} wrote no report:\n{outputs[role][-2000:]}"
    server, client = (json.loads(reports[r].read_text()) for r in ("server", "client"))
    return server, client


@pytest.fixture
def base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}


def test_same_host_probe_moves_intact_data_over_shared_memory(
    tmp_path: Path, base_env: dict[str, str]
) -> None:
    server, client = run_pair(tmp_path, base_env)
    assert client["ok"], client
    assert server["ok"], server
    assert client["dataIntact"] is True
    assert client["backend"] == "UCX"
    assert client["transport"] == "shm", client["readPath"]
    assert client["bandwidthGBps"] > 0
    assert server["bytes"] == client["bytes"] == 8 * 2**20
    assert len(json.dumps(client)) < kvprobe.REPORT_LIMIT


def test_a_server_that_starts_after_the_client_is_waited_for(
    tmp_path: Path, base_env: dict[str, str]
) -> None:
    """Job pods start in any order: the client repeats the metadata exchange until the server
    listens."""
    server, client = run_pair(tmp_path, base_env, server_late_by=3.0)
    assert client["ok"], client
    assert server["ok"], server


def test_tcp_only_ucx_is_reported_as_tcp_and_judged_a_fallback(
    tmp_path: Path, base_env: dict[str, str]
) -> None:
    server, client = run_pair(tmp_path, {**base_env, "UCX_TLS": "tcp"})
    assert client["ok"], client
    assert client["transport"] == "tcp"
    assert any(lane.startswith("tcp/") for lane in client["readPath"])
    assert client["ucxTls"] == "tcp"

    body: dict[str, Any] = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"model": {"name": "org/model"}, "prefill": {},
                 "placement": {"rdma": {"resource": "rdma/hca"}, "guaranteedQoS": False}},
    }  # fmt: skip
    dm = parse_resource(copy.deepcopy(body))
    # This machine has no RDMA device at all, and the data went over TCP: both are named.
    verdict = judge(dm, 0, NodePair("node-server", "node-client"), [server, client])
    assert (verdict.verified, verdict.reason) == (False, "NoRDMADevice")
    assert "placement.rdma is set but the data went over tcp" in verdict.message
    assert verdict.transport == "tcp"


def test_a_probe_without_a_peer_reports_the_failure(tmp_path: Path) -> None:
    report_path = tmp_path / "client.json"
    result = subprocess.run(
        [sys.executable, str(PROBE), "--role", "client", "--peer", "no-such-host.invalid",
         "--port", str(port_pair()), "--timeout", "2", "--report", str(report_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    report = json.loads(report_path.read_text())
    assert report["ok"] is False
    assert "DNS name no-such-host.invalid" in report["error"]


# `nvidia-smi topo -p2p r` separates its columns with tabs.
NVIDIA_SMI_P2P = "\n".join(
    "\t".join(row)
    for row in (
        [" ", "GPU0", "GPU1", "GPU2", "GPU3"],
        [" GPU0", "X", "OK", "OK", "NS"],
        [" GPU1", "OK", "X", "OK", "NS"],
        [" GPU2", "OK", "OK", "X", "NS"],
        [" GPU3", "NS", "NS", "NS", "X"],
        [""],
        ["Legend:"],
        ["  X    = Self"],
        ["  OK   = Status Ok"],
        ["  NS   = Not supported"],
    )
)


def test_p2p_matrix_and_read_lanes_are_parsed() -> None:
    assert kvprobe.parse_p2p(NVIDIA_SMI_P2P) == {"status": "NS", "gpus": 4, "notOk": ["NS"]}
    assert kvprobe.parse_p2p(NVIDIA_SMI_P2P.replace("NS", "OK"))["status"] == "OK"
    table = """\
[1] [h:1 :0]   | client inter-node cfg#2                                          |
[1] [h:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1] [h:1 :0]   +--------+-------------+-------------------------------------------+
[1] [h:1 :0]   | 0..8k  | short       | rc_mlx5/mlx5_0:1                          |
[1] [h:1 :0]   | 8k..inf| zero-copy   | rc_mlx5/mlx5_0:1, rc_mlx5/mlx5_1:1        |
[1] [h:1 :0]   | client inter-node cfg#2                                          |
[1] [h:1 :0]   | active message by ucp_am_send* from host memory                  |
[1] [h:1 :0]   | 0..inf | zero-copy   | tcp/eth0                                  |
"""
    assert kvprobe.read_path(table) == ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"]
    assert kvprobe.classify("rc_mlx5/mlx5_0:1") == "rdma"
    assert kvprobe.classify("cuda_ipc/cuda") == "cuda_ipc"
