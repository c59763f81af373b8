"""Measure the time from DisaggregatedModel creation to Ready on the local control plane.

    python -m devtools.measure_ready --count 1 --count 50

For each count: a fresh plane (its own fake GPU nodes, enough for every pool), the CRD, the
operator as its own process; N resources created at once; each one's Ready time is taken from a
watch (status.conditions Ready=True for the current generation). Prints p50/p95/max per count,
the operator's API requests per model (from the audit log), and the CPU seconds each process of
the plane and the operator spent from the first create to the last Ready (the machine's cores
are shared by all of them: what bounds the time once the operator waits for nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.localplane import OPERATOR_USER, running_control_plane, wait_until
from devtools.nodes import cpu_node, create_nodes, gpu_node, wait_nodes_ready
from devtools.operator_proc import running_operator
from devtools.planecommands import WRITE_VERBS
from devtools.resources import APPLY, SMALL_PD_SPEC, dm_url
from pdserve.api.crd import build_crd

NAMESPACE = "bench"


@dataclass
class Run:
    seconds: list[float]  # creation -> Ready, per resource that became Ready
    requests: int  # the operator's API requests (audit log), reads and writes
    writes: int
    cpu: dict[str, float]  # process -> CPU seconds from the first create to the last Ready
    by_request: Counter[str]  # "verb resource[/subresource]" -> the operator's requests


def request_kind(event: dict[str, Any]) -> str:
    ref = event.get("objectRef") or {}
    resource = ref.get("resource") or event.get("requestURI", "?").split("?")[0]
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{event.get('verb')} {resource}{sub}"


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(count: int) -> Run:
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(Path(tmp) / "plane") as plane:
        gpu_nodes = max(2, (2 * count + 7) // 8)  # 2 GPUs per resource, 8 per node
        with plane.http() as http:
            nodes = [gpu_node(f"gpu-{i}") for i in range(gpu_nodes)]
            nodes += [cpu_node(f"cpu-{i}") for i in range(max(2, count // 10))]
            wait_nodes_ready(http, create_nodes(http, nodes), timeout=120)
            crd = build_crd()
            http.patch(
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
                params={"fieldManager": "bench", "force": "true"}, content=json.dumps(crd),
                headers=APPLY,
            ).raise_for_status()  # fmt: skip
            wait_until("the CRD", lambda: http.get(dm_url("default")).status_code == 200,
                       timeout=30)  # fmt: skip
            http.post("/api/v1/namespaces", json={"metadata": {"name": NAMESPACE}})
            account = f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"
            wait_until("the default ServiceAccount", lambda: http.get(account).is_success,
                       timeout=30)  # fmt: skip

        with running_operator(plane, Path(tmp), resync_seconds=60) as operator:
            processes = {**plane.pids, "operator": operator.process.pid}
            created: dict[str, float] = {}
            ready: dict[str, float] = {}
            done = threading.Event()

            def watch() -> None:
                with plane.http() as watcher, watcher.stream(
                    "GET", dm_url(NAMESPACE), params={"watch": "1", "timeoutSeconds": "600"},
                    timeout=620,
                ) as stream:  # fmt: skip
                    for line in stream.iter_lines():
                        obj = json.loads(line)["object"]
                        name = obj["metadata"]["name"]
                        status = obj.get("status") or {}
                        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
                        if conditions.get("Ready") == "True" and name not in ready:
                            ready[name] = time.monotonic()
                            if len(ready) == count:
                                done.set()
                                return

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            time.sleep(0.5)  # let the watch open before the first create (measurement only)
            cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            with plane.http() as http:
                for index in range(count):
                    name = f"model-{index:03d}"
                    meta = {"name": name, "namespace": NAMESPACE}
                    body = {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
                            "metadata": meta, "spec": SMALL_PD_SPEC}  # fmt: skip
                    created[name] = time.monotonic()
                    http.post(dm_url(NAMESPACE), json=body).raise_for_status()
            if not done.wait(timeout=600):
                print(f"only {len(ready)}/{count} became Ready within 600 s", file=sys.stderr)
            cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in processes.items()}
            seen = plane.audit_events(user=OPERATOR_USER, writes_only=False)
            writes = [e for e in seen if e.get("verb") in WRITE_VERBS]
            return Run(sorted(ready[n] - created[n] for n in ready), len(seen), len(writes), cpu,
                       Counter(map(request_kind, seen)))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--count", type=int, action="append", help="resources per run (repeatable)")
    args = parser.parse_args()
    for count in args.count or [1, 50]:
        started = time.monotonic()
        run = measure(count)
        seconds = run.seconds
        total = time.monotonic() - started
        p95 = seconds[max(0, round(0.95 * len(seconds)) - 1)] if seconds else float("nan")
        print(
            f"{count:>3} DisaggregatedModels: {len(seconds)} Ready; creation -> Ready "
            f"p50 {statistics.median(seconds):.2f}s, p95 {p95:.2f}s, max {max(seconds):.2f}s; "
            f"operator API requests per model {run.requests / count:.1f} "
            f"({run.writes / count:.1f} writes) (run incl. plane start {total:.0f}s)",
            flush=True,
        )
        by_process = ", ".join(
            f"{name} {seconds:.1f}"
            for name, seconds in sorted(run.cpu.items(), key=lambda i: -i[1])
        )
        kinds = ", ".join(f"{kind} {n / count:.1f}" for kind, n in run.by_request.most_common())
        print(f"    operator requests per model: {kinds}", flush=True)
        print(f"    CPU seconds, first create to last Ready: {by_process} "
              f"(total {sum(run.cpu.values()):.1f})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
