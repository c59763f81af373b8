"""What a real node leaves on this machine outside its own processes, and removing it: network
namespaces, mounts, kubepods cgroups, files in fixed host directories, shims, iptables rules.

realnode.py snapshots the host before a node starts, so teardown removes only what the node
added; tests of the teardown list what is left with the same helpers (realnode.leftovers).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from devtools.localplane import ControlPlaneError

CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")
# Fixed paths outside the work directory that the node writes to: the kubelet's links to each
# container's log, and libcni's cache of each sandbox's network.
HOST_DIRS = (Path("/var/log/containers"), Path("/var/lib/cni/results"))
# kube-proxy's, the kubelet's and the CNI plugins' iptables chains; no other program here uses
# these prefixes.
NODE_RULE = re.compile(r"\b(KUBE|CNI)-")


class NodeError(ControlPlaneError):
    """The real node could not be set up, started or torn down."""


def run(args: Sequence[str], *, check: bool = True, timeout: float = 60) -> str:
    """A host command's stdout; NodeError naming it, with its stderr, if it fails and ``check``."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def netns() -> list[str]:
    return [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.exists() else []


def host_entries() -> list[str]:
    return [str(p) for d in HOST_DIRS if d.is_dir() for p in d.iterdir()]


def mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve()) + "/"
    return [m for m in _mount_points() if (m + "/").startswith(prefix)]


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        # Spaces and other odd characters in a mount point are octal-escaped.
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]))
    return points


def processes_mentioning(marker: str) -> list[int]:
    """Every process whose command line holds ``marker`` (e.g. a node's containerd socket,
    which each of its shims is given)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
    return found


def kubepods_cgroups() -> list[Path]:
    """The kubelet's kubepods hierarchy, in every cgroup controller that has one."""
    hierarchies = CGROUP_ROOT.iterdir() if CGROUP_ROOT.exists() else ()
    return [h / "kubepods" for h in hierarchies if (h / "kubepods").is_dir()]


def remove_netns(before: set[str]) -> None:
    for name in set(netns()) - before:
        run(["ip", "netns", "delete", name], check=False)


def remove_host_entries(before: set[str]) -> None:
    for entry in set(host_entries()) - before:
        path = Path(entry)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def kill_processes_mentioning(marker: str) -> None:
    for pid in processes_mentioning(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def unmount_under(directory: Path) -> None:
    """Every mount under ``directory`` (pod volumes, rootfs overlays, sandbox shm), deepest
    first; a few rounds, as unmounting one can uncover another."""
    for _ in range(3):
        mounts = mounts_under(directory)
        if not mounts:
            return
        for mount in sorted(mounts, key=len, reverse=True):
            run(["umount", "--lazy", mount], check=False)
    raise NodeError(f"mounts left under {directory}: {mounts}")


def remove_kubepods_cgroups() -> None:
    """Leaves first: a cgroup directory can only be removed once it has no children."""
    for top in kubepods_cgroups():
        for directory in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def node_iptables_rules() -> list[str]:
    rules = run(["iptables-save"], check=False)
    return [line for line in rules.splitlines() if NODE_RULE.search(line)]


def remove_node_iptables_rules() -> None:
    """The kubelet's own chains (KUBE-FIREWALL, canaries), which `kube-proxy --cleanup` leaves,
    and anything of kube-proxy's or CNI's left by a process that died: every rule and chain
    named KUBE-* or CNI-*, in IPv4 and IPv6, and nothing else."""
    for save, restore in (("iptables-save", "iptables-restore"),
                          ("ip6tables-save", "ip6tables-restore")):  # fmt: skip
        if shutil.which(save) is None:
            continue
        rules = run([save], check=False)
        kept = [line for line in rules.splitlines() if not NODE_RULE.search(line)]
        if len(kept) != len(rules.splitlines()):
            subprocess.run([restore], input="\n".join(kept) + "\n", text=True, check=False)
