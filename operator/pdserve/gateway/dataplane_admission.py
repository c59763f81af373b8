"""Fair prefill admission for the data plane's long prompts: one kept-open loopback connection
on which the data plane asks for long-prefill slots and gives them back, line by line, so a
long prompt costs this gateway two short lines instead of an HTTP request held open.

    data plane -> gateway   hello <token>                 (first, once)
    data plane -> gateway   acquire <id> <url> [<url>...] (prefill replicas, best first)
    gateway -> data plane   granted <id> <url>
    data plane -> gateway   release <id>

A slot is taken as this gateway's own long requests take theirs (PeerAdmission.slot: from the
admission leader when there is one, else from this replica's queue) and goes back on release,
after `hold_seconds` (a holder that forgot it), or when the connection closes (the data plane
died: its prefills died with it)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass
from functools import partial

from pdserve.gateway.fairqueue import LONG
from pdserve.gateway.peers import GRANTED, PeerAdmission

log = logging.getLogger("pdserve.gateway")
MAX_LINE = 64 * 1024


class AdmissionChannel:
    def __init__(self, peers: PeerAdmission, token: str, *, hold_seconds: float) -> None:
        self.peers, self.token, self.hold_seconds = peers, token, hold_seconds
        self.server: asyncio.Server | None = None
        self.held = 0
        """Slots held for the data plane right now (granted, not released)."""

    async def start(self) -> str:
        """Listen on loopback; the address the data plane is to connect to."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_LINE)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        holds: dict[str, _Hold] = {}
        try:
            hello = (await reader.readline()).decode(errors="replace").split()
            if (
                len(hello) != 2
                or hello[0] != "hello"
                or not hmac.compare_digest(hello[1], self.token)
            ):
                return  # not this gateway's data plane
            while line := await reader.readline():
                word, *rest = line.decode(errors="replace").split() or [""]
                if word == "acquire" and len(rest) >= 2 and rest[0] not in holds:
                    hold_id = rest[0]
                    hold = holds[hold_id] = _Hold(asyncio.Event())
                    hold.task = asyncio.create_task(self._hold(hold_id, rest[1:], hold, writer))
                    hold.task.add_done_callback(partial(_forget, holds, hold_id))
                elif word == "release" and len(rest) == 1 and rest[0] in holds:
                    holds[rest[0]].release()
                else:
                    log.warning("data plane admission: unexpected line %r", line[:120])
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a line past MAX_LINE, or the data plane went away
        finally:
            for hold in list(holds.values()):
                if hold.task is not None:
                    hold.task.cancel()
            writer.close()

    async def _hold(
        self, hold_id: str, replicas: list[str], hold: _Hold, writer: asyncio.StreamWriter
    ) -> None:
        async with self.peers.slot(LONG, replicas) as granted:
            hold.granted = True
            writer.write(f"{GRANTED} {hold_id} {granted or replicas[0]}\n".encode())
            self.held += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.hold_seconds):
                        await hold.released.wait()
            finally:
                self.held -= 1


def _forget(holds: dict[str, _Hold], hold_id: str, _: object) -> None:
    holds.pop(hold_id, None)


@dataclass
class _Hold:
    released: asyncio.Event
    task: asyncio.Task[None] | None = None
    granted: bool = False

    def release(self) -> None:
        """Given back: a slot still waited for is not waited for any more."""
        self.released.set()
        if not self.granted and self.task is not None:
            self.task.cancel()
