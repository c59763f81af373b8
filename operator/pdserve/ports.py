"""Loopback ports: one already listening, whose address is handed on before its server runs;
and, for a process that must be told its port before it listens itself, a free one."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where port_block looks: above the well-known and common service ports, below Linux's default
# ephemeral range (32768-60999), which is read from the kernel where it says otherwise.
BLOCK_FLOOR = 20000


def listening_socket(port: int = 0) -> socket.socket:
    """A loopback socket already listening (port 0: the kernel picks one), so its address can
    be handed on before the server runs, and no other process can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def free_port() -> int:
    """Only for a process that takes its port as a flag and binds it itself (a child we start):
    another process may take the port in between. A listener of ours uses listening_socket."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_block(count: int, attempts: int = 200) -> int:
    """The first of `count` consecutive free loopback ports, below the kernel's ephemeral
    range, for a child that binds them itself (vLLM's NIXL side channel listens on base + each
    data-parallel rank). free_port's ports are ephemeral ones, which any process's outgoing
    connection may take before the child binds them; one out of that range only another
    port_block caller could, and each picks at random."""
    try:
        ceiling = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ceiling = 32768
    for _ in range(attempts):
        base = random.randrange(BLOCK_FLOOR, max(BLOCK_FLOOR + 1, ceiling - count))
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise OSError(f"no {count} consecutive free loopback ports in {BLOCK_FLOOR}-{ceiling}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
