"""Run `pdserve operator` as its own process against the local plane, with its own identity so
the API server's audit log attributes its writes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from devtools.localplane import OPERATOR_USER, ControlPlane, wait_until


@dataclass
class RunningOperator:
    process: subprocess.Popen[bytes]
    log: Path

    def in_sync_count(self, namespace: str, name: str) -> int:
        return self.log.read_text().count(f"{namespace}/{name}: children in sync")

    def story(self, namespace: str, name: str) -> str:
        """The operator's log lines about one model, passes that changed nothing left out: what
        a failing assertion shows (status patches, applies, failed passes)."""
        lines = self.log.read_text().splitlines()
        about = [line for line in lines if namespace in line and "children in sync" not in line]
        return "\n".join(about[-60:])


@contextlib.contextmanager
def running_operator(
    plane: ControlPlane, workdir: Path, *, resync_seconds: float, extra_args: Sequence[str] = ()
) -> Iterator[RunningOperator]:
    log = workdir / "operator.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "operator",
             f"--kubeconfig={plane.kubeconfig(OPERATOR_USER)}",
             f"--resync-seconds={resync_seconds}", "--log-level=DEBUG", *extra_args],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    running = RunningOperator(process, log)
    try:
        wait_until(
            "the operator to start",
            lambda: (
                "Initial authentication has finished" in log.read_text()
                or process.poll() is not None
            ),
            timeout=30,
        )
        assert process.poll() is None, log.read_text()
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
