"""KV transport probe, run by the preflight Job inside the engine image (NIXL + UCX, the stack
vLLM's NixlConnector uses). Standalone on purpose: stdlib, numpy and nixl only, no pdserve.

Two pods per slice, one on a prefill node and one on a decode node: `--role server` registers a
buffer and serves it; `--role client` pulls it with NIXL READs, timing them. UCX reports which
transport carried the data (UCX_PROTO_INFO), so a silent fallback from RDMA to TCP is seen, not
guessed. Each pod writes one JSON report to /dev/termination-log (the operator reads it from the
pod status) and to stdout."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPORT_PATH = "/dev/termination-log"
REPORT_LIMIT = 3500  # the kubelet keeps 4096 bytes of a termination message
# UCX transport names (as in UCX_PROTO_INFO tables) -> the class the operator judges.
TRANSPORT_CLASSES = (
    ("cuda_ipc", "cuda_ipc"),
    ("rc_", "rdma"),
    ("dc_", "rdma"),
    ("ud_", "rdma"),
    ("rc/", "rdma"),
    ("ud/", "rdma"),
    ("ib/", "rdma"),
    ("mlx5", "rdma"),
    ("gga", "rdma"),
    ("tcp", "tcp"),
    ("posix", "shm"),
    ("sysv", "shm"),
    ("cma", "shm"),
    ("xpmem", "shm"),
    ("knem", "shm"),
)


def rdma_devices(root: str = "/sys/class/infiniband") -> list[dict[str, Any]]:
    """Every RDMA port the pod can see, with its state and link layer."""
    found = []
    for port in sorted(glob.glob(f"{root}/*/ports/*")):
        path = Path(port)

        def read(name: str, at: Path = path) -> str:
            try:
                return (at / name).read_text().strip()
            except OSError:
                return ""

        state = read("state")  # "4: ACTIVE"
        found.append(
            {
                "device": path.parent.parent.name,
                "port": int(path.name) if path.name.isdigit() else path.name,
                "state": state.split(":", 1)[-1].strip() or "UNKNOWN",
                "linkLayer": read("link_layer") or "unknown",
            }
        )
    return found


def p2p_matrix() -> dict[str, Any]:
    """`nvidia-smi topo -p2p r`: OK when every GPU pair can read peer-to-peer."""
    if shutil.which("nvidia-smi") is None:
        return {"status": "unavailable", "detail": "nvidia-smi not found"}
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-p2p", "r"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"status": "unavailable", "detail": str(error)}
    if out.returncode != 0:
        return {"status": "unavailable", "detail": (out.stderr or out.stdout).strip()[:200]}
    return parse_p2p(out.stdout)


def parse_p2p(text: str) -> dict[str, Any]:
    cells: list[str] = []
    gpus = 0
    for line in text.splitlines():
        parts = line.split()
        # Rows start with a GPU name and hold statuses; the header row holds GPU names.
        if len(parts) > 1 and re.fullmatch(r"GPU\d+", parts[0]) and not parts[1].startswith("GPU"):
            gpus += 1
            cells += [c for c in parts[1:] if c != "X"]
    if gpus == 0:
        return {"status": "unavailable", "detail": "no GPU rows in nvidia-smi output"}
    bad = sorted({c for c in cells if c != "OK"})
    return {"status": "OK" if not bad else "NS", "gpus": gpus, "notOk": bad}


def classify(config: str) -> str:
    lowered = config.lower()
    for marker, kind in TRANSPORT_CLASSES:
        if marker in lowered:
            return kind
    return "unknown"


def read_path(ucx_log: str) -> list[str]:
    """The UCX lanes of NIXL's READ (ucp_get) for large messages, from the protocol tables that
    UCX_PROTO_INFO=y prints: e.g. ["rc_mlx5/mlx5_0:1"], ["tcp/eth0"], ["cma/memory"]."""
    lanes: list[str] = []
    in_read_table = False
    for line in ucx_log.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and "cfg#" in cells[0]:
            in_read_table = False
        elif len(cells) == 1:
            in_read_table = "remote memory read" in cells[0] or in_read_table
        elif in_read_table and len(cells) >= 3 and cells[0].endswith("inf"):
            lanes += [lane.strip() for lane in cells[-1].split(",") if lane.strip()]
    return sorted(set(lanes))


def write_report(report: dict[str, Any], path: str) -> None:
    text = json.dumps(report, separators=(",", ":"), sort_keys=True)
    if len(text) > REPORT_LIMIT:
        report = {k: v for k, v in report.items() if k not in ("detail", "rdmaDevices")}
        report["truncated"] = True
        text = json.dumps(report, separators=(",", ":"), sort_keys=True)
    print(text, flush=True)
    try:
        with open(path, "w") as out:
            out.write(text)
    except OSError:
        pass  # not in a pod


def wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def resolve(host: str, timeout: float) -> str:
    def lookup() -> str | None:
        try:
            return socket.gethostbyname(host)
        except OSError:
            return None

    return str(wait_for(f"DNS name {host}", lookup, timeout))


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    size = args.megabytes * 1024 * 1024
    buffer = np.ones(size, dtype=np.uint8) if args.role == "server" else np.zeros(size, np.uint8)
    config = nixl_agent_config(True, True, args.port if args.role == "server" else args.port + 1)
    agent = nixl_agent(args.role, config)
    region = (buffer.ctypes.data, size, 0)  # host memory: the probe holds no GPU
    agent.register_memory([(*region, "")], "DRAM")
    local = agent.get_xfer_descs([region], "DRAM")
    if args.role == "server":
        # The client connects to us; once its metadata arrived, hand it our buffer's descriptors
        # and wait until it says it is done.
        wait_for(
            "the client's metadata", lambda: agent.check_remote_metadata("client"), args.timeout
        )
        agent.send_notif("client", agent.get_serialized_descs(local))
        notes: list[bytes] = []

        def done() -> bool:
            notes.extend(agent.get_new_notifs().get("client", []))
            return any(n.startswith(b"done") for n in notes)

        wait_for("the client to finish", done, args.timeout)
        result = json.loads(next(n for n in notes if n.startswith(b"done"))[4:])
        return {"role": "server", **result}
    server_ip = resolve(args.peer, args.timeout)
    # The two pods start independently: until the server listens, an exchange is lost, so
    # repeat it until the server's metadata arrives.
    deadline = time.monotonic() + args.timeout
    while True:
        agent.fetch_remote_metadata("server", server_ip, args.port)
        agent.send_local_metadata(server_ip, args.port)
        try:
            wait_for("the server's metadata", lambda: agent.check_remote_metadata("server"), 2.0)
            break
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {args.timeout:.0f}s waiting for the server at "
                    f"{server_ip}:{args.port}"
                ) from None
    notes = []

    def descriptors() -> bytes | None:
        notes.extend(agent.get_new_notifs().get("server", []))
        return notes[0] if notes else None

    remote = agent.deserialize_descs(
        wait_for("the server's descriptors", descriptors, args.timeout)
    )
    # Metadata fetched before the server registered its buffer lacks it: fetch again until the
    # descriptors it sent are known.
    deadline = time.monotonic() + args.timeout
    while not agent.check_remote_metadata("server", remote):
        if time.monotonic() > deadline:
            raise TimeoutError("the server's metadata never listed its buffer")
        agent.fetch_remote_metadata("server", server_ip, args.port)
        time.sleep(0.05)  # a retry period for the peer's answer, not synchronization
    handle = agent.initialize_xfer("READ", local, remote, "server")
    seconds = []
    for _ in range(args.iterations):
        started = time.perf_counter()
        state = agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed to start")
        while (state := agent.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        seconds.append(time.perf_counter() - started)
    intact = bool(buffer.min() == 1)
    best = min(seconds)
    result = {
        "bytes": size,
        "iterations": args.iterations,
        "bandwidthGBps": round(size / best / 1e9, 3),
        "latencyMs": round(sorted(seconds)[len(seconds) // 2] * 1000, 3),
        "dataIntact": intact,
        "backend": agent.query_xfer_backend(handle),
    }
    agent.send_notif("server", b"done" + json.dumps(result).encode())
    agent.release_xfer_handle(handle)
    if not intact:
        raise RuntimeError("transferred data does not match what the server sent")
    return {"role": "client", **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--role",
        choices=["server", "client", "auto"],
        default="auto",
        help="auto: server for Job completion index 0, client otherwise",
    )
    parser.add_argument("--peer", default=os.environ.get("PROBE_PEER", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PROBE_PORT", "5599")))
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--report", default=REPORT_PATH)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "auto":
        index = os.environ.get("JOB_COMPLETION_INDEX", "0")
        args.role = "server" if index == "0" else "client"
    if args.child:
        print("PROBE_RESULT " + json.dumps(run_probe(args)), flush=True)
        return 0
    report: dict[str, Any] = {
        "role": args.role,
        "node": os.environ.get("NODE_NAME", socket.gethostname()),
        "rdmaDevices": rdma_devices(),
        "p2p": p2p_matrix(),
        "ucxTls": os.environ.get("UCX_TLS", ""),
    }
    # The transfer runs in a child process so UCX's protocol tables land in a file we read.
    with tempfile.TemporaryDirectory() as workdir:
        log_file = os.path.join(workdir, "ucx.log")
        env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_file}
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--child",
                "--role",
                args.role,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=args.timeout + 30,
        )
        ucx_log = "".join(Path(p).read_text(errors="replace") for p in glob.glob(f"{log_file}*"))
    ucx_log += child.stdout + child.stderr
    result = next(
        (
            json.loads(line[13:])
            for line in child.stdout.splitlines()
            if line.startswith("PROBE_RESULT ")
        ),
        None,
    )
    lanes = read_path(ucx_log)
    report["readPath"] = lanes
    report["transport"] = classify(lanes[0]) if lanes else "unknown"
    if result is None:
        report["ok"] = False
        report["error"] = (child.stderr.strip().splitlines() or ["probe exited"])[-1][:300]
    else:
        report.update(result)
        report["ok"] = True
    write_report(report, args.report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
