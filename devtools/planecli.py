"""The command line of the local plane: `python -m devtools.localplane up|down|build|build-lws`
(make cluster-up, cluster-down, cluster-build, lws-build), for a plane that outlives the command
that started it.

`up` records the plane's ports, tokens and process ids in <state dir>/state.json; `down` reads
them back from there (it runs as another process) and also stops the real node `make demo` left.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools import localplane
from devtools.clitools import ToolsError, cache_root, ensure_cli_tools
from devtools.localplane import ControlPlane, ControlPlaneError, build_binaries
from devtools.nodes import FakeNode, create_nodes, demo_nodes, wait_nodes_ready
from devtools.procs import pid_alive, terminate
from devtools.realnode import NODE_WORKDIR, RealNode, delete_bridge

DEFAULT_STATE_DIR = cache_root() / "dev-cluster"


def load_state(state_dir: Path) -> dict[str, Any] | None:
    """The state of a plane started by `up`, if every one of its processes is alive."""
    state_file = state_dir / "state.json"
    if not state_file.exists():
        return None
    state: dict[str, Any] = json.loads(state_file.read_text())
    return state if all(pid_alive(pid) for pid in state["pids"].values()) else None


def record_process(state_dir: Path, name: str, pid: int) -> None:
    """Add a process (e.g. the demo's operator) for `down` to stop with the plane."""
    state_file = state_dir / "state.json"
    state = json.loads(state_file.read_text())
    state["pids"][name] = pid
    state_file.write_text(json.dumps(state, indent=2))


def bring_up(state_dir: Path, nodes: Sequence[FakeNode] | None = None) -> dict[str, Any]:
    """Start a detached plane with `nodes` (default: the demo nodes), or reuse a running one;
    returns its state."""
    if (state := load_state(state_dir)) is not None:
        print(f"control plane already running at {state['server']}")
        return state
    bring_down(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    started = time.monotonic()
    plane = ControlPlane(workdir=state_dir, binaries=build_binaries())
    plane.start()
    with plane.http() as http:
        names = create_nodes(http, demo_nodes() if nodes is None else nodes)
        wait_nodes_ready(http, names, timeout=60)
    print(f"control plane up in {time.monotonic() - started:.1f}s at {plane.server}")
    print(f"fake nodes: {', '.join(names)}")
    print(f"logs: {plane.logs}")
    state = load_state(state_dir)
    assert state is not None
    return state


def bring_down(state_dir: Path) -> int:
    """Stop what `up` (or `make demo`) started in ``state_dir``, if anything; exit status 0."""
    state_file = state_dir / "state.json"
    if not state_file.exists():
        print("no local control plane is running")
        return 0
    state = json.loads(state_file.read_text())
    _stop_real_node(state_dir)
    for pid in reversed(list(state["pids"].values())):
        terminate(pid, None)
    state_file.unlink()
    print(f"stopped the control plane at {state['server']}")
    return 0


def _stop_real_node(state_dir: Path) -> None:
    """The real node `make demo` started (its containers first, while containerd still runs),
    then its bridge, so nothing of it is left."""
    plane = ControlPlane(workdir=state_dir, binaries=build_binaries(quiet=True))
    node = RealNode.saved(plane, state_dir / NODE_WORKDIR)
    if node is None:
        return
    node.stop()
    (state_dir / NODE_WORKDIR / "node-state.json").unlink()
    delete_bridge()
    print("stopped the real node")


def _cmd_up(state_dir: Path) -> int:
    state = bring_up(state_dir)
    print(f"kubectl: {ensure_cli_tools().kubectl}")
    print(f"export KUBECONFIG={state['kubeconfig']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The plane's own description: this is its command line, run as `-m devtools.localplane`.
    parser = argparse.ArgumentParser(prog="localplane", description=localplane.__doc__)
    parser.add_argument("command", choices=["up", "down", "build", "build-lws"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build_binaries().directory)
            print(ensure_cli_tools().kubectl.parent)
            return 0
        if args.command == "build-lws":
            print(build_binaries(lws=True).directory)
            return 0
        if args.command == "up":
            return _cmd_up(args.state_dir)
        return bring_down(args.state_dir)
    except (ControlPlaneError, ToolsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
