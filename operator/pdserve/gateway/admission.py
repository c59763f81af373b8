"""The admission endpoints peer gateways call (see peers.py): what this replica counts
against the shared long-prefill limit, and holding a slot for a peer's long prefill. Both need
the peer key or an API key when one is set (intake.py checks it before they run); a hold waits in
the one fair queue like this replica's own long requests, ends at a deadline, and one peer has
at most `max_holds_per_peer` holds open (a peer cannot have more requests in flight)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import suppress

import aiohttp
from aiohttp import web

from pdserve.gateway.errors import GatewayError, error_response
from pdserve.gateway.fairqueue import LONG, PrefillAdmission
from pdserve.gateway.peers import GRANTED, PeerAdmission

ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


class AdmissionHandlers:
    def __init__(
        self,
        admission: PrefillAdmission,
        peers: PeerAdmission,
        *,
        hold_seconds: float,
        max_holds_per_peer: int = 256,
    ) -> None:
        self.admission, self.peers = admission, peers
        self.hold_seconds = hold_seconds
        """At most this long a slot is held for a peer (its prefill call's own timeout)."""
        self.max_holds_per_peer = max_holds_per_peer
        self.holds: Counter[str] = Counter()
        """Holds open (queued or granted) per peer address."""
        self.behind_data_plane = False
        """Set when this gateway serves behind its data plane (dataplane.py)."""

    def peer_address(self, request: web.Request) -> str:
        """Who is asking: the connection's address, or behind this gateway's own data plane
        (every connection then comes from loopback) the address it forwarded: the last entry of
        X-Forwarded-For, the one the data plane added."""
        forwarded = request.headers.get("X-Forwarded-For") if self.behind_data_plane else None
        if forwarded:
            return forwarded.rsplit(",", 1)[-1].strip()
        return request.remote or "unknown"

    def add_routes(self, app: web.Application, expect: ExpectHandler) -> None:
        app.router.add_get("/admission", self.admission_state, expect_handler=expect)
        app.router.add_post("/admission/hold", self.admission_hold, expect_handler=expect)

    async def admission_state(self, _: web.Request) -> web.Response:
        """What peers count against the shared long-prefill limit."""
        try:
            queue = await self.admission.fresh_state()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            queue = self.admission.state()  # the last one read
        return web.json_response(
            {
                "longInFlight": queue.long_in_flight,
                "queued": queue.queued,
                "replicas": queue.replicas,
                "heldAt": self.peers.holdings(),
            }
        )

    async def admission_hold(self, request: web.Request) -> web.StreamResponse:
        """A peer replica's long prefill waits in this replica's queue (it is the leader, see
        peers.py); `granted <replica>` answers when one of the prefill replicas it named has
        room, and the slot is held until the peer closes the connection (aiohttp then cancels
        this handler, which releases it)."""
        if (leader := self.peers.leader()) is not None:
            # Two replicas running queues at once would break the limit: the asking replica
            # admits on its own (counting this one's holdings) until their views agree.
            message = f"this replica is not the admission leader: {leader} is"
            return error_response(GatewayError(409, message, kind="ConflictError"))
        try:
            body = await request.json()
            replicas = body.get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, list) or not replicas:
                raise ValueError
            if not all(isinstance(r, str) and r for r in replicas):
                raise ValueError
        except (ValueError, TypeError):
            message = "replicas: expected the prefill replica URLs the request may use, best first"
            return error_response(GatewayError(400, message, param="replicas"))
        peer = self.peer_address(request)
        if self.holds[peer] >= self.max_holds_per_peer:
            # Queued holds are admitted anyway once they age: unbounded ones would overrun the
            # limit for every replica's documents.
            message = f"this peer already has {self.holds[peer]} admission holds open"
            return error_response(GatewayError(429, message))
        self.holds[peer] += 1
        try:
            return await self._hold(request, replicas)
        finally:
            self.holds[peer] -= 1
            if self.holds[peer] <= 0:
                del self.holds[peer]

    async def _hold(self, request: web.Request, replicas: list[str]) -> web.StreamResponse:
        # The deadline, for the peer: the slot goes back then, whatever its prefill does.
        deadline = {"X-PDServe-Hold-Seconds": f"{self.hold_seconds:g}"}
        response = web.StreamResponse(headers={"Content-Type": "text/plain", **deadline})
        async with self.admission.admit(LONG, replicas) as replica:
            try:
                await response.prepare(request)
                await response.write(f"{GRANTED} {replica}\n".encode())
            except ConnectionResetError:
                return response  # the peer left as it was granted: the slot goes back
            # Bounded like the peer's prefill call: a holder that vanished without closing its
            # connection cannot keep the slot for longer.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.hold_seconds):
                    await asyncio.Event().wait()
        return response
