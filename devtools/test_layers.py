"""`make test`: every test layer, overlapped as far as two cores allow.

The control-plane and real-node layers (`cluster`, `e2e`) mostly wait: on the API server, the
controllers, the kubelet starting pods. They run beside the unit and simulator layers, their
output kept and printed whole once they end (two progress lines interleaved read as neither).
Real vLLM (`vllm`) is CPU-bound (up to five engine processes on two cores, and vLLM waits a
fixed 5 s for a NIXL handshake) and runs alone, after both. The exit status is 0 only when every
layer passed; the first failing layer's status otherwise.

    python -m devtools.test_layers [pytest arguments given to every layer]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

BESIDE = "cluster or e2e"
FIRST = "not cluster and not e2e and not vllm"
LAST = "vllm"


def pytest(marks: str, args: Sequence[str], basetemp: Path) -> list[str]:
    # Each layer its own base temporary directory: two pytest processes at once would
    # otherwise number, and clean up, the same /tmp/pytest-of-<user>.
    return [sys.executable, "-m", "pytest", "-m", marks, f"--basetemp={basetemp}", *args]


def banner(text: str) -> None:
    print(f"\n{'=' * 30} {text} {'=' * 30}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-test-layers-") as scratch:
        root = Path(scratch)
        log_path = root / "cluster-e2e.log"
        banner(f"started beside the next layer: -m '{BESIDE}' (its output follows it)")
        with log_path.open("wb") as log:
            beside = subprocess.Popen(
                pytest(BESIDE, args, root / "beside"),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # stopped as a group, with the processes it started
            )
        try:
            banner(f"-m '{FIRST}'")
            first = subprocess.call(pytest(FIRST, args, root / "first"))
            beside_status = beside.wait()
        finally:
            if beside.poll() is None:
                os.killpg(beside.pid, signal.SIGTERM)
                beside.wait()
        banner(f"-m '{BESIDE}' (ran beside the one above)")
        sys.stdout.flush()
        sys.stdout.buffer.write(log_path.read_bytes())
        sys.stdout.flush()
        banner(f"-m '{LAST}' (alone)")
        last = subprocess.call(pytest(LAST, args, root / "last"))
    statuses = {"unit and simulator": first, "cluster and e2e": beside_status, "vllm": last}
    said = [
        f"{layer} {'passed' if status == 0 else f'exit {status}'}"
        for layer, status in statuses.items()
    ]
    banner("layers: " + ", ".join(said))
    failed = [status for status in statuses.values() if status != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
