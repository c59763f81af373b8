"""Ports for children that bind them themselves: a block below the kernel's ephemeral range,
free when handed out, so no process's outgoing connection takes one meanwhile."""

from __future__ import annotations

import socket

from pdserve.ports import EPHEMERAL_RANGE, port_block


def test_a_block_is_free_and_below_the_ephemeral_range() -> None:
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    base = port_block(4)
    assert base + 4 <= low
    held = []
    try:
        for port in range(base, base + 4):  # each one binds: the block was free
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            held.append(sock)
        # Taken now: another block never overlaps them.
        for _ in range(20):
            other = port_block(4)
            assert not set(range(other, other + 4)) & set(range(base, base + 4))
    finally:
        for sock in held:
            sock.close()
