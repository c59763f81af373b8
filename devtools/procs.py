"""Component processes of the local plane and the real node: starting one with its own log and
process group, noticing that one died, and stopping a whole group, also from another command.

Nothing here knows which component it runs; the plane and the node pass in their error types.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path


def spawn_component(
    name: str, args: list[str], *, logs: Path, cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A component process writing to logs/<name>.log, in a session of its own: Ctrl-C in a
    terminal must not leave half a plane behind, and `down` from another process can stop the
    whole group."""
    with (logs / f"{name}.log").open("ab") as log:
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=cwd, env=None if env is None else {**os.environ, **env},
        )  # fmt: skip


def raise_if_exited(
    procs: Mapping[str, subprocess.Popen[bytes]], logs: Path, error: type[Exception]
) -> None:
    """Raise `error` naming the first component that exited, with the tail of its log."""
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise error(
                f"{name} exited with code {proc.returncode}; see {logs / name}.log:\n"
                + tail(logs / f"{name}.log")
            )


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def terminate(pid: int, proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds. Without ``proc`` (a
    process another command started) it can only poll the pid."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not pid_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(timeout=grace)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
