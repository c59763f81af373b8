"""Loopback ports: one already listening, whose address is handed on before its server runs;
and, for a process that must be told its port before it listens itself, a free one."""

from __future__ import annotations

import socket


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
