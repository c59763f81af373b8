"""Fair prefill admission between this gateway and its data plane: one kept-open loopback
connection (the data plane opens it at start and again if it closes) on which each side asks the
other for long-prefill slots, line by line, so a long prompt costs two short lines at most, and
none at all for one the data plane admits itself. The asker's ids are its own:

    data plane -> gateway   hello <token>                 (first, once per connection)
    either -> the other     acquire <id> <url> [<url>...] (prefill replicas, best first)
    the other -> the asker  granted <id> <url>
    asker -> the other      release <id>

This replica's fair queue runs in the data plane (dataplane/fairqueue.go): its own long prompts
wait there with no line at all, and this gateway's long requests (and its peers', while it is
their admission leader) are asked for here (`admit`), so one queue decides and the limit is
exact. The data plane asks this gateway only while another replica is the admission leader
(`leaderElsewhere` in the routing table): the slot is then taken as this gateway's own long
requests take theirs (PeerAdmission.slot) and goes back on release, after `hold_seconds` (a
holder that forgot it), or when the connection closes (the data plane died: its prefills died
with it)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdserve.gateway.fairqueue import LONG, QueueState
from pdserve.gateway.peers import GRANTED, PeerAdmission

log = logging.getLogger("pdserve.gateway")
MAX_LINE = 64 * 1024


class AdmissionChannel:
    def __init__(self, peers: PeerAdmission, token: str, *, hold_seconds: float) -> None:
        self.peers, self.token, self.hold_seconds = peers, token, hold_seconds
        self.server: asyncio.Server | None = None
        self.held = 0
        """Slots held for the data plane right now (granted, not released)."""
        self.state = QueueState({}, 0, 0.0, 0)
        """The data plane's queue as its last /stats reported it (dataplane.py folds it in)."""
        self.admits_here = False
        """Whether the data plane's own long prompts wait in its queue (else: the leader's)."""
        self.refresh: Callable[[], Awaitable[None]] | None = None
        """Reads the data plane's queue afresh into `state` (dataplane.py sets it)."""
        self.connected = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._asks: dict[str, asyncio.Future[str]] = {}
        self._ids = itertools.count(1)

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

    def fold_state(self, stats: Mapping[str, Any]) -> None:
        """The data plane's queue from its /stats (`admission`; absent: nothing queued there)."""
        self.state = QueueState.parse(stats.get("admission"))
        self.admits_here = bool((stats.get("admission") or {}).get("admitsHere"))

    @contextlib.asynccontextmanager
    async def admit(self, replicas: Sequence[str]) -> AsyncIterator[str]:
        """Hold a slot on one of `replicas` (best first) from the data plane's queue, where this
        replica's long prompts wait, and yield it. Without a connection to wait in (the data
        plane starting, or gone: this gateway then stops) or a grant within twice the queue's
        aging bound, the request goes on its first choice, as an aged one would."""
        bound = 2 * self.peers.admission.settings.max_wait_seconds + 1
        ask = str(next(self._ids))
        writer: asyncio.StreamWriter | None = None
        granted = replicas[0]
        try:
            async with asyncio.timeout(bound):
                await self.connected.wait()
                writer = self._writer
                assert writer is not None
                future = self._asks[ask] = asyncio.get_running_loop().create_future()
                writer.write(f"acquire {ask} {' '.join(replicas)}\n".encode())
                granted = await future
        except (TimeoutError, ConnectionError) as error:
            why = str(error) or f"no grant within {bound:g} s"
            log.warning("data plane admission: %s; admitting on %s", why, granted)
        except asyncio.CancelledError:
            self._give_back(ask, writer)  # the client left while it waited
            raise
        try:
            yield granted
        finally:
            self._give_back(ask, writer)

    def _give_back(self, ask: str, writer: asyncio.StreamWriter | None) -> None:
        """Release an ask, granted or still queued (the data plane forgets it either way)."""
        self._asks.pop(ask, None)
        if writer is not None and writer is self._writer and not writer.is_closing():
            writer.write(f"release {ask}\n".encode())

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
            self._connect(writer)
            while line := await reader.readline():
                word, *rest = line.decode(errors="replace").split() or [""]
                if word == GRANTED and len(rest) == 2:
                    future = self._asks.get(rest[0])
                    if future is not None and not future.done():
                        future.set_result(rest[1])
                elif word == "acquire" and len(rest) >= 2 and rest[0] not in holds:
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
            self._disconnect(writer)
            writer.close()

    def _connect(self, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:
            self._disconnect(self._writer)  # the data plane reconnected: the old one is gone
        self._writer = writer
        self.connected.set()

    def _disconnect(self, writer: asyncio.StreamWriter) -> None:
        """The connection's asks are gone with it (the data plane gave their slots back)."""
        if self._writer is not writer:
            return
        self._writer = None
        self.connected.clear()
        for future in self._asks.values():
            if not future.done():
                future.set_exception(ConnectionError("the data plane's connection closed"))
        self._asks.clear()

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
